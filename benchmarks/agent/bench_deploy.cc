// bench_deploy: the deploy agent closed-loop with simulated ranks over TCP loopback.
//
//   bench_deploy latency [--ranks 1024] [--steps 600] [--step-ms 50] ...
//     The agent runs in this process; the simulated cluster in a child process (this program
//     re-executed), so the agent's CPU time and peak RSS (getrusage) are its own. Prints the
//     decision latency (last telemetry of an interval arriving -> decision; -> PlanPrepare for
//     switches), planner figures, the agent's CPU and memory, and the bus's connection counts.
//     Each rank is one loopback connection: when the file-descriptor limit (raised to the hard
//     limit) or 127.0.0.1's ephemeral ports cannot hold them, it exits with code 3 before
//     starting, saying why (and with --json, a report whose "not_run" says it).
//   bench_deploy straggler [--ranks 64] ...
//     A rank slowed 3x mid-run, with and without the agent: steps to detection, to the committed
//     switch, and true throughput (cost model under the true conditions) before, during, after.
//
// Both modes: --policy P picks the agent's policy: by default the shipped learned policy, as
// `parapilot deploy` loads it (policy::default_policy_path(); the reactive baseline, reported as a
// fallback, when it cannot be loaded); `--policy reactive` the reactive baseline; any other value
// a checkpoint. --json FILE also writes every printed figure as JSON (benchmarks/report.h);
// --help prints the options. Malformed numbers and flags without a value exit with code 2.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "policy/loader.h"
#include "agent/deploy/agent.h"
#include "agent/deploy/metrics.h"
#include "env/simcluster/sim_cluster.h"
#include "benchmarks/report.h"
#include "core/error.h"

using namespace parapilot;
using namespace parapilot::agent::deploy;
using namespace parapilot::env;

namespace {

const char* kSecret = "bench-deploy-secret-0123456789";
// latency's exit code when the machine cannot hold the ranks' connections (the JSON report
// says why, under "not_run").
constexpr int kNotRun = 3;

struct Args {
  std::string mode = "latency";
  int ranks = 0;
  uint64_t steps = 0;
  double step_ms = -1;
  int interval_steps = 5;
  int steps_per_interval = 5;
  std::string scenario = "straggler";
  uint64_t seed = 3;
  uint16_t port = 0;   // child mode
  int report_fd = -1;  // child mode: where the cluster report goes (besides stdout)
  int slow_rank = -1;  // -1: rank 17, or the last rank with fewer than 18
  int agent_io_threads = 1;
  uint64_t slow_from = 100;
  std::string policy;  // "": the shipped default policy; "reactive"; else a checkpoint
};

const char* kUsage =
    "usage: bench_deploy latency|straggler [options] [--json FILE]\n"
    "  latency: decision latency, planner, agent CPU and memory (defaults: --ranks 1024\n"
    "           --steps 600 --step-ms 50)\n"
    "  straggler: a rank slowed 3x, with and without the agent (defaults: --ranks 64\n"
    "           --steps 300 --step-ms 20)\n"
    "options:\n"
    "  --ranks N               simulated ranks (a multiple of 8, >= 8)\n"
    "  --steps N               training steps\n"
    "  --step-ms MS            wall time per simulated step\n"
    "  --interval-steps N      closed steps per decision (5)\n"
    "  --steps-per-interval N  the scenario's steps per interval (5)\n"
    "  --scenario NAME         the job's scenario (straggler)\n"
    "  --seed N                the scenario's seed (3)\n"
    "  --agent-io-threads N    latency: the agent's bus I/O threads (1)\n"
    "  --slow-rank R           the rank slowed 3x (17, or the last rank when --ranks < 18)\n"
    "  --slow-from STEP        the step the slowdown starts (100)\n"
    "  --policy P              the agent's policy: the shipped learned policy when absent,\n"
    "                          'reactive' the reactive baseline, else a checkpoint path\n"
    "  --json FILE             also write every figure as JSON (benchmarks/report.h)\n"
    "  --help                  this text\n";

[[noreturn]] void bad_value(const std::string& flag, const std::string& v, const char* what) {
  std::fprintf(stderr, "bench_deploy: %s '%s': %s (--help)\n", flag.c_str(), v.c_str(), what);
  std::exit(2);
}

long long parse_int(const std::string& flag, const std::string& v, long long lo, long long hi) {
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || end != v.c_str() + v.size() || errno == ERANGE)
    bad_value(flag, v, "not an integer");
  if (x < lo || x > hi) {
    const std::string range = "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    bad_value(flag, v, range.c_str());
  }
  return x;
}

uint64_t parse_u64(const std::string& flag, const std::string& v, uint64_t lo) {
  errno = 0;
  char* end = nullptr;
  const uint64_t x = std::strtoull(v.c_str(), &end, 10);
  if (v.empty() || v[0] == '-' || end != v.c_str() + v.size() || errno == ERANGE)
    bad_value(flag, v, "not a non-negative integer");
  if (x < lo) bad_value(flag, v, ("must be >= " + std::to_string(lo)).c_str());
  return x;
}

double parse_double(const std::string& flag, const std::string& v, double lo) {
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || end != v.c_str() + v.size() || errno == ERANGE || !std::isfinite(x))
    bad_value(flag, v, "not a number");
  if (x < lo) bad_value(flag, v, ("must be >= " + std::to_string(lo)).c_str());
  return x;
}

Args parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("%s", kUsage);
      std::exit(0);
    }
  }
  Args a;
  if (argc > 1) a.mode = argv[1];
  constexpr long long kIntMax = 1 << 30;
  for (int i = 2; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "bench_deploy: %s needs a value (--help)\n", k.c_str());
      std::exit(2);
    }
    const std::string v = argv[i + 1];
    if (k == "--ranks")
      a.ranks = static_cast<int>(parse_int(k, v, 1, kIntMax));
    else if (k == "--steps")
      a.steps = parse_u64(k, v, 1);
    else if (k == "--step-ms")
      a.step_ms = parse_double(k, v, 0);
    else if (k == "--interval-steps")
      a.interval_steps = static_cast<int>(parse_int(k, v, 1, kIntMax));
    else if (k == "--steps-per-interval")
      a.steps_per_interval = static_cast<int>(parse_int(k, v, 1, kIntMax));
    else if (k == "--scenario")
      a.scenario = v;
    else if (k == "--seed")
      a.seed = parse_u64(k, v, 0);
    else if (k == "--port")
      a.port = static_cast<uint16_t>(parse_int(k, v, 0, 65535));
    else if (k == "--report-fd")
      a.report_fd = static_cast<int>(parse_int(k, v, -1, kIntMax));
    else if (k == "--agent-io-threads")
      a.agent_io_threads = static_cast<int>(parse_int(k, v, 1, 1024));
    else if (k == "--slow-rank")
      a.slow_rank = static_cast<int>(parse_int(k, v, 0, kIntMax));
    else if (k == "--slow-from")
      a.slow_from = parse_u64(k, v, 0);
    else if (k == "--policy")
      a.policy = v;
    else {
      std::fprintf(stderr, "bench_deploy: unknown option %s (--help)\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

/// The slowed rank: the one asked for (which must exist), else 17, or the last rank when fewer.
void settle_slow_rank(Args& a) {
  if (a.slow_rank < 0) {
    a.slow_rank = std::min(17, a.ranks - 1);
  } else if (a.slow_rank >= a.ranks) {
    std::fprintf(stderr, "bench_deploy: --slow-rank %d: must be < --ranks %d\n", a.slow_rank,
                 a.ranks);
    std::exit(2);
  }
}

/// The policy options as `parapilot deploy` sets them: the shipped learned policy by default.
void set_policy(AgentOptions& o, const Args& a) {
  if (a.policy == "reactive") {
    o.policy_path.clear();
  } else {
    o.policy_path = a.policy.empty() ? parapilot::policy::default_policy_path() : a.policy;
    o.loader = parapilot::policy::load_policy;
  }
}

/// Which policy ran: printed and recorded.
nlohmann::json report_policy(const Args& a, const AgentOptions& o, const AgentStats& s) {
  std::printf("  policy %s%s%s%s\n", s.policy.c_str(),
              o.policy_path.empty() ? " (the reactive baseline, --policy reactive)"
                                    : (" from " + o.policy_path).c_str(),
              s.fallback ? "; FELL BACK to the reactive baseline: " : "",
              s.fallback ? s.fallback_reason.c_str() : "");
  auto print = [](const char* what, uint64_t total, const std::map<std::string, uint64_t>& by) {
    std::string list;
    for (const auto& [name, n] : by) list += " " + name + "=" + std::to_string(n);
    std::printf("  policy inputs %s: %llu%s\n", what, static_cast<unsigned long long>(total),
                list.c_str());
  };
  print("read at the normaliser's clip", s.features_clipped, s.features_clipped_by_input);
  print("outside the range training produced", s.features_unseen, s.features_unseen_by_input);
  return {{"requested", a.policy.empty() ? "default" : a.policy},
          {"features_clipped", s.features_clipped},
          {"features_clipped_by_input", s.features_clipped_by_input},
          {"features_unseen", s.features_unseen},
          {"features_unseen_by_input", s.features_unseen_by_input},
          {"path", o.policy_path},
          {"name", s.policy},
          {"fallback", s.fallback},
          {"fallback_reason", s.fallback_reason}};
}

double q(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1,
                    static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

/// p50, p99 and max (null without a value) and the count.
nlohmann::json quantiles(const std::vector<double>& v) {
  auto at = [&](double p) { return v.empty() ? nlohmann::json() : nlohmann::json(q(v, p)); };
  return {{"p50", at(0.5)}, {"p99", at(0.99)}, {"max", at(1.0)}, {"n", v.size()}};
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

// The run's settings, as both modes report them.
nlohmann::json config_json(const Args& a) {
  return {{"ranks", a.ranks},           {"scenario", a.scenario},
          {"steps", a.steps},           {"step_ms", a.step_ms},
          {"interval_steps", a.interval_steps}, {"steps_per_interval", a.steps_per_interval},
          {"seed", a.seed},             {"slow_rank", a.slow_rank},
          {"slow_from", a.slow_from}};
}

int run_child(const Args& a) {
  std::atomic<bool> stop{false};
  const SimClusterReport r =
      parapilot::take(run_simulated_cluster(cluster_options(a), stop, a.steps));
  nlohmann::json j = {
      {"steps", r.steps},
      {"commits", r.commits},
      {"missed_commits", r.missed_commits},
      {"telemetry_sent", r.telemetry_sent},
      {"live_ranks", r.live_ranks},
      {"connected_ranks", r.connected_ranks}};
  std::printf("cluster: %s\n", j.dump().c_str());
  if (a.report_fd >= 0) {
    const std::string line = j.dump() + "\n";
    if (::write(a.report_fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
      return 1;
    ::close(a.report_fd);
  }
  return 0;
}

/// Whether this machine can hold `ranks` loopback connections to one port: each takes a file
/// descriptor in the agent and one in the cluster (the soft limit is raised to the hard one
/// here; the cluster inherits it) and an ephemeral port of 127.0.0.1. Empty when it can, else
/// why not; `limits` gets the figures.
std::string connection_capacity_problem(int ranks, nlohmann::json& limits) {
  rlimit fd{};
  getrlimit(RLIMIT_NOFILE, &fd);
  if (fd.rlim_cur < fd.rlim_max) {
    fd.rlim_cur = fd.rlim_max;
    setrlimit(RLIMIT_NOFILE, &fd);
    getrlimit(RLIMIT_NOFILE, &fd);
  }
  long first = 0, last = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> first >> last;
  const long ports = last >= first && first > 0 ? last - first + 1 : 0;
  constexpr long kSpareFds = 512;  // the agent's and the cluster's own files, policy, pipes
  limits = {{"fd_limit", static_cast<long long>(fd.rlim_cur)},
            {"fd_needed", ranks + kSpareFds},
            {"ephemeral_ports", ports}};
  std::string why;
  if (fd.rlim_cur != RLIM_INFINITY && static_cast<long long>(fd.rlim_cur) < ranks + kSpareFds) {
    why = std::to_string(ranks) + " ranks need " + std::to_string(ranks + kSpareFds) +
          " file descriptors in each process; the limit is " + std::to_string(fd.rlim_cur) +
          " (hard limit " + std::to_string(fd.rlim_max) + ")";
  }
  if (ports > 0 && ports < ranks) {
    why += (why.empty() ? "" : "; ") + std::to_string(ranks) +
           " loopback connections to one port need as many ephemeral ports of 127.0.0.1; "
           "ip_local_port_range has " + std::to_string(ports);
  }
  return why;
}

int run_latency(Args a, const char* self, nlohmann::json& fig) {
  if (a.ranks == 0) a.ranks = 1024;
  if (a.steps == 0) a.steps = 600;
  if (a.step_ms < 0) a.step_ms = 50;
  settle_slow_rank(a);
  if (const std::string why = connection_capacity_problem(a.ranks, fig["limits"]); !why.empty()) {
    std::printf("agent: %d ranks: not run on this machine: %s\n", a.ranks, why.c_str());
    fig["config"] = config_json(a);
    fig["not_run"] = why;
    return kNotRun;
  }
  AgentOptions o;
  set_policy(o, a);
  o.job = parapilot::take(make_job(a.scenario, a.ranks));
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
  const std::unique_ptr<DeployAgent> started = parapilot::take(DeployAgent::start(o));
  DeployAgent& agent = *started;
  a.port = agent.port();
  // The child's cluster report comes back on a pipe (it also prints it).
  int report_pipe[2];
  if (::pipe(report_pipe) != 0) {
    std::perror("bench_deploy: pipe");
    return 1;
  }
  ::fcntl(report_pipe[0], F_SETFD, FD_CLOEXEC);
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
                                std::to_string(a.slow_from),
                                "--report-fd",
                                std::to_string(report_pipe[1])};
    std::vector<char*> argv;
    for (const auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
    argv.push_back(nullptr);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  ::close(report_pipe[1]);
  const auto start = std::chrono::steady_clock::now();
  std::string child_report;
  {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(report_pipe[0], buf, sizeof buf)) > 0)
      child_report.append(buf, static_cast<size_t>(n));
    ::close(report_pipe[0]);
  }
  int status = 0;
  waitpid(child, &status, 0);
  const double wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const AgentStats s = agent.stats();
  const ProcessUsage usage = process_usage();
  const monitor::MonitorCounters mc = agent.monitor()->counters();
  std::printf(
      "agent: %d ranks, %s, %llu steps of %.0f ms, a decision every %d steps, %d bus I/O "
      "thread(s), %u cores\n",
      a.ranks, a.scenario.c_str(), static_cast<unsigned long long>(a.steps), a.step_ms,
      a.interval_steps, a.agent_io_threads, std::thread::hardware_concurrency());
  fig["config"] = config_json(a);
  fig["config"]["agent_io_threads"] = a.agent_io_threads;
  fig["config"]["cores"] = std::thread::hardware_concurrency();
  fig["policy"] = report_policy(a, o, s);
  std::printf(
      "  decisions %llu, switches %llu, committed %llu, aborted %llu, stragglers detected %llu\n",
      static_cast<unsigned long long>(s.decisions),
      static_cast<unsigned long long>(s.switches_decided),
      static_cast<unsigned long long>(s.migrations_committed),
      static_cast<unsigned long long>(s.migrations_aborted),
      static_cast<unsigned long long>(s.stragglers_detected));
  fig["counts"] = {{"decisions", s.decisions},
                   {"switches_decided", s.switches_decided},
                   {"migrations_committed", s.migrations_committed},
                   {"migrations_aborted", s.migrations_aborted},
                   {"stragglers_detected", s.stragglers_detected}};
  std::printf("  decision latency ms: p50 %.3f  p99 %.3f  max %.3f  (n=%zu)\n",
              q(s.decision_latency_ms, 0.5), q(s.decision_latency_ms, 0.99),
              q(s.decision_latency_ms, 1.0), s.decision_latency_ms.size());
  std::printf("  to PlanPrepare ms:   p50 %.3f  p99 %.3f  max %.3f  (n=%zu)\n",
              q(s.prepare_latency_ms, 0.5), q(s.prepare_latency_ms, 0.99),
              q(s.prepare_latency_ms, 1.0), s.prepare_latency_ms.size());
  if (!s.prepare_latency_ms.empty()) {
    std::printf("  to PlanPrepare ms, each switch:");
    for (double v : s.prepare_latency_ms) std::printf(" %.3f", v);
    std::printf("\n");
  }
  std::printf("  of which step close ms: p50 %.3f  p99 %.3f  max %.3f\n", q(s.step_close_ms, 0.5),
              q(s.step_close_ms, 0.99), q(s.step_close_ms, 1.0));
  std::printf("  of which decide() ms: p50 %.3f  p99 %.3f  max %.3f\n", q(s.decide_ms, 0.5),
              q(s.decide_ms, 0.99), q(s.decide_ms, 1.0));
  fig["decision_latency_ms"] = quantiles(s.decision_latency_ms);
  fig["prepare_latency_ms"] = quantiles(s.prepare_latency_ms);
  fig["prepare_latency_ms"]["per_switch"] = s.prepare_latency_ms;
  fig["step_close_ms"] = quantiles(s.step_close_ms);
  fig["decide_ms"] = quantiles(s.decide_ms);
  std::printf("  planner: %ld searches in the background, last %.1f ms\n", agent.decider().plans(),
              agent.decider().last_plan_ms());
  fig["planner"] = {{"searches", agent.decider().plans()},
                    {"last_search_ms", agent.decider().last_plan_ms()}};
  std::printf("  telemetry accepted %llu, rejected %llu, outliers %llu\n",
              static_cast<unsigned long long>(mc.accepted),
              static_cast<unsigned long long>(mc.rejected),
              static_cast<unsigned long long>(mc.outliers));
  fig["telemetry"] = {
      {"accepted", mc.accepted}, {"rejected", mc.rejected}, {"outliers", mc.outliers}};
  // Every rank connected once (authenticated == ranks) and none was refused or dropped.
  std::printf(
      "  bus: %llu connections accepted, %llu authenticated, %llu closed for an error, %llu "
      "waited for a handshake slot\n",
      static_cast<unsigned long long>(s.bus.accepted),
      static_cast<unsigned long long>(s.bus.authenticated),
      static_cast<unsigned long long>(s.bus.rejected),
      static_cast<unsigned long long>(s.bus.handshakes_queued));
  fig["bus"] = {{"accepted", s.bus.accepted},
                {"authenticated", s.bus.authenticated},
                {"rejected", s.bus.rejected},
                {"handshakes_queued", s.bus.handshakes_queued}};
  const double cpu_s = usage.cpu_s - at_start.cpu_s;
  const double rss_mib = usage.max_rss_bytes / (1 << 20);
  std::printf("  agent CPU %.2f s over %.1f s wall (%.0f%% of one core), peak RSS %.0f MiB\n",
              cpu_s, wall_s, 100.0 * cpu_s / wall_s, rss_mib);
  fig["agent_cpu_s"] = cpu_s;
  fig["wall_s"] = wall_s;
  fig["agent_cpu_share_of_core"] = cpu_s / wall_s;
  fig["peak_rss_mib"] = rss_mib;
  fig["migrations"] = nlohmann::json::array();
  for (const auto& m : migrations) {
    std::printf("  %s\n", m.c_str());
    auto j = nlohmann::json::parse(m, nullptr, false);
    if (!j.is_discarded()) {
      j.erase("event");
      fig["migrations"].push_back(j);
    }
  }
  {
    const auto first = child_report.find('{');
    auto j = first == std::string::npos
                 ? nlohmann::json()
                 : nlohmann::json::parse(child_report.substr(first), nullptr, false);
    fig["cluster"] = j.is_discarded() ? nlohmann::json() : j;
  }
  agent.stop();
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  fig["cluster_exit_ok"] = ok;
  return ok ? 0 : 1;
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

int run_straggler(Args a, nlohmann::json& fig) {
  if (a.ranks == 0) a.ranks = 64;
  if (a.steps == 0) a.steps = 300;
  if (a.step_ms < 0) a.step_ms = 20;
  settle_slow_rank(a);
  if (a.slow_from >= a.steps) {
    std::fprintf(stderr, "bench_deploy: --slow-from %llu: must be < --steps %llu\n",
                 static_cast<unsigned long long>(a.slow_from),
                 static_cast<unsigned long long>(a.steps));
    return 2;
  }
  SimClusterOptions co = cluster_options(a);
  co.use_truth = false;
  // With the agent.
  AgentOptions o;
  set_policy(o, a);
  o.job = parapilot::take(make_job(a.scenario, a.ranks));
  o.secret = transport::Secret(kSecret);
  o.interval_steps = a.interval_steps;
  o.log = [](const std::string&) {};
  const std::unique_ptr<DeployAgent> started = parapilot::take(DeployAgent::start(o));
  DeployAgent& agent = *started;
  co.agent_port = agent.port();
  const std::unique_ptr<SimulatedCluster> with_started =
      parapilot::take(SimulatedCluster::start(co));
  SimulatedCluster& with = *with_started;
  with.wait_connected(std::chrono::seconds(30));
  std::chrono::steady_clock::time_point slowed, detected, committed;
  bool was_detected = false;
  uint64_t detected_step = 0;
  monitor::MonitorEvent detection;
  for (uint64_t s = 0; s < a.steps; ++s) {
    if (s == a.slow_from) slowed = std::chrono::steady_clock::now();
    with.run(1);
    const AgentStats st = agent.stats();
    if (!was_detected && st.stragglers_detected > 0) {
      detected = std::chrono::steady_clock::now();
      // The first slow_rank event (stragglers_detected counts those).
      const auto it = std::find_if(st.events.begin(), st.events.end(), [](const monitor::MonitorEvent& e) {
        return e.kind == monitor::MonitorEvent::Kind::slow_rank;
      });
      detection = it != st.events.end() ? *it : st.events.front();
      detected_step = detection.step;
      was_detected = true;
    }
    if (committed.time_since_epoch().count() == 0 && st.migrations_committed > 0) {
      committed = std::chrono::steady_clock::now();
    }
  }
  const SimClusterReport r = with.report();
  const AgentStats stats = agent.stats();
  agent.stop();
  // Without the agent: the same cluster with no one listening.
  transport::InProcHub hub;
  SimClusterOptions bo = co;
  bo.hub = &hub;
  bo.step_ms = 0;
  const std::unique_ptr<SimulatedCluster> without_started =
      parapilot::take(SimulatedCluster::start(bo));
  SimulatedCluster& without = *without_started;
  without.run(a.steps);
  const SimClusterReport b = without.report();
  const bool was_committed = !r.commit_steps.empty();
  const uint64_t commit_step = was_committed ? r.commit_steps.front() : a.steps;
  const Phases pw = phases(r.tokens_per_s_by_step, a.slow_from, commit_step);
  const Phases pb = phases(b.tokens_per_s_by_step, a.slow_from, commit_step);
  auto ms = [](auto from, auto to) {
    return std::chrono::duration<double, std::milli>(to - from).count();
  };
  const bool commit_seen = committed.time_since_epoch().count() != 0;
  std::printf(
      "straggler: %d ranks (%s), rank %d slowed 3x from step %llu, %.0f ms per step, a decision "
      "every %d steps\n",
      a.ranks, a.scenario.c_str(), a.slow_rank, static_cast<unsigned long long>(a.slow_from),
      a.step_ms, a.interval_steps);
  fig["config"] = config_json(a);
  fig["config"]["slow_factor"] = 3.0;
  fig["policy"] = report_policy(a, o, stats);
  fig["counts"] = {{"decisions", stats.decisions},
                   {"switches_decided", stats.switches_decided},
                   {"migrations_committed", stats.migrations_committed},
                   {"migrations_aborted", stats.migrations_aborted},
                   {"stragglers_detected", stats.stragglers_detected}};
  if (was_detected) {
    std::printf("  detected at step %llu (%.0f ms wall after the slowdown began)\n",
                static_cast<unsigned long long>(detected_step), ms(slowed, detected));
    std::printf("  evidence (rank %d): %s\n", detection.rank, detection.evidence.c_str());
  } else {
    std::printf("  not detected\n");
  }
  fig["detection"] = {
      {"detected", was_detected},
      {"step", was_detected ? nlohmann::json(detected_step) : nlohmann::json()},
      {"ms_after_slowdown", was_detected ? nlohmann::json(ms(slowed, detected)) : nlohmann::json()},
      {"kind", was_detected ? nlohmann::json(to_string(detection.kind)) : nlohmann::json()},
      {"rank", was_detected ? nlohmann::json(detection.rank) : nlohmann::json()},
      {"believed_speed", was_detected ? nlohmann::json(detection.value) : nlohmann::json()},
      {"evidence", was_detected ? nlohmann::json(detection.evidence) : nlohmann::json()}};
  if (was_committed) {
    std::printf("  switch committed at step %llu (%.0f ms wall after the slowdown began) to %s\n",
                static_cast<unsigned long long>(commit_step),
                commit_seen ? ms(slowed, committed) : std::nan(""), layout_name(r.layout).c_str());
  } else {
    std::printf("  no switch committed (layout %s)\n", layout_name(r.layout).c_str());
  }
  fig["commit"] = {
      {"committed", was_committed},
      {"step", was_committed ? nlohmann::json(commit_step) : nlohmann::json()},
      {"ms_after_slowdown",
       was_committed && commit_seen ? nlohmann::json(ms(slowed, committed)) : nlohmann::json()},
      {"layout", layout_name(r.layout)}};
  std::printf(
      "  true tokens/s   before    during     after   (steps [0,%llu) [%llu,%llu) [%llu,%llu))\n",
      static_cast<unsigned long long>(a.slow_from), static_cast<unsigned long long>(a.slow_from),
      static_cast<unsigned long long>(commit_step), static_cast<unsigned long long>(commit_step),
      static_cast<unsigned long long>(a.steps));
  std::printf("  with agent    %9.0f %9.0f %9.0f\n", pw.before, pw.during, pw.after);
  std::printf("  without agent %9.0f %9.0f %9.0f\n", pb.before, pb.during, pb.after);
  fig["windows"] = {{"before", {0, a.slow_from}},
                    {"during", {a.slow_from, commit_step}},
                    {"after", {commit_step, a.steps}}};
  fig["true_tokens_per_s"] = {
      {"with_agent", {{"before", pw.before}, {"during", pw.during}, {"after", pw.after}}},
      {"without_agent", {{"before", pb.before}, {"during", pb.during}, {"after", pb.after}}}};
  std::printf(
      "  simulated job time for %llu steps: %.0f s with the agent, %.0f s without (%.2fx)\n",
      static_cast<unsigned long long>(a.steps), r.sim_seconds, b.sim_seconds,
      b.sim_seconds / std::max(r.sim_seconds, 1e-9));
  fig["simulated_job_s"] = {{"with_agent", r.sim_seconds},
                            {"without_agent", b.sim_seconds},
                            {"without_over_with", b.sim_seconds / std::max(r.sim_seconds, 1e-9)}};
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json_path = bench::take_json_flag(argc, argv);
  const Args a = parse(argc, argv);
  try {
    if (a.mode == "child") return run_child(a);
    bench::Report report("bench_deploy", argc, argv);
    nlohmann::json& fig = report.figures();
    int rc = 2;
    fig["mode"] = a.mode;
    if (a.mode == "latency")
      rc = run_latency(a, argv[0], fig);
    else if (a.mode == "straggler")
      rc = run_straggler(a, fig);
    else {
      std::fprintf(stderr, "%s", kUsage);
      return 2;
    }
    if ((rc == 0 || rc == kNotRun) && !report.write(json_path)) rc = 1;
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_deploy: %s\n", e.what());
    return 2;
  }
}
