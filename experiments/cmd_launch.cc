// parapilot launch: a local live cluster of N training workers with an in-process agent bus (a
// scripted or reactive action schedule) or `parapilot deploy` beside it, and fault injection
// (env/live/local_cluster.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "experiments/cli_common.h"
#include "experiments/commands.h"
#include "core/error.h"
#ifdef PARAPILOT_HAVE_LIVE
#include "env/live/layout.h"
#include "agent/deploy/live_env.h"
#include "env/live/live_job.h"
#include "env/live/local_cluster.h"
#include "env/live/worker.h"
#include "env/trace/telemetry.h"
#endif

namespace parapilot::cli {

#ifdef PARAPILOT_HAVE_LIVE
namespace {

using namespace std::chrono_literals;

struct LaunchOptions {
  int workers = 2;
  std::string backend = "gloo";
  std::vector<std::string> inject;
  std::string agent = "builtin";
  std::string agent_policy;     // --agent deploy: deploy's --policy (empty: its default)
  int agent_interval_steps = 5;  // --agent deploy: training steps per decision
  std::string agent_switches = "dp";  // --agent deploy: what the agent may switch (dp | hybrid)
  std::vector<std::string> actions;  // STEP:ACTION
  int elastic_every = 0;
  std::int64_t auto_compress_at = -1;
  std::string record;
  std::string log_dir;
  double timeout_s = 0;
  int simulated = 0;  // > 0: simulated ranks on an external agent's bus instead of workers
  std::string scenario = "straggler";
};


// What the deploy agent did, from its JSON log: detections, switches, where the job ended and
// its pace before the first switch and after the last.
void print_agent_summary(const std::string& log_path, int seq_len) {
  std::ifstream in(log_path);
  nlohmann::json last;
  std::vector<std::string> switches;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("event") || !j["event"].is_string()) continue;
    if (j["event"] == "agent_stopped") last = j;
    if (j["event"] == "migration") {
      const std::string what = j.contains("shares") ? "shares " + j.value("shares", std::string())
                                                    : j.value("layout", std::string());
      switches.push_back("step " + std::to_string(j.value("switch_at_step", 0LL)) + " " +
                         j.value("outcome", std::string()) + " " + what +
                         (j.value("reason", std::string()).empty()
                              ? ""
                              : " (" + j.value("reason", std::string()) + ")"));
    }
  }
  if (last.is_null()) {
    std::printf("agent: no summary in %s (it did not stop cleanly)\n", log_path.c_str());
    return;
  }
  auto n = [&](const char* key) { return last.value(key, 0.0); };
  std::printf("agent: %.0f decisions, %.0f slow-rank events, %.0f switches committed (%.0f "
              "reverts), %.0f aborted, %.0f held back\n",
              n("decisions"), n("stragglers_detected"), n("committed"), n("reverted"),
              n("aborted"), n("held_back"));
  for (const std::string& s : switches) std::printf("  %s\n", s.c_str());
  if (last.contains("layout")) {
    std::printf("  now: %s%s\n", last.value("layout", std::string()).c_str(),
                last.contains("shares")
                    ? (", shares " + last.value("shares", std::string())).c_str()
                    : "");
  }
  if (n("samples_per_s_before") > 0) {
    std::printf("  before the first switch: %.1f samples/s, %.0f tokens/s (%.0f steps)\n",
                n("samples_per_s_before"), n("samples_per_s_before") * seq_len,
                n("steps_before"));
  }
  if (n("samples_per_s_after") > 0) {
    std::printf("  after the last switch:   %.1f samples/s, %.0f tokens/s (%.0f steps, %.2fx)\n",
                n("samples_per_s_after"), n("samples_per_s_after") * seq_len, n("steps_after"),
                n("samples_per_s_after") / std::max(1e-9, n("samples_per_s_before")));
  }
}

// Checks the launch flags before any process starts (InputError naming the flag) and returns
// the faults to inject.
std::vector<live::FaultSpec> check_launch_flags(const LaunchOptions& o) {
  if (o.workers < 1) throw InputError("--workers " + std::to_string(o.workers) + ": must be >= 1");
  std::vector<live::FaultSpec> faults;
  for (const auto& spec : o.inject) faults.push_back(take(live::parse_fault(spec)));
  if (o.backend != "gloo" && o.backend != "nccl")
    throw InputError("--backend: '" + o.backend + "' is not a backend (gloo, nccl)");
  const bool deploy = o.agent == "deploy";
  if (o.agent != "builtin" && o.agent != "none" && !deploy) {
    if (o.agent.find(':') == std::string::npos)
      throw InputError("--agent \"" + o.agent + "\": builtin, deploy, none or HOST:PORT");
    parse_address("--agent", o.agent, true);
  }
  if (!deploy && o.agent_switches != "dp")
    throw InputError("--agent-switches needs --agent deploy");
  if (!deploy && (!o.agent_policy.empty() || o.agent_interval_steps != 5))
    throw InputError("--agent-policy and --agent-interval-steps need --agent deploy");
  if (o.agent_interval_steps < 1) throw InputError("--agent-interval-steps: must be >= 1");
  return faults;
}

using ActionSchedule = std::map<std::int64_t, std::vector<live::LiveAction>>;

// The scripted actions (--action STEP:ACTION) by step; InputError on a malformed one.
ActionSchedule parse_schedule(const LaunchOptions& o) {
  ActionSchedule schedule;
  for (const auto& a : o.actions) {
    const auto colon = a.find(':');
    if (colon == std::string::npos) throw InputError("--action '" + a + "': expected STEP:ACTION");
    char* end = nullptr;
    const long long step = std::strtoll(a.c_str(), &end, 10);
    if (end != a.c_str() + colon || step < 0) throw InputError("--action '" + a + "': bad step");
    const std::string text = a.substr(colon + 1);
    // A layout in --layout's form ("dp=1,pp=4") is a layout switch; anything else an action.
    if (!text.empty() && !live::is_action_text(text)) {
      live::LiveAction switch_to;
      switch_to.layout = text;
      schedule[step].push_back(switch_to);
    } else {
      schedule[step].push_back(take(live::decode_action(text)));
    }
  }
  if (o.agent != "builtin" &&
      (!schedule.empty() || o.elastic_every > 0 || o.auto_compress_at >= 0))
    throw InputError("--action, --elastic-every and --auto-compress-at need --agent builtin");
  return schedule;
}

// Parses the worker flags once here so that bad ones fail now with exit code 2, and checks the
// scripted layout switches against them. Returns the workers' options.
live::WorkerOptions check_worker_flags(const LaunchOptions& o,
                                       const std::vector<std::string>& worker_args,
                                       const ActionSchedule& schedule) {
  live::WorkerOptions wo;
  wo.world_size = o.workers;
  {
    CLI::App check{"worker flags"};
    live::add_worker_flags(check, wo);
    std::vector<std::string> reversed(worker_args.rbegin(), worker_args.rend());
    try {
      check.parse(reversed);
    } catch (const CLI::ParseError& e) {
      throw InputError(std::string("worker flags: ") + e.what());
    }
    parapilot::check(live::validate(wo));
  }
  for (const auto& [step, actions] : schedule)
    for (const live::LiveAction& a : actions)
      if (!a.layout.empty()) {
        const auto checked = live::parse_layout(a.layout, o.workers, wo.model);
        if (!checked.ok())
          throw InputError("--action " + std::to_string(step) + ":" + a.layout + ": " +
                           checked.status().message());
      }
  return wo;
}

// --agent deploy: writes the job file into the log folder (or a fresh temporary one) and sets
// the command that starts `parapilot deploy` beside the workers. Returns the job's folder.
std::string set_up_deploy_agent(const LaunchOptions& o, const live::WorkerOptions& wo,
                                live::LocalClusterOptions& co) {
  std::string job_dir;
  if (!o.log_dir.empty()) {
    job_dir = o.log_dir;
    std::filesystem::create_directories(job_dir);
  } else {
    char dir[] = "/tmp/parapilot-job-XXXXXX";
    if (!::mkdtemp(dir)) throw std::runtime_error("cannot create a folder for the job file");
    job_dir = dir;
  }
  // With hybrid switches the agent's planner searches every tensor-parallel degree that
  // splits the heads and every pipeline depth the blocks allow, over all the workers.
  live::JobSwitches switches;
  if (o.agent_switches == "hybrid") {
    if (wo.model.kind != "transformer")
      throw InputError("--agent-switches hybrid: the " + wo.model.kind +
                       " model trains data parallel only");
    switches.tp.clear();
    switches.pp.clear();
    for (int d = 1; d <= o.workers; ++d) {
      if (o.workers % d != 0) continue;
      if (wo.model.heads % d == 0) switches.tp.push_back(d);
      if (d <= wo.model.layers) switches.pp.push_back(d);
    }
  }
  const std::string job_file =
      take(live::write_job_scenario(wo.model, o.workers, wo.global_batch, job_dir, switches));
  co.agent_command = {"/proc/self/exe", "deploy",
                      "--scenario", job_file,
                      "--initial-layout", wo.layout.empty() ? "uniform-dp" : wo.layout,
                      "--interval-steps", std::to_string(o.agent_interval_steps),
                      "--cooldown", "1"};
  if (!o.agent_policy.empty()) co.agent_command.insert(co.agent_command.end(), {"--policy", o.agent_policy});
  co.agent_log = job_dir + "/agent.log";  // read back for the summary at the end
  return job_dir;
}

// Watches the workers until they end, one fails or the timeout passes; with the builtin agent,
// applies the scripted actions, elastic shares and adaptive compression as their steps come.
void drive_cluster(const LaunchOptions& o, live::LocalCluster& cluster, ActionSchedule& schedule,
                   const std::vector<live::LayerShape>& layers) {
  live::Controller* agent = cluster.controller();
  std::vector<transport::Telemetry> window;
  std::int64_t next_elastic = o.elastic_every;
  bool compressed = false;
  while (cluster.poll()) {
    if (cluster.any_failed()) break;  // the others notice through their collectives
    if (o.timeout_s > 0 && cluster.elapsed_s() > o.timeout_s) {
      std::printf("timeout after %.1f s: stopping the workers\n", o.timeout_s);
      if (agent) agent->request_stop("launch timeout");
      break;
    }
    if (agent) {
      for (auto& t : agent->take_telemetry()) window.push_back(std::move(t));
      const auto step = static_cast<std::int64_t>(agent->completed_step());
      auto apply = [&](const live::LiveAction& a, const char* why) {
        const StatusOr<live::AppliedPlan> r = agent->apply(a, 30s);
        std::printf("step %lld: %s %s -> %s\n", static_cast<long long>(step), why,
                    take(live::encode_action(a)).c_str(),
                    r.ok() ? ("committed at step " + std::to_string(r->switch_at_step)).c_str()
                           : r.status().message().c_str());
        std::fflush(stdout);
      };
      while (!schedule.empty() && schedule.begin()->first <= step &&
             agent->connected_ranks() == o.workers) {
        for (const auto& a : schedule.begin()->second) apply(a, "scripted");
        schedule.erase(schedule.begin());
      }
      if (o.elastic_every > 0 && step >= next_elastic && !window.empty()) {
        live::LiveAction a;
        a.shares = live::elastic_shares(window, o.workers);
        for (double& v : a.shares) v = std::round(v * 1e4) / 1e4;
        apply(a, "elastic shares");
        window.clear();
        next_elastic = step + o.elastic_every;
      }
      if (o.auto_compress_at >= 0 && !compressed && step >= o.auto_compress_at && !window.empty()) {
        live::LiveAction a;
        a.compression = live::select_compression(layers, live::grad_summary(window, layers.size()));
        apply(a, "adaptive compression");
        compressed = true;
      }
      if (window.size() > 4096) window.erase(window.begin(), window.begin() + 2048);
    }
    std::this_thread::sleep_for(20ms);
  }
}

// Without the builtin agent each worker recorded its own rows: merges them into --record, in
// (step, rank) order, and removes the per-rank files.
void merge_rank_records(const LaunchOptions& o, const std::string& rank_record) {
  std::vector<trace::TelemetrySample> rows;
  for (int r = 0; r < o.workers; ++r) {
    std::string path = rank_record;
    path.replace(path.find("{rank}"), 6, std::to_string(r));
    try {
      auto t = take(trace::read_telemetry(path));
      rows.insert(rows.end(), t.samples.begin(), t.samples.end());
      std::filesystem::remove(path);
    } catch (const std::exception& e) {
      std::printf("rank %d recorded no telemetry (%s)\n", r, e.what());
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.step != b.step ? a.step < b.step : a.rank < b.rank;
  });
  check(write_file_atomically(o.record,
                              [&](std::ostream& out) { trace::write_telemetry(rows, out); }));
  std::printf("telemetry recorded to %s (%zu rows)\n", o.record.c_str(), rows.size());
}

// The builtin agent's events and measured throughput, and its telemetry into --record.
void report_builtin_agent(const LaunchOptions& o, const live::WorkerOptions& wo,
                          live::Controller& agent) {
  for (const auto& e : agent.events()) std::printf("event: %s\n", e.c_str());
  const auto rows = agent.recorded();
  std::int64_t last = 0;
  for (const auto& r : rows) last = std::max(last, r.step);
  if (last >= 2) {
    const double sps = live::measured_steps_per_s(rows, 1, last);
    std::printf("throughput: %.2f steps/s, %.0f tokens/s (steps 1..%lld)\n", sps,
                sps * wo.global_batch * wo.model.seq_len, static_cast<long long>(last));
  }
  if (!o.record.empty()) {
    check(write_file_atomically(
        o.record, [&](std::ostream& out) { trace::write_telemetry(rows, out); }));
    std::printf("telemetry recorded to %s (%zu rows)\n", o.record.c_str(), rows.size());
  }
}

void run_launch(const LaunchOptions& o, std::vector<std::string> worker_args) {
  // Validate everything before starting a process.
  const std::vector<live::FaultSpec> faults = check_launch_flags(o);
  const bool deploy = o.agent == "deploy";
  ActionSchedule schedule = parse_schedule(o);
  worker_args.insert(worker_args.begin(), {"--backend", o.backend});
  // Without the builtin agent, each worker records its own rows; they are merged at the end.
  const std::string rank_record =
      o.record.empty() || o.agent == "builtin" ? "" : o.record + ".rank{rank}.csv";
  if (!rank_record.empty()) worker_args.insert(worker_args.end(), {"--record", rank_record});
  if (o.agent != "builtin" && o.agent != "none" && !deploy)
    worker_args.insert(worker_args.end(), {"--agent", o.agent});
  const live::WorkerOptions wo = check_worker_flags(o, worker_args, schedule);
  const auto layers = live::model_layers(wo.model);

  live::LocalClusterOptions co;
  co.workers = o.workers;
  co.worker_command = {"/proc/self/exe", "worker"};
  co.worker_args = worker_args;
  co.faults = faults;
  co.host_agent = o.agent == "builtin";
  co.log_dir = o.log_dir;
  std::string job_dir;
  if (deploy) job_dir = set_up_deploy_agent(o, wo, co);
  const std::unique_ptr<live::LocalCluster> started = take(live::LocalCluster::start(co));
  live::LocalCluster& cluster = *started;
  live::Controller* agent = cluster.controller();
  if (deploy)
    std::printf("launched %d workers (%s), parapilot deploy on 127.0.0.1:%d (job %s/job.toml, "
                "log %s)\n",
                o.workers, o.backend.c_str(), cluster.agent_port(), job_dir.c_str(),
                co.agent_log.c_str());
  else
    std::printf("launched %d workers (%s)%s\n", o.workers, o.backend.c_str(),
                agent ? (", agent bus on 127.0.0.1:" + std::to_string(agent->port())).c_str()
                      : "");
  std::fflush(stdout);

  drive_cluster(o, cluster, schedule, layers);
  // A failed rank: the others stop on their next collective (or its timeout, or the rendezvous
  // timeout when it failed before training started); terminate whoever is left after that.
  const double grace = std::max(wo.collective_timeout_s, wo.rendezvous_timeout_s) + 10;
  const auto exits = cluster.wait(cluster.elapsed_s() + (o.timeout_s > 0 ? 60 : 1e9), grace);
  bool ok = true;
  for (const auto& e : exits) {
    std::printf("%s\n", e.describe().c_str());
    ok = ok && e.exited && e.signal == 0 && e.code == 0;
  }
  if (!rank_record.empty()) merge_rank_records(o, rank_record);
  if (deploy) {
    std::fflush(stdout);
    const int code = cluster.stop_agent();
    std::printf("parapilot deploy stopped (%s)\n",
                code == 0 ? "exit 0" : ("exit " + std::to_string(code)).c_str());
    print_agent_summary(co.agent_log, wo.model.seq_len);
    ok = ok && code == 0;
  }
  if (agent) report_builtin_agent(o, wo, *agent);
  std::fflush(stdout);
  if (!ok) std::exit(1);
}

}  // namespace
#endif

void add_launch_command(CLI::App& app) {
#ifdef PARAPILOT_HAVE_LIVE
  agent::deploy::register_live_envs();
  auto options = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch",
      "Start a local live cluster of N training workers (extra flags go to every worker, e.g. "
      "--steps 200 --model mlp)");
  cmd->allow_extras();
  cmd->add_option("--workers", options->workers, "Worker processes")->capture_default_str();
  cmd->add_option("--backend", options->backend, "gloo (CPU) or nccl (GPU)")->capture_default_str();
  cmd->add_option("--inject", options->inject,
                  "Fault: rank=2,slow=3x,at=100s,for=60s | rank=2,slow=3x,at=20steps,for=10steps | "
                  "rank=1,link-delay=20ms | rank=3,kill,at=50s | rank=1,link-cut,at=30steps");
  cmd->add_option("--agent", options->agent,
                  "builtin (an in-process agent bus), deploy (start parapilot deploy beside the "
                  "workers, docs/live.md), none, or HOST:PORT of an external agent")
      ->capture_default_str();
  cmd->add_option("--agent-policy", options->agent_policy,
                  "--agent deploy: its --policy (default: the shipped policy)");
  cmd->add_option("--agent-interval-steps", options->agent_interval_steps,
                  "--agent deploy: training steps per decision")
      ->capture_default_str();
  cmd->add_option("--agent-switches", options->agent_switches,
                  "--agent deploy: what the agent may switch: dp (data-parallel shares) or "
                  "hybrid (also tensor- and pipeline-parallel degrees and stage boundaries)")
      ->check(CLI::IsMember({"dp", "hybrid"}))
      ->capture_default_str();
  cmd->add_option("--action", options->actions,
                  "Scripted action STEP:ACTION, e.g. 20:s=0.75/0.25, 40:c=30h or a layout switch "
                  "20:dp=1,pp=4 (docs/live.md)");
  cmd->add_option("--elastic-every", options->elastic_every,
                  "Re-balance batch shares from measured rank speed every N steps (0 = off)");
  cmd->add_option("--auto-compress-at", options->auto_compress_at,
                  "Switch to adaptive per-layer compression at this step");
  cmd->add_option("--record", options->record, "Write the telemetry of all ranks as a CSV");
  cmd->add_option("--log-dir", options->log_dir, "Write worker-RANK.log files here");
  cmd->add_option("--timeout", options->timeout_s,
                  "Stop the job after this many seconds (0 = none)");
  cmd->add_option("--simulated", options->simulated,
                  "Impersonate N ranks from the simulator instead of starting workers (with "
                  "--agent HOST:PORT of a running deploy; the secret from --secret-file or "
                  "PARAPILOT_SECRET)");
  cmd->add_option("--scenario", options->scenario, "Scenario of the simulated ranks")
      ->capture_default_str();
  cmd->callback([options, cmd] {
    if (options->simulated > 0) {
      if (options->agent.find(':') == std::string::npos) {
        throw InputError("--simulated needs --agent HOST:PORT of a running parapilot deploy");
      }
      std::string secret_file;
      const auto extras = cmd->remaining();
      for (size_t i = 0; i + 1 < extras.size(); ++i) {
        if (extras[i] == "--secret-file") secret_file = extras[i + 1];
      }
      run_simulated_ranks(options->simulated, options->scenario, options->agent, secret_file);
      return;
    }
    run_launch(*options, cmd->remaining());
  });
#else
  CLI::App* cmd = app.add_subcommand("launch", "Local live cluster (not in this build)");
  cmd->allow_extras();
  cmd->callback([] {
    std::fprintf(stderr,
                 "error: this build has no live cluster support (Gloo headers, "
                 "libgloo-dev, were not found)\n");
    std::exit(2);
  });
#endif
}

}  // namespace parapilot::cli
