#include "env/sim/distribution.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

#include "env/sim/planning_view.h"
#include "env/sim/sim_env.h"
#include "core/error.h"

namespace parapilot::env {

namespace {

// The draws of one scenario, from one stream.
class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed ^ 0x9E3779B97F4A7C15ULL) {}
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  // Log-uniform in [lo, hi]: rates and durations spread over orders of magnitude.
  double log_uniform(double lo, double hi) { return std::exp(uniform(std::log(lo), std::log(hi))); }
  bool chance(double p) { return uniform(0, 1) < p; }
  template <class T>
  const T& pick(const std::vector<T>& items) {
    return items[std::uniform_int_distribution<size_t>(0, items.size() - 1)(rng_)];
  }

 private:
  std::mt19937_64 rng_;
};

// GPU generations of the cost model's catalogue (docs/cost-model.md), Volta to Hopper.
const std::vector<std::string> kGpus = {"v100", "a100-40g", "a100-80g", "h800", "h100", "h200"};
const std::vector<std::string> kModels = {"gpt3-1.3b",  "llama2-7b",  "llama3-8b",
                                          "llama2-70b", "llama3-70b", "gpt3-175b"};
// What small jobs (one node) train half the time: models whose switches cost little more than
// the pause, as the live workers' and most single-node PyTorch jobs' do.
const std::vector<std::string> kSmallModels = {"gpt3-125m", "gpt3-350m"};

// Whether the model's weights, gradients and Adam state (16 bytes per parameter) take at most
// half the cluster's memory: a rough fit, so that redraws are rare; the planner decides.
bool plausible(const ModelSpec& model, const ClusterSpec& cluster) {
  double memory_gb = 0;
  for (const NodeGroup& g : cluster.groups) {
    memory_gb += static_cast<double>(g.count) * g.gpus_per_node * g.gpu.memory_gib;
  }
  return 16.0 * static_cast<double>(model.total_params()) / (1 << 30) <= 0.5 * memory_gb;
}

}  // namespace

Scenario draw_scenario(const ScenarioRanges& ranges, uint64_t seed) {
  Draw d(seed);
  // The cluster: whole 8-GPU nodes, log-uniform in count, of one GPU generation or two (a
  // mixed cluster, as in the hetero family); or one small node.
  std::string cluster;
  int gpus = 8;
  const bool small_job = d.chance(ranges.single_node_prob);
  if (small_job) {
    gpus = d.pick(std::vector<int>{2, 4, 8});
    cluster = "1x" + std::to_string(gpus) + "x" + d.pick(kGpus);
  } else {
    const int lo = std::max(1, ranges.gpus_min / 8), hi = std::max(lo, ranges.gpus_max / 8);
    const int nodes = std::clamp(static_cast<int>(std::lround(d.log_uniform(lo, hi))), lo, hi);
    gpus = nodes * 8;
    const std::string a = d.pick(kGpus);
    if (nodes >= 2 && d.chance(0.3)) {
      std::string b = d.pick(kGpus);
      while (b == a) b = d.pick(kGpus);
      const int first = std::clamp(static_cast<int>(std::lround(nodes * d.uniform(0.25, 0.75))),
                                   1, nodes - 1);
      cluster = std::to_string(first) + "x8x" + a + "+" + std::to_string(nodes - first) + "x8x" + b;
    } else {
      cluster = std::to_string(nodes) + "x8x" + a;
    }
  }
  Scenario s = builtin_scenario(Family::kMixed, 8);
  s.name = "random";
  s.horizon = ranges.horizon;
  s.telemetry.exact_beliefs = ranges.exact_beliefs;
  s.cluster = *cluster_preset(cluster);
  // About 256 sequences or more, a whole number per GPU (so that every GPU can run data
  // parallel), as the default batch is on power-of-two clusters.
  s.global_batch = gpus * std::max(d.pick(std::vector<int>{1, 2}), (256 + gpus - 1) / gpus);
  // A thinner network on some clusters (200 Gb/s per node, cloud and Ethernet), as the phase
  // family has: the gradient reduction is exposed there.
  if (gpus > 8 && d.chance(0.25)) {
    for (NodeGroup& g : s.cluster.groups) g.inter_node_Gbps = 25;
  }
  std::vector<std::string> models;
  if (small_job && d.chance(0.5)) {
    models = kSmallModels;
  } else {
    for (const std::string& name : kModels) {
      if (plausible(*model_preset(name), s.cluster)) models.push_back(name);
    }
  }
  s.model = *model_preset(models.empty() ? kModels.front() : d.pick(models));

  // Dynamics (docs/scenarios.md cites each range). Fail-slows: Greyhound saw compute
  // fail-slows on under 2% of nodes, about 10 min on average; ByteDance's are mostly
  // persistent, a slow worker ~2.5x slower; durations from under a minute to ~10 h.
  StragglerDynamics& st = s.straggler;
  st.rate_per_gpu_hour = d.chance(0.2) ? 0.0 : d.log_uniform(0.001, 0.03);
  st.slowdown_min = d.uniform(1.1, 1.5);
  st.slowdown_max = d.uniform(std::max(2.0, st.slowdown_min), 6.0);
  st.transient_fraction = d.uniform(0.1, 0.8);
  st.persistent_median_h = d.log_uniform(0.15, 3.0);
  // Congestion: about 40% of Greyhound's fail-slows, about 24 min on average.
  CongestionDynamics& co = s.congestion;
  co.rate_per_node_hour = gpus <= 8 || d.chance(0.25) ? 0.0 : d.log_uniform(0.003, 0.1);
  co.factor_min = d.uniform(1.5, 3.0);
  co.factor_max = d.uniform(4.0, 10.0);
  co.duration_median_s = d.log_uniform(300, 3600);
  // Failures: from a large fleet's rate (Llama 3: ~1.6e-4 per node-hour) to a troubled one's.
  FailureDynamics& fa = s.failure;
  fa.rate_per_node_hour = d.chance(0.4) ? 0.0 : d.log_uniform(1e-4, 0.02);
  fa.node_fraction = d.uniform(0.1, 0.5);
  fa.repair_median_s = d.log_uniform(1200, 7200);
  // Workload phases: a long-context stage, a batch ramp, gradients that compress better after
  // the learning-rate decay; each in some runs only.
  PhaseDynamics& ph = s.phase;
  ph.seq_len_factor = d.chance(0.25) ? d.pick(std::vector<int>{2, 4}) : 1;
  ph.at_fraction = d.uniform(0.3, 0.9);
  ph.batch_start_fraction = d.chance(0.25) ? d.uniform(0.125, 0.5) : 1.0;
  ph.batch_ramp_fraction = d.uniform(0.1, 0.4);
  ph.compression = d.chance(0.3);
  ph.decay_at_fraction = d.uniform(0.3, 0.7);
  // The search space: the families' (models above 30B may take deeper pipelines), restricted
  // in some jobs to data parallel only (the live workers' and most PyTorch jobs'), with
  // compression only where the gradients are modelled.
  if (s.model.total_params() > 30'000'000'000LL) s.space.pp = {1, 2, 4, 8};
  if (d.chance(small_job ? 0.5 : 0.15)) {
    s.space.tp = {1};
    s.space.pp = {1};
  }
  s.space.compression = ph.compression;
  if (ph.compression) s.space.zero = {0, 1};  // ZeRO-1's all-gather cannot be compressed
  // Telemetry: noise, gaps and samples per interval vary by job and machine.
  s.telemetry.noise = d.uniform(0.02, 0.08);
  s.telemetry.missing_prob = d.uniform(0.0, 0.1);
  s.telemetry.steps_per_interval = d.pick(std::vector<int>{2, 4, 8});
  s.staging_slowdown = d.uniform(0.05, 0.15);
  s.restart_s = d.uniform(300, 1800);
  return s;
}

namespace {

// The running draw's env; its planning view forwards to the draw's (so that a policy made
// before the first reset, as eval makes them, reads the episode it runs).
class DistributionEnv : public Env, private PlanningView {
 public:
  static constexpr uint64_t kMaxRedraws = 64;

  DistributionEnv(const ScenarioRanges& ranges, std::string id)
      : ranges_(ranges), id_(std::move(id)) {}

  std::string id() const override { return id_; }
  int horizon() const override { return ranges_.horizon; }
  double interval_s() const override { return kDefaultIntervalS; }

  StatusOr<Observation> reset(uint64_t seed, const ResetOptions& options) override {
    // Redraws (a function of the seed) until the drawn model fits the drawn cluster.
    Status last;
    for (uint64_t attempt = 0; attempt <= kMaxRedraws; ++attempt) {
      Scenario s = draw_scenario(ranges_, seed + attempt * 0x100000001B3ULL);
      auto made = catch_input_error([&] { return std::make_unique<SimEnv>(std::move(s), id_); });
      if (!made.ok()) {
        last = made.status();
        continue;
      }
      auto first = (*made)->reset(seed, options);
      if (!first.ok()) {
        last = first.status();
        continue;
      }
      inner_ = std::move(*made);
      return first;
    }
    return Status::invalid_argument("env " + id_ + ": no runnable scenario in " +
                                    std::to_string(kMaxRedraws + 1) + " draws from seed " +
                                    std::to_string(seed) + "; the last: " + last.message());
  }
  StepResult step(int action) override { return running().step(action); }
  std::optional<OracleResult> oracle() override {
    return inner_ ? inner_->oracle() : std::nullopt;
  }
  const PlanningView* planning_view() const override { return this; }
  std::vector<std::pair<int, std::string>> events() const override {
    return inner_ ? inner_->events() : std::vector<std::pair<int, std::string>>{};
  }

 private:
  SimEnv& running() const {
    if (!inner_) throw InputError("env " + id_ + ": used before its first reset");
    return *inner_;
  }
  const PlanningView& view() const { return *running().planning_view(); }
  // PlanningView: the running draw's.
  const Scenario& scenario() const override { return view().scenario(); }
  int interval() const override { return view().interval(); }
  std::optional<int> intervals_left() const override { return view().intervals_left(); }
  const Conditions& beliefs() const override { return view().beliefs(); }
  const Strategy& current_layout() const override { return view().current_layout(); }
  const std::vector<Candidate>& candidates() const override { return view().candidates(); }
  double tokens_per_s(const Strategy& s, const Conditions& c) const override {
    return view().tokens_per_s(s, c);
  }

  ScenarioRanges ranges_;
  std::string id_;
  std::unique_ptr<SimEnv> inner_;
};

}  // namespace

std::unique_ptr<Env> make_distribution_env(const ScenarioRanges& ranges, std::string id) {
  return std::make_unique<DistributionEnv>(ranges, std::move(id));
}

}  // namespace parapilot::env
