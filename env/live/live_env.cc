#include "env/live/live_env.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>

#include "env/env.h"
#include "env/live/local_cluster.h"
#include "strategy/error.h"

namespace parapilot::live {

namespace {

using namespace std::chrono_literals;
using env::double_param;
using env::int_param;
using env::str_param;


/// What one interval's telemetry says.
struct IntervalStats {
  std::vector<double> speed;  ///< microbatches per compute second, per rank.
  double steps = 0;
  double span_s = 0;
  double comm_ms_per_step = 0;  ///< mean over ranks of dp collective time per step.
  double step_ms = 0;           ///< wall time per step.
  std::vector<LayerGradSummary> grads;
  int missing_ranks = 0;
};

class LiveEnv final : public env::Env {
 public:
  explicit LiveEnv(const env::EnvId& id) : id_(id) {
    if (id.variant != "gloo" && id.variant != "nccl")
      throw InputError("env live:" + id.variant + ": the variant must be gloo or nccl");
    env::reject_unknown(id, {"workers", "interval_steps", "horizon", "slow_rank", "slow_factor",
                             "slow_at", "link_delay_rank", "link_delay_ms", "layers", "d_model",
                             "heads", "seq_len", "global_batch", "microbatch", "exe",
                             "worker_arg", "log_dir"});
    workers_ = int_param(id, "workers", 2, 1, 64);
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
    global_batch_ = int_param(id, "global_batch", 8 * workers_, 1, 1 << 20);
    microbatch_ = int_param(id, "microbatch", 1, 1, 1 << 20);
    validate(model_);
    if (global_batch_ % microbatch_ != 0)
      throw InputError("env live: microbatch must divide global_batch");
    exe_ = str_param(id, "exe", "/proc/self/exe");
    worker_arg_ = str_param(id, "worker_arg", "worker");
    log_dir_ = str_param(id, "log_dir", "");
    layers_ = model_layers(model_);
  }
  ~LiveEnv() override { stop(); }

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
  double interval_s() const override { return last_.span_s; }

  env::Observation reset(uint64_t seed, const env::ResetOptions&) override {
    stop();
    LocalClusterOptions o;
    o.workers = workers_;
    o.worker_command = {exe_, worker_arg_};
    o.worker_args = {"--backend",
                     id_.variant,
                     "--steps",
                     "0",
                     "--seed",
                     std::to_string(seed),
                     "--layers",
                     std::to_string(model_.layers),
                     "--d-model",
                     std::to_string(model_.d_model),
                     "--heads",
                     std::to_string(model_.heads),
                     "--seq-len",
                     std::to_string(model_.seq_len),
                     "--global-batch",
                     std::to_string(global_batch_),
                     "--microbatch",
                     std::to_string(microbatch_),
                     "--threads",
                     "1",
                     "--collective-timeout",
                     "20"};
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
    cluster_ = std::make_unique<LocalCluster>(o);
    if (!cluster_->controller()->wait_for_ranks(workers_, 120s))
      throw std::runtime_error("env live: the workers did not connect within 120 s");
    interval_ = 0;
    last_migration_ = -1;
    events_.clear();
    shares_.assign(static_cast<std::size_t>(workers_), 1.0 / workers_);
    compression_.assign(layers_.size(), Compression::none);
    next_step_ = 0;
    last_ = run_interval();
    return observe(last_, last_);
  }

  env::StepResult step(int action) override {
    if (!cluster_) throw std::logic_error("env live: step() before reset()");
    env::StepResult res;
    const IntervalStats before = last_;
    if (action >= 1 && action <= env::kMaxCandidates) {
      const LiveAction a = candidate(action - 1, before);
      const StatusOr<AppliedPlan> r = cluster_->controller()->apply(a, 60s);
      res.info.migration_started = true;
      res.info.migration_committed = r.ok();
      if (r.ok()) {
        if (!a.shares.empty()) shares_ = a.shares;
        if (!a.compression.empty()) compression_ = a.compression;
        last_migration_ = interval_;
        events_.emplace_back(
            interval_, "switch to candidate " + std::to_string(action) + ": " + encode_action(a));
      } else {
        events_.emplace_back(interval_, "switch refused: " + r.status().message());
      }
    }
    last_ = run_interval();
    ++interval_;
    const double tokens_per_step = static_cast<double>(global_batch_) * model_.seq_len;
    res.info.interval = interval_;
    res.info.tokens = last_.steps * tokens_per_step;
    res.info.tokens_per_s = last_.span_s > 0 ? res.info.tokens / last_.span_s : 0;
    const double ideal = ideal_steps_per_s(last_) * tokens_per_step;
    res.info.best_tokens = ideal * last_.span_s;
    res.reward = ideal > 0 ? res.info.tokens_per_s / ideal : 0;
    res.terminated = !cluster_->controller()->lost_ranks().empty();
    res.truncated = interval_ >= horizon_;
    res.observation = observe(last_, before);
    if (res.terminated) {
      for (const auto& e : cluster_->controller()->events()) events_.emplace_back(interval_, e);
    }
    return res;
  }

  std::vector<std::pair<int, std::string>> events() const override { return events_; }

 private:
  void stop() {
    if (!cluster_) return;
    cluster_->controller()->request_stop("env reset or closed");
    cluster_->wait(30, 10);
    cluster_.reset();
  }

  IntervalStats run_interval() {
    Controller& c = *cluster_->controller();
    const std::uint64_t target = next_step_ + static_cast<std::uint64_t>(interval_steps_) - 1;
    c.wait_for_step(target, std::chrono::seconds(600));
    next_step_ = c.completed_step() + 1;
    return summarize(c.take_telemetry());
  }

  IntervalStats summarize(const std::vector<transport::Telemetry>& ts) const {
    IntervalStats s;
    s.speed.assign(static_cast<std::size_t>(workers_), 0);
    std::vector<double> ms(static_cast<std::size_t>(workers_), 0), mbs(ms), comm(ms), n(ms);
    std::uint64_t first_ns = UINT64_MAX, last_ns = 0, min_step = UINT64_MAX, max_step = 0;
    for (const auto& t : ts) {
      if (static_cast<int>(t.rank) >= workers_) continue;
      ms[t.rank] += t.compute_ms;
      mbs[t.rank] += static_cast<double>(t.collectives.count("info/microbatches")
                                             ? t.collectives.at("info/microbatches").bytes
                                             : 0);
      for (const auto& [k, v] : t.collectives)
        if (k.ends_with("/dp")) comm[t.rank] += v.ms;
      n[t.rank] += 1;
      first_ns = std::min(first_ns, t.step_start_ns);
      last_ns = std::max(last_ns, t.step_end_ns);
      min_step = std::min(min_step, t.step);
      max_step = std::max(max_step, t.step);
    }
    double comm_sum = 0;
    int ranks = 0;
    for (int r = 0; r < workers_; ++r) {
      if (n[r] == 0) {
        ++s.missing_ranks;
        continue;
      }
      s.speed[r] = ms[r] > 0 ? mbs[r] / (ms[r] / 1000) : 0;
      comm_sum += comm[r] / n[r];
      ++ranks;
    }
    s.comm_ms_per_step = ranks ? comm_sum / ranks : 0;
    if (max_step >= min_step && last_ns > first_ns) {
      s.steps = static_cast<double>(max_step - min_step + 1);
      s.span_s = static_cast<double>(last_ns - first_ns) * 1e-9;
      s.step_ms = s.span_s * 1000 / s.steps;
    }
    s.grads = grad_summary(ts, layers_.size());
    return s;
  }

  /// Compute-bound ideal: every rank busy all the time (microbatches per second / microbatches).
  double ideal_steps_per_s(const IntervalStats& s) const {
    double total = 0;
    for (double v : s.speed) total += v;
    return total / (global_batch_ / microbatch_);
  }

  /// Predicted step seconds of `shares` under measured speeds, plus communication scaled by bytes.
  double predicted_step_s(const IntervalStats& s, const std::vector<double>& shares,
                          double comm_scale) const {
    const int total_mb = global_batch_ / microbatch_;
    const auto counts = microbatch_counts(shares, total_mb);
    double worst = 0;
    for (int r = 0; r < workers_; ++r)
      if (s.speed[r] > 0) worst = std::max(worst, counts[r] / s.speed[r]);
    return worst + comm_scale * s.comm_ms_per_step / 1000;
  }

  double bytes_ratio(const std::vector<Compression>& c) const {
    double now = 0, plain = 0;
    const int r = 4;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const double n = static_cast<double>(layers_[i].numel());
      plain += 4 * n;
      switch (c[i]) {
        case Compression::none:
          now += 4 * n;
          break;
        case Compression::fp16:
          now += 2 * n;
          break;
        case Compression::topk:
          now += 0.01 * n * 12;
          break;
        case Compression::powersgd:
          now += layers_[i].shape.size() == 2
                     ? 4.0 * r * static_cast<double>(layers_[i].shape[0] + layers_[i].shape[1])
                     : 2 * n;
          break;
      }
    }
    return plain > 0 ? now / plain : 1;
  }

  LiveAction candidate(int k, const IntervalStats& s) const {
    LiveAction a;
    std::vector<double> elastic(static_cast<std::size_t>(workers_), 1.0 / workers_);
    double total = 0;
    for (double v : s.speed) total += v;
    if (total > 0)
      for (int r = 0; r < workers_; ++r)
        elastic[r] = s.speed[r] > 0 ? s.speed[r] / total : 1.0 / workers_;
    const std::vector<Compression> adaptive = select_compression(layers_, s.grads);
    switch (k) {
      case 0:
        a.shares.assign(static_cast<std::size_t>(workers_), 1.0 / workers_);
        break;
      case 1:
        a.shares = elastic;
        break;
      case 2:
        a.compression = adaptive;
        break;
      default:
        a.shares = elastic;
        a.compression = adaptive;
        break;
    }
    for (double& v : a.shares) v = std::round(v * 1e4) / 1e4;  // fits the bus text
    return a;
  }

  env::Observation observe(const IntervalStats& s, const IntervalStats& prev) const {
    env::Observation o;
    double fastest = 0;
    for (double v : s.speed) fastest = std::max(fastest, v);
    std::vector<double> f;
    for (double v : s.speed) f.push_back(fastest > 0 ? v / fastest : 1);
    double lowest = 1, mean = 0, slow = 0;
    for (double v : f) {
      lowest = std::min(lowest, v);
      mean += v / static_cast<double>(f.size());
      slow += v < 0.9 ? 1.0 / static_cast<double>(f.size()) : 0;
    }
    double var = 0;
    for (double v : f) var += (v - mean) * (v - mean) / static_cast<double>(f.size());
    double prev_fastest = 0, prev_lowest = 1;
    for (double v : prev.speed) prev_fastest = std::max(prev_fastest, v);
    for (double v : prev.speed)
      prev_lowest = std::min(prev_lowest, prev_fastest > 0 ? v / prev_fastest : 1);
    auto& st = o.state;
    st[0] = static_cast<float>(lowest);
    st[1] = static_cast<float>(mean);
    st[2] = static_cast<float>(std::min(1.0, lowest > 0 ? 1.0 / lowest / 10 : 1.0));
    st[3] = static_cast<float>(std::sqrt(var));
    st[4] = static_cast<float>(slow);
    st[5] = st[6] = 1;  // link bandwidth is not measured separately here
    st[8] = static_cast<float>(
        cluster_ ? static_cast<double>(cluster_->controller()->lost_ranks().size()) / workers_ : 0);
    st[9] = static_cast<float>(lowest - prev_lowest);
    st[12] = static_cast<float>(static_cast<double>(s.missing_ranks) / workers_);
    const double current = predicted_step_s(
        s, shares_, bytes_ratio(compression_) / std::max(1e-9, bytes_ratio(compression_)));
    double best = current;
    std::array<double, env::kMaxCandidates> predicted{};
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      const LiveAction a = candidate(k, s);
      const auto& sh = a.shares.empty() ? shares_ : a.shares;
      const auto& co = a.compression.empty() ? compression_ : a.compression;
      predicted[k] =
          predicted_step_s(s, sh, bytes_ratio(co) / std::max(1e-9, bytes_ratio(compression_)));
      best = std::min(best, predicted[k]);
    }
    st[13] = static_cast<float>(current > 0 ? best / current : 1);
    st[14] = st[15] = 1;
    st[16] = static_cast<float>(
        last_migration_ < 0 ? 1.0 : static_cast<double>(interval_ - last_migration_) / horizon_);
    st[17] = static_cast<float>(1.0 - static_cast<double>(interval_) / horizon_);
    st[21] = static_cast<float>(s.step_ms > 0 ? std::min(1.0, s.comm_ms_per_step / s.step_ms) : 0);
    st[23] = 1;
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      float* row = &o.candidates[static_cast<std::size_t>(k * env::kCandidateDim)];
      const double gain = current > 0 && predicted[k] > 0 ? std::log(current / predicted[k]) : 0;
      row[0] = static_cast<float>(std::clamp(gain, -2.0, 2.0));
      // A switch takes effect two steps after the commit; the steps in between run the old plan.
      row[1] =
          static_cast<float>(s.span_s > 0 ? std::min(4.0, 2 * s.step_ms / 1000 / s.span_s) : 0);
      row[2] = 1;
      row[6] = (k == 1 || k == 3) ? 1.0f : 0.0f;
      row[7] = static_cast<float>(std::clamp(gain * (horizon_ - interval_) / 10, -1.0, 1.0));
      o.mask[static_cast<std::size_t>(k)] = 1;
    }
    return o;
  }

  env::EnvId id_;
  int workers_, interval_steps_, horizon_, slow_rank_, delay_rank_, global_batch_, microbatch_;
  double slow_factor_, slow_at_, delay_ms_;
  ModelConfig model_;
  std::string exe_, worker_arg_, log_dir_;
  std::vector<LayerShape> layers_;
  std::unique_ptr<LocalCluster> cluster_;
  int interval_ = 0, last_migration_ = -1;
  std::uint64_t next_step_ = 0;
  IntervalStats last_;
  std::vector<double> shares_;
  std::vector<Compression> compression_;
  std::vector<std::pair<int, std::string>> events_;
};

}  // namespace

void register_live_envs() {
  static std::once_flag once;
  std::call_once(once, [] {
    env::register_env("live", [](const env::EnvId& id) -> std::unique_ptr<env::Env> {
      return std::make_unique<LiveEnv>(id);
    });
  });
}

}  // namespace parapilot::live
