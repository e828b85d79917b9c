// bench_deploy: the deploy agent closed-loop with simulated ranks over TCP loopback.
//
//   bench_deploy latency [--ranks 1024] [--steps 600] [--step-ms 50] ...
//     The agent runs in this process; the simulated cluster in a child process (this program
//     re-executed), so the agent's CPU time and peak RSS (getrusage) are its own. Prints the
//     decision latency (last telemetry of an interval arriving -> decision; -> PlanPrepare for
//     switches), planner figures, and the agent's CPU and memory.
//   bench_deploy straggler [--ranks 64] ...
//     A rank slowed 3x mid-run, with and without the agent: steps to detection, to the committed
//     switch, and true throughput (cost model under the true conditions) before, during, after.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/runtime/agent.h"
#include "agent/runtime/metrics.h"
#include "agent/runtime/sim_cluster.h"

using namespace parapilot;
using namespace parapilot::agent::runtime;

namespace {

const char* kSecret = "bench-deploy-secret-0123456789";

struct Args {
  std::string mode = "latency";
  int ranks = 0;
  uint64_t steps = 0;
  double step_ms = -1;
  int interval_steps = 5;
  int steps_per_interval = 5;
  std::string scenario = "straggler";
  uint64_t seed = 3;
  uint16_t port = 0;  // child mode
  int slow_rank = 17;
  int agent_io_threads = 1;
  uint64_t slow_from = 100;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc > 1) a.mode = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks")
      a.ranks = std::atoi(v.c_str());
    else if (k == "--steps")
      a.steps = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--step-ms")
      a.step_ms = std::atof(v.c_str());
    else if (k == "--interval-steps")
      a.interval_steps = std::atoi(v.c_str());
    else if (k == "--steps-per-interval")
      a.steps_per_interval = std::atoi(v.c_str());
    else if (k == "--scenario")
      a.scenario = v;
    else if (k == "--seed")
      a.seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (k == "--port")
      a.port = static_cast<uint16_t>(std::atoi(v.c_str()));
    else if (k == "--agent-io-threads")
      a.agent_io_threads = std::atoi(v.c_str());
    else if (k == "--slow-rank")
      a.slow_rank = std::atoi(v.c_str());
    else if (k == "--slow-from")
      a.slow_from = std::strtoull(v.c_str(), nullptr, 10);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

double q(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1,
                    static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

SimClusterOptions cluster_options(const Args& a) {
  SimClusterOptions o;
  o.ranks = a.ranks;
  o.scenario = a.scenario;
  o.seed = a.seed;
  o.step_ms = a.step_ms;
  o.steps_per_interval = a.steps_per_interval;
  o.secret = transport::Secret(kSecret);
  o.agent_port = a.port;
  o.io_threads = 2;
  o.slowdowns.push_back({static_cast<uint32_t>(a.slow_rank), 3.0, a.slow_from});
  return o;
}

int run_child(const Args& a) {
  std::atomic<bool> stop{false};
  const SimClusterReport r = run_simulated_cluster(cluster_options(a), stop, a.steps);
  nlohmann::json j = {
      {"steps", r.steps},
      {"commits", r.commits},
      {"missed_commits", r.missed_commits},
      {"params_match_never_migrated", r.params == SimulatedCluster::reference_params(r.steps, 8)},
      {"replicas_agree", r.replicas_agree},
      {"telemetry_sent", r.telemetry_sent}};
  std::printf("cluster: %s\n", j.dump().c_str());
  return 0;
}

int run_latency(Args a, const char* self) {
  if (a.ranks == 0) a.ranks = 1024;
  if (a.steps == 0) a.steps = 600;
  if (a.step_ms < 0) a.step_ms = 50;
  AgentOptions o;
  o.job = make_job(a.scenario, a.ranks);
  o.secret = transport::Secret(kSecret);
  o.io_threads = static_cast<size_t>(a.agent_io_threads);
  o.interval_steps = a.interval_steps;
  o.decider.cooldown_intervals = 2;
  o.migration.commit_margin_steps = 5;
  std::vector<std::string> migrations;
  std::mutex mu;
  o.log = [&](const std::string& line) {
    if (line.find("\"event\":\"migration\"") != std::string::npos) {
      std::lock_guard lock(mu);
      migrations.push_back(line);
    }
  };
  const ProcessUsage at_start = process_usage();
  DeployAgent agent(o);
  a.port = agent.port();
  const pid_t child = fork();
  if (child == 0) {
    const std::string port = std::to_string(a.port);
    const std::string args[] = {self,
                                "child",
                                "--ranks",
                                std::to_string(a.ranks),
                                "--steps",
                                std::to_string(a.steps),
                                "--step-ms",
                                std::to_string(a.step_ms),
                                "--steps-per-interval",
                                std::to_string(a.steps_per_interval),
                                "--scenario",
                                a.scenario,
                                "--seed",
                                std::to_string(a.seed),
                                "--port",
                                port,
                                "--slow-rank",
                                std::to_string(a.slow_rank),
                                "--slow-from",
                                std::to_string(a.slow_from)};
    std::vector<char*> argv;
    for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  waitpid(child, &status, 0);
  const double wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const AgentStats s = agent.stats();
  const ProcessUsage usage = process_usage();
  const MonitorCounters mc = agent.monitor()->counters();
  std::printf(
      "agent: %d ranks, %s, %llu steps of %.0f ms, a decision every %d steps, %d bus I/O "
      "thread(s), %u cores\n",
      a.ranks, a.scenario.c_str(), static_cast<unsigned long long>(a.steps), a.step_ms,
      a.interval_steps, a.agent_io_threads, std::thread::hardware_concurrency());
  std::printf(
      "  decisions %llu, switches %llu, committed %llu, aborted %llu, stragglers detected %llu\n",
      static_cast<unsigned long long>(s.decisions),
      static_cast<unsigned long long>(s.switches_decided),
      static_cast<unsigned long long>(s.migrations_committed),
      static_cast<unsigned long long>(s.migrations_aborted),
      static_cast<unsigned long long>(s.stragglers_detected));
  std::printf("  decision latency ms: p50 %.3f  p99 %.3f  max %.3f  (n=%zu)\n",
              q(s.decision_latency_ms, 0.5), q(s.decision_latency_ms, 0.99),
              q(s.decision_latency_ms, 1.0), s.decision_latency_ms.size());
  std::printf("  to PlanPrepare ms:   p50 %.3f  p99 %.3f  max %.3f  (n=%zu)\n",
              q(s.prepare_latency_ms, 0.5), q(s.prepare_latency_ms, 0.99),
              q(s.prepare_latency_ms, 1.0), s.prepare_latency_ms.size());
  std::printf("  of which step close ms: p50 %.3f  p99 %.3f  max %.3f\n", q(s.step_close_ms, 0.5),
              q(s.step_close_ms, 0.99), q(s.step_close_ms, 1.0));
  std::printf("  of which decide() ms: p50 %.3f  p99 %.3f  max %.3f\n", q(s.decide_ms, 0.5),
              q(s.decide_ms, 0.99), q(s.decide_ms, 1.0));
  std::printf("  planner: %ld searches in the background, last %.1f ms\n", agent.decider().plans(),
              agent.decider().last_plan_ms());
  std::printf("  telemetry accepted %llu, rejected %llu, outliers %llu\n",
              static_cast<unsigned long long>(mc.accepted),
              static_cast<unsigned long long>(mc.rejected),
              static_cast<unsigned long long>(mc.outliers));
  std::printf("  agent CPU %.2f s over %.1f s wall (%.0f%% of one core), peak RSS %.0f MiB\n",
              usage.cpu_s - at_start.cpu_s, wall_s, 100.0 * (usage.cpu_s - at_start.cpu_s) / wall_s,
              usage.max_rss_bytes / (1 << 20));
  for (const auto& m : migrations) std::printf("  %s\n", m.c_str());
  agent.stop();
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

struct Phases {
  double before = 0, during = 0, after = 0;
};

Phases phases(const std::vector<double>& tps, uint64_t from, uint64_t commit) {
  Phases p;
  double n[3] = {0, 0, 0};
  for (size_t i = 0; i < tps.size(); ++i) {
    const int k = i < from ? 0 : (i < commit ? 1 : 2);
    (k == 0 ? p.before : k == 1 ? p.during : p.after) += tps[i];
    n[k] += 1;
  }
  if (n[0] > 0) p.before /= n[0];
  if (n[1] > 0) p.during /= n[1];
  if (n[2] > 0) p.after /= n[2];
  return p;
}

int run_straggler(Args a) {
  if (a.ranks == 0) a.ranks = 64;
  if (a.steps == 0) a.steps = 300;
  if (a.step_ms < 0) a.step_ms = 20;
  SimClusterOptions co = cluster_options(a);
  co.use_truth = false;
  // With the agent.
  AgentOptions o;
  o.job = make_job(a.scenario, a.ranks);
  o.secret = transport::Secret(kSecret);
  o.interval_steps = a.interval_steps;
  o.log = [](const std::string&) {};
  DeployAgent agent(o);
  co.agent_port = agent.port();
  SimulatedCluster with(co);
  with.wait_connected(std::chrono::seconds(30));
  const auto t0 = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point slowed, detected, committed;
  uint64_t detected_step = 0;
  for (uint64_t s = 0; s < a.steps; ++s) {
    if (s == a.slow_from) slowed = std::chrono::steady_clock::now();
    with.run(1);
    const AgentStats st = agent.stats();
    if (detected_step == 0 && st.stragglers_detected > 0) {
      detected = std::chrono::steady_clock::now();
      detected_step = st.events.front().step;
    }
    if (committed.time_since_epoch().count() == 0 && st.migrations_committed > 0) {
      committed = std::chrono::steady_clock::now();
    }
  }
  (void)t0;
  const SimClusterReport r = with.report();
  agent.stop();
  // Without the agent: the same cluster with no one listening.
  transport::InProcHub hub;
  SimClusterOptions bo = co;
  bo.hub = &hub;
  bo.step_ms = 0;
  SimulatedCluster without(bo);
  without.run(a.steps);
  const SimClusterReport b = without.report();
  const uint64_t commit_step = r.commit_steps.empty() ? a.steps : r.commit_steps.front();
  const Phases pw = phases(r.tokens_per_s_by_step, a.slow_from, commit_step);
  const Phases pb = phases(b.tokens_per_s_by_step, a.slow_from, commit_step);
  auto ms = [](auto from, auto to) {
    return std::chrono::duration<double, std::milli>(to - from).count();
  };
  std::printf(
      "straggler: %d ranks (%s), rank %d slowed 3x from step %llu, %.0f ms per step, a decision "
      "every %d steps\n",
      a.ranks, a.scenario.c_str(), a.slow_rank, static_cast<unsigned long long>(a.slow_from),
      a.step_ms, a.interval_steps);
  std::printf("  detected at step %llu (%.0f ms wall after the slowdown began)\n",
              static_cast<unsigned long long>(detected_step), ms(slowed, detected));
  std::printf("  switch committed at step %llu (%.0f ms wall after the slowdown began) to %s\n",
              static_cast<unsigned long long>(commit_step), ms(slowed, committed),
              layout_name(r.layout).c_str());
  std::printf(
      "  true tokens/s   before    during     after   (steps [0,%llu) [%llu,%llu) [%llu,%llu))\n",
      static_cast<unsigned long long>(a.slow_from), static_cast<unsigned long long>(a.slow_from),
      static_cast<unsigned long long>(commit_step), static_cast<unsigned long long>(commit_step),
      static_cast<unsigned long long>(a.steps));
  std::printf("  with agent    %9.0f %9.0f %9.0f\n", pw.before, pw.during, pw.after);
  std::printf("  without agent %9.0f %9.0f %9.0f\n", pb.before, pb.during, pb.after);
  std::printf(
      "  simulated job time for %llu steps: %.0f s with the agent, %.0f s without (%.2fx)\n",
      static_cast<unsigned long long>(a.steps), r.sim_seconds, b.sim_seconds,
      b.sim_seconds / std::max(r.sim_seconds, 1e-9));
  std::printf("  exactly once: params match the never-migrated run: %s; replicas agree: %s\n",
              r.params == SimulatedCluster::reference_params(r.steps, 8) ? "yes" : "NO",
              r.replicas_agree ? "yes" : "NO");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (a.mode == "child") return run_child(a);
  if (a.mode == "latency") return run_latency(a, argv[0]);
  if (a.mode == "straggler") return run_straggler(a);
  std::fprintf(
      stderr, "usage: bench_deploy latency|straggler [--ranks N] [--steps N] [--step-ms MS] ...\n");
  return 2;
}
