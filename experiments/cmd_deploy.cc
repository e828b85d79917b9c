// parapilot deploy: the agent daemon beside a running job (agent/deploy/agent.h).
// parapilot simcluster: N simulated ranks speaking the bus protocol (env/simcluster/sim_cluster.h).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <nlohmann/json.hpp>

#include "agent/deploy/agent.h"
#include "agent/deploy/metrics.h"
#include "env/simcluster/sim_cluster.h"
#include "experiments/cli_common.h"
#include "experiments/commands.h"
#include "policy/loader.h"
#include "policy/registry.h"
#include "core/error.h"
#include "transport/auth.h"

namespace parapilot::cli {

namespace {

namespace rt = agent::deploy;

transport::Secret load_secret(const std::string& file) {
  auto secret = file.empty() ? transport::load_secret_from_env("PARAPILOT_SECRET")
                             : transport::load_secret_from_file(file);
  if (!secret) {
    throw InputError(
        (file.empty() ? "no --secret-file and PARAPILOT_SECRET: " : "--secret-file: ") +
        secret.status().message());
  }
  return std::move(*secret);
}

// Calls `on_signal` (on a watcher thread) when SIGINT or SIGTERM arrives. The handlers are
// process-wide, so it works whichever thread the kernel picks (libraries start their own).
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int sig) {
  const char c = static_cast<char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe[1], &c, 1);
}

class SignalWatcher {
 public:
  explicit SignalWatcher(std::function<void()> on_signal) {
    if (::pipe(g_signal_pipe) != 0) throw InputError("cannot create a pipe for signals");
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int_);
    sigaction(SIGTERM, &sa, &old_term_);
    thread_ = std::thread([on_signal = std::move(on_signal)] {
      char c = 0;
      if (::read(g_signal_pipe[0], &c, 1) == 1 && c != 0) on_signal();
    });
  }
  ~SignalWatcher() {
    sigaction(SIGINT, &old_int_, nullptr);
    sigaction(SIGTERM, &old_term_, nullptr);
    const char zero = 0;
    [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe[1], &zero, 1);  // wakes the watcher
    thread_.join();
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
  }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
  std::thread thread_;
};

struct DeployFlags {
  std::string policy;
  std::string listen = "127.0.0.1:7070";
  std::string secret_file;
  int metrics_port = -1;
  std::string scenario;  // empty: learn the job from its ranks
  int gpus = 64;
  std::string log_format = "json";
  int interval_steps = 10;
  int cooldown = 2;
  uint32_t prepare_deadline_ms = 30000;
  uint32_t commit_margin_steps = 3;
  uint32_t commit_lead_ms = 500;
  std::string initial_layout = "planned";
  int64_t total_steps = 0;
};

std::string shares_or(const nlohmann::json& j, const char* key) {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string("?");
}

// One human-readable line for one JSON log record (--log-format text); "" to skip it.
std::string text_line(const std::string& json) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, false);
  if (!j.is_object() || !j.contains("event")) return json;
  const std::string event = j["event"].get<std::string>();
  auto num = [&](const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
  };
  auto str = [&](const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  char head[96];
  std::snprintf(head, sizeof head, "step %6.0f  ", num("step"));
  if (event == "agent_started") {
    return "deploy: listening on port " + std::to_string(j["port"].get<int>()) + "; policy " +
           str("policy") + "; job " + str("job");
  }
  // A learned job's knob: a pipeline's blocks per stage, or batch shares.
  const bool pipeline = j.contains("split");
  const char* knob = pipeline ? "split" : "shares";
  const std::string target = std::string("target_") + knob;
  if (event == "job_learned") {
    char text[320];
    std::snprintf(text, sizeof text,
                  "job: %.0f ranks, global batch %.0f, %s, %.0f layers, %.0f parameters; "
                  "switchable: %s%s; %s %s",
                  num("ranks"), num("global_batch"), str("framework").c_str(), num("layers"),
                  num("params"), pipeline ? "pipeline stages" : "batch shares",
                  j["can_switch"].value("compression", false) ? ", compression" : "", knob,
                  str(knob).c_str());
    return text;
  }
  if (event == "decision" && j.contains("reason")) {  // a learned job's decision
    const std::string action = str("action");
    char text[512];
    if (action == "keep") {
      char rate[64] = "no full steps yet";
      if (num("step_ms") > 0) {
        std::snprintf(rate, sizeof rate, "%.1f ms/step  %.0f samples/s", num("step_ms"),
                      num("samples_per_s"));
      }
      std::snprintf(text, sizeof text, "%skeep       %s %s  %s  (%s)", head, knob,
                    shares_or(j, knob).c_str(), rate, str("reason").c_str());
    } else {
      char gain[48] = "";
      if (j.contains("predicted_gain")) {
        std::snprintf(gain, sizeof gain, ", predicted gain %.2fx", num("predicted_gain"));
      }
      std::snprintf(text, sizeof text, "%s%-10s %s %s -> %s  %.1f ms/step%s  (%s)", head,
                    action.c_str(), knob, shares_or(j, knob).c_str(),
                    shares_or(j, target.c_str()).c_str(), num("step_ms"), gain,
                    str("reason").c_str());
    }
    return text;
  }
  if (event == "decision") {  // a described job's decision
    return head + std::string("decision ") +
           (j.contains("choice") && j["choice"].is_string() ? j["choice"].get<std::string>()
                                                            : std::string("keep")) +
           (str("guardrail").empty() ? "" : " (guardrail: " + str("guardrail") + ")") +
           (str("held_back").empty() ? "" : " (held back: " + str("held_back") + ")");
  }
  if (event == "migration") {
    std::snprintf(head, sizeof head, "step %6.0f  ", num("switch_at_step"));
    const bool committed = str("outcome") == "committed";
    std::string what = j.contains("shares") || pipeline
                           ? std::string(knob) + " " + str(knob)
                           : str("layout");
    if (j.value("revert", false)) what += " (revert)";
    return head + std::string(committed ? "committed  " : "ABORTED    ") + what +
           (str("reason").empty() ? "" : "  (" + str("reason") + ")");
  }
  if (event == "job_mismatch" || event == "policy_fallback") return "WARNING: " + str("reason");
  if (event == "rank_lost" && j.contains("reason"))
    return "rank " + std::to_string(j["rank"].get<int>()) + " lost: " + str("reason");
  if (event == "agent_stopped") {
    std::string text = "summary: " + std::to_string(j["decisions"].get<long>()) + " decisions, " +
                       std::to_string(j["committed"].get<long>()) + " committed (" +
                       std::to_string(j["reverted"].get<long>()) + " of them reverts), " +
                       std::to_string(j["aborted"].get<long>()) + " aborted, " +
                       std::to_string(j["held_back"].get<long>()) + " held back; " +
                       std::to_string(j["stragglers_detected"].get<long>()) +
                       " slow-rank events; telemetry " +
                       std::to_string(j["telemetry_accepted"].get<long>()) + " accepted";
    for (const auto& [reason, n] : j["telemetry_rejected"].items()) {
      text += ", " + std::to_string(n.get<long>()) + " rejected (" + reason + ")";
    }
    if (j.contains("layout")) {
      text += "; now " + str("layout") +
              (j.contains("shares") || pipeline ? std::string(" ") + knob + " " + str(knob) : "");
    }
    char pace[160] = "";
    if (num("step_ms_before") > 0 && num("step_ms_after") > 0) {
      std::snprintf(pace, sizeof pace,
                    "; %.1f ms per step before the first switch, %.1f ms after the last (%.0f "
                    "steps, %.2fx)",
                    num("step_ms_before"), num("step_ms_after"), num("steps_after"),
                    num("step_ms_before") / num("step_ms_after"));
    } else if (num("step_ms_before") > 0) {
      std::snprintf(pace, sizeof pace, "; %.1f ms per step", num("step_ms_before"));
    }
    char tail[96];
    std::snprintf(tail, sizeof tail, "; deploy used %.2f s of CPU", num("cpu_s"));
    return text + pace + tail;
  }
  if (j.contains("rank") && j.contains("evidence")) {
    const int rank = j["rank"].get<int>();
    return head + event +
           (rank >= 0 ? " rank " + std::to_string(rank)
                      : " node " + std::to_string(j.value("node", -1))) +
           ": " + str("evidence");
  }
  return json;
}

void run_deploy(const DeployFlags& f) {
  const auto [host, port] = parse_address("--listen", f.listen, false);
  if (f.metrics_port > 65535) throw InputError("--metrics-port: must be in 0..65535");
  if (f.interval_steps < 1) throw InputError("--interval-steps: must be >= 1");
  if (f.cooldown < 0) throw InputError("--cooldown: must be >= 0");
  if (f.log_format != "json" && f.log_format != "text") {
    throw InputError("--log-format \"" + f.log_format + "\": expected json or text");
  }
  rt::AgentOptions o;
  if (!f.scenario.empty()) {
    o.job = take(make_job(f.scenario, f.gpus));
    if (Status st = o.job->start_layout(f.initial_layout).status(); !st.ok())
      throw InputError("--initial-layout " + st.message());
  } else {
    // A learned job: per-step noise on a shared machine is large; flag only clear slowdowns.
    o.monitor.slow_speed = 1 / 1.25;
    o.monitor.recovered_speed = 1 / 1.1;
    o.monitor.compute_alpha = 0.2;
    o.monitor.confirm_steps = 5;
  }
  o.data_parallel.cooldown_intervals = f.cooldown;
  // No --policy: the shipped default policy, rl. A value is checked here (a bad id is exit
  // code 2); the agent then makes it, falling back to reactive when a checkpoint cannot be read.
  const policy::PolicyArgs chosen =
      take(policy::parse_policy_or_checkpoint(f.policy.empty() ? "rl" : f.policy));
  const policy::PolicyCapabilities& can = chosen.info().capabilities;
  if (can.hindsight || can.needs_planning_view) {
    throw InputError("--policy " + chosen.id() + ": " + chosen.info().name +
                     (can.hindsight ? " needs the future" : " needs a simulator's planning view") +
                     ", which a running job does not have");
  }
  o.policy_path = chosen.id();
  o.loader = [](const std::string& id) { return policy::make_policy(id, nullptr); };
  o.listen_address = host;
  o.port = port;
  o.secret = load_secret(f.secret_file);
  o.serve_metrics = f.metrics_port >= 0;
  o.metrics_port = static_cast<uint16_t>(std::max(0, f.metrics_port));
  o.interval_steps = f.interval_steps;
  o.decider.cooldown_intervals = f.cooldown;
  o.decider.initial_layout = f.initial_layout;
  // The planned run length in decisions (ceil); 0: unknown.
  o.decider.run_intervals =
      static_cast<int>((f.total_steps + f.interval_steps - 1) / f.interval_steps);
  o.migration.prepare_deadline_ms = f.prepare_deadline_ms;
  o.migration.commit_margin_steps = f.commit_margin_steps;
  o.migration.commit_lead_ms = f.commit_lead_ms;
  auto out_mutex = std::make_shared<std::mutex>();
  const bool text = f.log_format == "text";
  o.log = [out_mutex, text](const std::string& json) {
    const std::string line = text ? text_line(json) : json;
    std::lock_guard lock(*out_mutex);
    // Not deciding with the policy asked for is said on stderr too, whatever the log format.
    if (json.find("\"event\":\"policy_fallback\"") != std::string::npos) {
      std::fprintf(stderr,
                   "parapilot deploy: %s\nparapilot deploy: deciding with the reactive baseline "
                   "instead (install the shipped policy with cmake --install, or name one with "
                   "--policy)\n",
                   text_line(json).c_str());
    }
    std::fputs(line.c_str(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  };
  std::atomic<bool> stop{false};
  std::mutex m;
  std::condition_variable cv;
  SignalWatcher signals([&] {
    std::lock_guard lock(m);
    stop = true;
    cv.notify_all();
  });
  const std::unique_ptr<rt::DeployAgent> started = take(rt::DeployAgent::start(o));
  rt::DeployAgent& agent = *started;
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return stop.load(); });
  }
  agent.stop();
  const rt::AgentStats s = agent.stats();
  const rt::JobPace pace = agent.pace();
  const Strategy now = agent.current_layout();
  const rt::ProcessUsage usage = rt::process_usage();
  const monitor::Monitor* mon = agent.monitor();
  const monitor::MonitorCounters mc = mon ? mon->counters() : monitor::MonitorCounters{};
  nlohmann::json rejected = nlohmann::json::object();
  for (const auto& [reason, n] : mc.rejected_by_reason) rejected[reason] = n;
  auto q = [](std::vector<double> v, double p) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1,
                      static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
  };
  nlohmann::json j = {{"event", "agent_stopped"},
                      {"decisions", s.decisions},
                      {"prepared", s.switches_decided},
                      {"committed", s.migrations_committed},
                      {"reverted", s.reverts_committed},
                      {"aborted", s.migrations_aborted},
                      {"held_back", s.held_back},
                      {"telemetry_accepted", mc.accepted},
                      {"telemetry_before_job_info", s.telemetry_before_job},
                      {"telemetry_rejected", rejected},
                      {"stragglers_detected", s.stragglers_detected},
                      {"features_clipped", s.features_clipped},
                      {"features_unseen", s.features_unseen},
                      {"decision_latency_ms_p50", q(s.decision_latency_ms, 0.5)},
                      {"decision_latency_ms_p99", q(s.decision_latency_ms, 0.99)},
                      {"prepare_latency_ms_p50", q(s.prepare_latency_ms, 0.5)},
                      {"prepare_latency_ms_p99", q(s.prepare_latency_ms, 0.99)},
                      {"cpu_s", usage.cpu_s},
                      {"max_rss_mib", usage.max_rss_bytes / (1 << 20)}};
  // Where the job ended and how fast it ran before the first switch and after the last.
  if (now.dp > 0 && now.num_gpus() > 0 && now.global_batch > 0) {
    j["layout"] = layout_name(now);
    if (!now.dp_shares.empty()) {
      std::string shares;
      for (int c : now.dp_shares) shares += (shares.empty() ? "" : ",") + std::to_string(c);
      j["shares"] = shares;
    }
    if (f.scenario.empty() && now.pp > 1) {  // a learned pipeline: its blocks per stage
      std::string split;
      for (int n : now.stage_layers) split += (split.empty() ? "" : ",") + std::to_string(n);
      j["split"] = split;
    }
  }
  auto per_s = [&](double step_ms) {
    return step_ms > 0 && pace.global_batch > 0 ? pace.global_batch * 1000.0 / step_ms : 0.0;
  };
  j["steps_before"] = pace.steps_before;
  j["step_ms_before"] = pace.step_ms_before;
  j["samples_per_s_before"] = per_s(pace.step_ms_before);
  j["steps_after"] = pace.steps_after;
  j["step_ms_after"] = pace.step_ms_after;
  j["samples_per_s_after"] = per_s(pace.step_ms_after);
  o.log(j.dump());
}

struct SimFlags {
  int ranks = 64;
  std::string scenario = "straggler";
  std::string agent = "127.0.0.1:7070";
  std::string secret_file;
  uint64_t seed = 1;
  double step_ms = 20;
  int steps_per_interval = 10;
  uint64_t steps = 0;
  std::vector<std::string> slow;
  bool no_dynamics = false;
  size_t io_threads = 2;
  bool json = false;
};

env::SlowdownInjection parse_slow(const std::string& text) {
  // RANK:FACTOR:FROM[:TO]
  env::SlowdownInjection s;
  unsigned rank = 0;
  double factor = 0;
  unsigned long long from = 0, to = 0;
  char tail = 0;
  const int n = std::sscanf(text.c_str(), "%u:%lf:%llu:%llu%c", &rank, &factor, &from, &to, &tail);
  if (n < 3 || n > 4 || factor < 1 || (n == 4 && to <= from)) {
    throw InputError("--slow \"" + text +
                     "\": expected RANK:FACTOR:FROM_STEP[:TO_STEP], factor >= 1");
  }
  s.rank = rank;
  s.factor = factor;
  s.from_step = from;
  if (n == 4) s.to_step = to;
  return s;
}

void run_simcluster(const SimFlags& f) {
  env::SimClusterOptions o;
  o.ranks = f.ranks;
  o.scenario = f.scenario;
  const auto [host, port] = parse_address("--agent", f.agent, true);
  o.agent_address = host;
  o.agent_port = port;
  o.secret = load_secret(f.secret_file);
  o.seed = f.seed;
  if (f.step_ms < 0) throw InputError("--step-ms: must be >= 0");
  o.step_ms = f.step_ms;
  o.steps_per_interval = f.steps_per_interval;
  o.use_truth = !f.no_dynamics;
  o.io_threads = std::max<size_t>(1, f.io_threads);
  for (const auto& s : f.slow) o.slowdowns.push_back(parse_slow(s));
  o.log = [](const std::string& line) { std::fprintf(stderr, "simcluster: %s\n", line.c_str()); };
  std::atomic<bool> stop{false};
  SignalWatcher signals([&] { stop = true; });
  const env::SimClusterReport r = take(env::run_simulated_cluster(o, stop, f.steps));
  double before = 0, after = 0;
  const size_t first_commit =
      r.commit_steps.empty() ? r.tokens_per_s_by_step.size() : r.commit_steps.front();
  for (size_t i = 0; i < r.tokens_per_s_by_step.size(); ++i) {
    (i < first_commit ? before : after) += r.tokens_per_s_by_step[i];
  }
  nlohmann::json j = {
      {"steps", r.steps},
      {"commits", r.commits},
      {"aborts_seen_by_ranks", r.aborts},
      {"missed_commits", r.missed_commits},
      {"layout", layout_name(r.layout)},
      {"live_ranks", r.live_ranks},
      {"sim_seconds", r.sim_seconds},
      {"tokens_per_s", r.sim_seconds > 0 ? r.tokens / r.sim_seconds : 0.0},
      {"tokens_per_s_before_first_switch",
       first_commit > 0 ? before / static_cast<double>(first_commit) : 0.0},
      {"tokens_per_s_after_first_switch",
       r.tokens_per_s_by_step.size() > first_commit
           ? after / static_cast<double>(r.tokens_per_s_by_step.size() - first_commit)
           : 0.0},
      {"telemetry_sent", r.telemetry_sent}};
  std::printf("%s\n", f.json ? j.dump().c_str() : j.dump(2).c_str());
}

}  // namespace

void add_deploy_command(CLI::App& app) {
  auto d = std::make_shared<DeployFlags>();
  policy::register_learned_policies();
  CLI::App* cmd = app.add_subcommand(
      "deploy",
      "Run the agent daemon: watch a job's ranks on the bus, decide with a policy, switch layouts "
      "without stopping training (JSON lines on stdout; stops on SIGINT/SIGTERM)");
  cmd->add_option(
      "--policy", d->policy,
      "the policy that decides, for a described job and for one learned from its ranks alike: a "
      "policy id from the registry (default rl, the shipped policy, "
      "share/parapilot/default-mixed.ckpt beside the binary; rl(path=FILE) a checkpoint; "
      "measured-shares, reactive, static, threshold, ... a rule; not lookahead or oracle), or a "
      "plain checkpoint "
      "path (a value that is no policy's name and contains '/' or ends in .ckpt is read as "
      "rl(path=VALUE)); a missing or unreadable checkpoint falls back to reactive, with a "
      "warning on stderr, logged and in the metrics. Policies:\n" + policy::describe_policies());
  cmd->add_option("--listen", d->listen, "bus address HOST:PORT (loopback unless told otherwise)")
      ->capture_default_str();
  cmd->add_option("--secret-file", d->secret_file,
                  "shared bus secret (default: the PARAPILOT_SECRET environment variable)");
  cmd->add_option("--metrics-port", d->metrics_port,
                  "serve Prometheus metrics at http://127.0.0.1:PORT/metrics (0: any free port)");
  cmd->add_option("--scenario", d->scenario,
                  "the job: a scenario family or .toml (model, cluster, search space); default: "
                  "learn the job from its ranks' announcements and, from its own telemetry, "
                  "rebalance a data-parallel job's batch shares or a pipeline's blocks per stage");
  cmd->add_option("--gpus", d->gpus, "GPUs (= ranks) of the job, for a --scenario family name")
      ->capture_default_str();
  cmd->add_option("--log-format", d->log_format,
                  "json (one object per line) or text (human-readable)")
      ->capture_default_str();
  cmd->add_option("--interval-steps", d->interval_steps, "training steps per decision")
      ->capture_default_str();
  cmd->add_option("--cooldown", d->cooldown, "decisions to wait after a switch")
      ->capture_default_str();
  cmd->add_option("--prepare-deadline-ms", d->prepare_deadline_ms,
                  "time allowed for every PlanReady")
      ->capture_default_str();
  cmd->add_option("--commit-margin-steps", d->commit_margin_steps,
                  "the switch happens this many steps after the last PlanReady")
      ->capture_default_str();
  cmd->add_option("--commit-lead-ms", d->commit_lead_ms,
                  "...and at least this much wall time of steps after it (so every rank holds the "
                  "commit before the boundary)")
      ->capture_default_str();
  cmd->add_option("--initial-layout", d->initial_layout,
                  "the job's layout at start: planned | uniform-dp | a layout such as "
                  "dp=2,pp=2,stages=[1,3]")
      ->capture_default_str();
  cmd->add_option("--total-steps", d->total_steps,
                  "the job's planned length in training steps (0: unknown; the policy is told so)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->callback([d] { run_deploy(*d); });

  auto s = std::make_shared<SimFlags>();
  CLI::App* sim = app.add_subcommand(
      "simcluster",
      "Impersonate N ranks of a training job from the simulator on the bus (drive `deploy` without "
      "GPUs); prints a JSON report at the end");
  sim->add_option("--ranks", s->ranks, "ranks (= GPUs), a multiple of 8")->capture_default_str();
  sim->add_option("--scenario", s->scenario, "scenario family or .toml")->capture_default_str();
  sim->add_option("--agent", s->agent, "the deploy agent's bus address HOST:PORT")
      ->capture_default_str();
  sim->add_option("--secret-file", s->secret_file,
                  "shared bus secret (default: $PARAPILOT_SECRET)");
  sim->add_option("--seed", s->seed, "seed of the scenario's hidden dynamics")
      ->capture_default_str();
  sim->add_option("--step-ms", s->step_ms, "wall time per training step (0: as fast as possible)")
      ->capture_default_str();
  sim->add_option("--steps-per-interval", s->steps_per_interval,
                  "steps per simulator interval (how fast the hidden conditions move)")
      ->capture_default_str();
  sim->add_option("--steps", s->steps, "stop after this many steps (0: until SIGINT/SIGTERM)")
      ->capture_default_str();
  sim->add_option("--slow", s->slow,
                  "inject a slowdown RANK:FACTOR:FROM_STEP[:TO_STEP] (repeatable)");
  sim->add_flag("--no-dynamics", s->no_dynamics, "nominal cluster apart from --slow injections");
  sim->add_option("--io-threads", s->io_threads, "bus client I/O threads")->capture_default_str();
  sim->add_flag("--json", s->json, "one-line JSON report");
  sim->callback([s] { run_simcluster(*s); });
}

void run_simulated_ranks(int ranks, const std::string& scenario, const std::string& agent,
                         const std::string& secret_file) {
  SimFlags f;
  f.ranks = ranks;
  f.scenario = scenario;
  f.agent = agent;
  f.secret_file = secret_file;
  run_simcluster(f);
}

}  // namespace parapilot::cli
