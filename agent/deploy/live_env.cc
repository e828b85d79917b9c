#include "agent/deploy/live_env.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "agent/deploy/agent.h"
#include "env/env.h"
#include "env/live/collective_backends.h"
#include "env/live/controller.h"
#include "env/live/live_job.h"
#include "env/live/local_cluster.h"
#include "env/registry.h"
#include "core/error.h"
#include "strategy/spec_io.h"

namespace parapilot::agent::deploy {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using namespace live;  // the local cluster and the job it runs
using env::double_param;
using env::int_param;
using env::str_param;

/// Where the agent's decisions meet the env's caller: the agent's policy hands each decision's
/// observation over and waits for the caller's action (step()), so the action applies to that
/// decision's candidates. Closing releases a waiting decision with "keep".
class Handoff {
 public:
  /// The agent's side: publish `o`, wait for the action.
  int decide(const env::Observation& o) {
    std::unique_lock lock(mutex_);
    observation_ = o;
    at_ = Clock::now();
    cv_.notify_all();
    cv_.wait(lock, [&] { return action_.has_value() || closed_; });
    const int a = action_.value_or(0);
    action_.reset();
    return closed_ ? 0 : a;
  }
  /// The env's side: the next decision's observation and when it was made; nullopt after
  /// `timeout` or once closed.
  std::optional<std::pair<env::Observation, Clock::time_point>> next(Clock::duration timeout) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, timeout, [&] { return observation_.has_value() || closed_; });
    if (!observation_ || closed_) return std::nullopt;
    auto out = std::make_pair(*observation_, at_);
    observation_.reset();
    return out;
  }
  void act(int action) {
    std::lock_guard lock(mutex_);
    action_ = action;
    cv_.notify_all();
  }
  void close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::optional<env::Observation> observation_;
  std::optional<int> action_;
  Clock::time_point at_;
  bool closed_ = false;
};

/// The deploy agent's policy in the live env: whatever the env's caller chooses.
class CallerPolicy final : public policy::Policy {
 public:
  explicit CallerPolicy(std::shared_ptr<Handoff> handoff) : handoff_(std::move(handoff)) {}
  std::string name() const override { return "live-env caller"; }
  int act(const env::Observation& o) override { return handoff_->decide(o); }

 private:
  std::shared_ptr<Handoff> handoff_;
};

class LiveEnv final : public env::Env {
 public:
  explicit LiveEnv(const env::EnvId& id) : id_(id) {
    // A collective backend chosen by name (collective_backends.h), or a torch script.
    torch_ = id.variant == "torch";
    if (!torch_ && !collective_backends().find_selectable(id.variant).ok()) {
      std::string variants;
      for (const std::string& name : collective_backends().selectable_names()) {
        if (!variants.empty()) variants += ", ";
        variants += name;
      }
      throw InputError("env live:" + id.variant + ": the variant must be " + variants +
                       " or torch");
    }
    if (torch_) {
      env::reject_unknown(id, {"script", "nproc", "args", "python", "model", "global_batch",
                               "seq_len", "interval_steps", "horizon", "log_dir"});
      script_ = str_param(id, "script", "");
      if (script_.empty()) throw InputError("env live:torch: script=PATH is required");
      if (!std::filesystem::is_regular_file(script_))
        throw InputError("env live:torch: script " + script_ + " is not a file");
      script_args_ = str_param(id, "args", "");
      python_ = str_param(id, "python", "python3");
      workers_ = int_param(id, "nproc", 2, 1, 64);
    } else {
      env::reject_unknown(id, {"workers", "interval_steps", "horizon", "slow_rank", "slow_factor",
                               "slow_at", "link_delay_rank", "link_delay_ms", "layers",
                               "d_model", "heads", "seq_len", "global_batch", "microbatch", "exe",
                               "worker_arg", "log_dir"});
      workers_ = int_param(id, "workers", 2, 1, 64);
    }
    interval_steps_ = int_param(id, "interval_steps", 10, 1, 100000);
    horizon_ = int_param(id, "horizon", 20, 1, 100000);
    slow_rank_ = int_param(id, "slow_rank", -1, -1, workers_ - 1);
    slow_factor_ = double_param(id, "slow_factor", 3, 1, 1000);
    slow_at_ = double_param(id, "slow_at", 0, 0, 1e9);
    delay_rank_ = int_param(id, "link_delay_rank", -1, -1, workers_ - 1);
    delay_ms_ = double_param(id, "link_delay_ms", 0, 0, 60000);
    model_.layers = int_param(id, "layers", 1, 1, 64);
    model_.d_model = int_param(id, "d_model", 32, 4, 4096);
    model_.heads = int_param(id, "heads", 2, 1, 64);
    model_.seq_len = int_param(id, "seq_len", 32, 2, 8192);
    global_batch_ = int_param(id, "global_batch", torch_ ? 64 : 8 * workers_, workers_, 1 << 20);
    microbatch_ = int_param(id, "microbatch", 1, 1, 1 << 20);
    check(validate(model_));
    if (global_batch_ % microbatch_ != 0)
      throw InputError("env live: microbatch must divide global_batch");
    exe_ = str_param(id, "exe", "/proc/self/exe");
    worker_arg_ = str_param(id, "worker_arg", "worker");
    log_dir_ = str_param(id, "log_dir", "");
    // The job as the agent sees it, once per env: the same description launch gives deploy.
    char pattern[] = "/tmp/parapilot-live-env-XXXXXX";
    if (!::mkdtemp(pattern)) throw InputError("env live: cannot create a folder for the job file");
    job_dir_ = pattern;
    if (torch_ && id.params.count("model")) {
      // The script's model as a preset or a TOML file (a relative path from here).
      std::string model = str_param(id, "model", "");
      if (looks_like_path(model)) model = std::filesystem::absolute(model).string();
      job_ = take(
          make_job(take(write_job_scenario(model, workers_, global_batch_, job_dir_)), 0));
    } else {
      job_ = take(
          make_job(take(write_job_scenario(model_, workers_, global_batch_, job_dir_)), 0));
    }
  }
  ~LiveEnv() override {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(job_dir_, ec);
  }

  std::string id() const override {
    std::string s = "live:" + id_.variant + "(";
    bool first = true;
    for (const auto& [k, v] : id_.params) {
      s += (first ? "" : ",") + k + "=" + v;
      first = false;
    }
    return s + ")";
  }
  int horizon() const override { return horizon_; }
  double interval_s() const override { return interval_s_; }

  StatusOr<env::Observation> reset(uint64_t seed, const env::ResetOptions& options) override {
    stop();
    handoff_ = std::make_shared<Handoff>();
    {
      std::lock_guard lock(events_mutex_);
      events_.clear();
    }
    interval_ = 0;
    AgentOptions ao;
    ao.job = job_;
    const transport::Secret secret = random_secret();
    ao.secret = secret;
    ao.interval_steps = interval_steps_;
    ao.decider.interval_steps = interval_steps_;
    ao.decider.horizon = horizon_;
    ao.decider.run_intervals = horizon_;  // the episode's length is known
    ao.decider.cooldown_intervals = 0;    // as in the simulator: the caller decides when
    ao.decider.initial_layout =
        options.initial_layout == "planned" ? "planned" : "uniform-dp";
    ao.policy_path = "the live env's caller";
    ao.loader = [h = handoff_](const std::string&) -> std::unique_ptr<policy::Policy> {
      return std::make_unique<CallerPolicy>(h);
    };
    ao.log = [this](const std::string& line) { record(line); };
    auto started = DeployAgent::start(std::move(ao));
    if (!started.ok()) return started.status();
    agent_ = std::move(*started);

    LocalClusterOptions o;
    o.workers = workers_;
    o.host_agent = false;
    o.agent_port = agent_->port();
    o.agent_secret = secret;
    if (torch_) {
      // A PyTorch script speaking the bus through parapilot.pytorch.Session: torchrun's
      // variables, the agent in PARAPILOT_AGENT and PARAPILOT_SECRET_FILE, its own flags.
      o.worker_command = {python_, script_};
      std::istringstream words(script_args_);
      for (std::string w; words >> w;) o.worker_args.push_back(w);
      o.agent_flags = false;
    } else {
      o.worker_command = {exe_, worker_arg_};
      o.worker_args = {"--backend", id_.variant, "--steps", "0", "--seed", std::to_string(seed),
                     "--layers", std::to_string(model_.layers), "--d-model",
                     std::to_string(model_.d_model), "--heads", std::to_string(model_.heads),
                     "--seq-len", std::to_string(model_.seq_len), "--global-batch",
                     std::to_string(global_batch_), "--microbatch", std::to_string(microbatch_),
                     "--threads", "1", "--collective-timeout", "20"};
    }
    if (slow_rank_ >= 0) {
      FaultSpec f;
      f.rank = slow_rank_;
      f.kind = FaultSpec::Kind::slow;
      f.factor = slow_factor_;
      f.at_s = slow_at_;
      o.faults.push_back(f);
    }
    if (delay_rank_ >= 0 && delay_ms_ > 0) {
      FaultSpec f;
      f.rank = delay_rank_;
      f.kind = FaultSpec::Kind::link_delay;
      f.delay_ms = delay_ms_;
      o.faults.push_back(f);
    }
    o.log_dir = log_dir_;
    auto launched = LocalCluster::start(o);
    if (!launched.ok()) {
      stop();
      return launched.status();
    }
    cluster_ = std::move(*launched);
    auto first = first_decision();
    if (!first.ok()) {
      stop();
      return first.status();
    }
    last_at_ = first->second;
    const monitor::Beliefs b = agent_->monitor()->beliefs();
    last_step_ = b.any_closed ? b.last_closed_step : 0;
    return first->first;
  }

  env::StepResult step(int action) override {
    if (!agent_) throw std::logic_error("env live: step() before reset()");
    const AgentStats before = agent_->stats();
    handoff_->act(action);
    env::StepResult res;
    auto next = handoff_->next(600s);
    res.info.interval = ++interval_;
    res.truncated = interval_ >= horizon_;
    const AgentStats after = agent_->stats();
    res.info.migration_started = after.switches_decided > before.switches_decided;
    res.info.migration_committed = after.migrations_committed > before.migrations_committed;
    const monitor::Beliefs b = agent_->monitor()->beliefs();
    res.terminated = !next || std::count(b.conditions.gpu_failed.begin(),
                                         b.conditions.gpu_failed.end(), true) > 0;
    if (!next) {
      record(R"({"event":"episode_ended","reason":"no decision within 600 s"})");
      return res;
    }
    // Measured: samples of the steps closed since the last decision over the wall time between
    // the two decisions. Ideal: every rank computing all the time at its measured pace, with
    // communication free (1 is out of reach; higher is better).
    const uint64_t step = b.any_closed ? b.last_closed_step : 0;
    const double steps = static_cast<double>(step > last_step_ ? step - last_step_ : 0);
    const double span_s = std::chrono::duration<double>(next->second - last_at_).count();
    last_at_ = next->second;
    last_step_ = step;
    interval_s_ = span_s;
    const double tokens_per_sample = job_->scenario.model.seq_len;
    res.info.tokens = steps * global_batch_ * tokens_per_sample;
    res.info.tokens_per_s = span_s > 0 ? res.info.tokens / span_s : 0;
    double ideal_samples_per_s = 0;
    for (size_t r = 0; r < b.rank_compute_ms.size(); ++r) {
      const bool lost = r < b.conditions.gpu_failed.size() && b.conditions.gpu_failed[r];
      if (b.compute_per_sample && b.rank_compute_ms[r] > 0 && !lost)
        ideal_samples_per_s += 1000.0 / b.rank_compute_ms[r];
    }
    const double ideal = ideal_samples_per_s * tokens_per_sample;
    res.info.best_tokens = ideal * span_s;
    res.reward = ideal > 0 ? std::min(1.5, res.info.tokens_per_s / ideal) : 0;
    res.observation = next->first;
    return res;
  }

  std::vector<std::pair<int, std::string>> events() const override {
    std::lock_guard lock(events_mutex_);
    return events_;
  }

 private:

  // Agent log lines worth an episode event: migrations and monitor events, not decisions.
  void record(const std::string& line) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("event") || j["event"] == "decision") return;
    std::lock_guard lock(events_mutex_);
    events_.emplace_back(interval_, line);
  }

  // The first decision's observation, waiting up to 120 s; kUnavailable as soon as a worker
  // fails (naming how it ended) or when none comes.
  StatusOr<std::pair<env::Observation, Clock::time_point>> first_decision() {
    const std::string logs = log_dir_.empty() ? std::string("log_dir=DIR keeps their logs")
                                              : "their logs are in " + log_dir_;
    for (int waited_s = 0; waited_s < 120; ++waited_s) {
      if (auto first = handoff_->next(1s)) return *first;
      cluster_->poll();
      if (!cluster_->any_failed()) continue;
      std::string how;
      for (const RankExit& e : cluster_->wait(5, 0))
        if (e.signal != 0 || e.code != 0) how += (how.empty() ? "" : "; ") + e.describe();
      return Status::unavailable("env live: a worker failed before the first decision: " + how +
                                 " (" + logs + ")");
    }
    return Status::unavailable("env live: no decision within 120 s; did the workers start? (" +
                               logs + ")");
  }

  void stop() {
    if (handoff_) handoff_->close();  // a decision waiting for the caller keeps the layout
    if (cluster_) {
      cluster_->terminate();
      cluster_->wait(30, 10);
      cluster_.reset();
    }
    if (agent_) {
      agent_->stop();
      agent_.reset();
    }
  }

  env::EnvId id_;
  int workers_, interval_steps_, horizon_, slow_rank_, delay_rank_, global_batch_, microbatch_;
  double slow_factor_, slow_at_, delay_ms_;
  ModelConfig model_;
  bool torch_ = false;
  std::string exe_, worker_arg_, log_dir_, job_dir_, script_, script_args_, python_;
  std::shared_ptr<const Job> job_;
  std::shared_ptr<Handoff> handoff_;
  std::unique_ptr<DeployAgent> agent_;
  std::unique_ptr<LocalCluster> cluster_;
  std::atomic<int> interval_{0};  // read by the agent's log callback
  double interval_s_ = 0;
  Clock::time_point last_at_;
  uint64_t last_step_ = 0;
  mutable std::mutex events_mutex_;
  std::vector<std::pair<int, std::string>> events_;
};

}  // namespace

void register_live_envs() {
  static std::once_flag once;
  std::call_once(once, [] {
    env::register_env("live", [](const env::EnvId& id) -> StatusOr<std::unique_ptr<env::Env>> {
      return catch_input_error(
          [&]() -> std::unique_ptr<env::Env> { return std::make_unique<LiveEnv>(id); });
    });
  });
}

}  // namespace parapilot::agent::deploy
