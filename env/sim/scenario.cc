#include "env/sim/scenario.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <random>

#include "core/error.h"
#include "strategy/planner.h"
#include "strategy/space.h"
#include "strategy/spec_io.h"
#include "strategy/toml_reader.h"

namespace parapilot::env {

std::optional<bool> parse_exact_beliefs(const std::string& value) {
  if (value == "monitor") return false;
  if (value == "exact") return true;
  return std::nullopt;
}

const char* to_string(Family family) {
  switch (family) {
    case Family::kHetero:
      return "hetero";
    case Family::kStraggler:
      return "straggler";
    case Family::kCongestion:
      return "congestion";
    case Family::kFailure:
      return "failure";
    case Family::kPhase:
      return "phase";
    case Family::kMixed:
      return "mixed";
    case Family::kFailSlow:
      return "failslow";
  }
  return "?";
}

StatusOr<Family> parse_family(const std::string& name) {
  for (Family f : {Family::kHetero, Family::kStraggler, Family::kCongestion, Family::kFailure,
                   Family::kPhase, Family::kMixed, Family::kFailSlow}) {
    if (name == to_string(f)) return f;
  }
  return Status::invalid_argument("unknown scenario family \"" + name +
                                  "\" (families: hetero, straggler, congestion, failure, phase, "
                                  "mixed, failslow)");
}

namespace {

// The planner's space in the simulator: the layouts a team would consider for a job of this
// size, small enough to re-plan online many times per episode.
SearchSpace default_space() {
  SearchSpace space;
  space.tp = {1, 2, 4, 8};
  space.pp = {1, 2, 4};
  space.cp = {1};  // the simulated jobs' sequences are short: no context parallelism
  space.microbatch_size = {1, 2};
  space.recompute = {Recompute::kSelective};
  space.zero = {1};
  space.sp = {true};
  space.schedule = {Schedule::k1F1B};
  // Compressed layouts are offered only where the scenario models gradient statistics.
  space.compression = true;
  return space;
}

std::string mixed_cluster(int gpus) {
  const int nodes = std::max(2, gpus / 8);
  return std::to_string(nodes / 2) + "x8xa100-80g+" + std::to_string(nodes - nodes / 2) + "x8xh800";
}

}  // namespace

StatusOr<FailSlowTiming> failslow_timing(const Scenario& s) {
  const Planner planner(s.model, s.cluster, PlannerOptions{s.switch_pause_s});
  PlanRequest request;
  request.space = s.space;
  request.space.global_batch = final_global_batch(s);
  request.top_k = 1;
  PlanResult nominal;
  if (Status st = catch_input_error([&] { nominal = planner.plan(request); }); !st.ok()) return st;
  if (nominal.candidates.empty()) {
    return Status::invalid_argument("scenario " + s.name +
                                    ": no layout of its space fits this model on this cluster");
  }
  const Candidate& best = nominal.candidates.front();
  FailSlowTiming out;
  out.step_s = best.cost.iteration_time_s;
  double state_gib = 0;
  for (int p = 0; p < best.strategy.pp; ++p) {
    const MemoryBreakdown m = planner.cost_model().memory(best.strategy, 0, p);
    state_gib = std::max(state_gib, m.weights_gib + m.gradients_gib + m.optimizer_gib);
  }
  out.state_bytes = state_gib * (1ull << 30);
  out.interval_s = kFailSlowStepsPerInterval * out.step_s;
  out.switch_pause_s = kLivePauseFixedS + out.state_bytes / (kHostToDeviceGBps * 1e9);
  return out;
}

namespace {

// Sets the failslow family's interval, steps per interval and switch pause for the scenario's
// model and cluster (failslow_timing).
void fit_failslow_timing(Scenario& s) {
  const FailSlowTiming t = take(failslow_timing(s));
  s.interval_s = t.interval_s;
  s.telemetry.steps_per_interval = kFailSlowStepsPerInterval;
  s.switch_pause_s = t.switch_pause_s;
}

// The [scenario.failslow] table into `d`.
void read_failslow(TableReader& t, FailSlowDynamics& d) {
  auto kind = [&](const char* prefix, const char* rate_key, FailSlowKind& k) {
    const std::string p = prefix;
    if (auto v = t.get_double(rate_key, 0, 100)) k.rate = *v;
    if (auto v = t.get_double(p + "_factor_min", 1, 1000)) k.factor_min = *v;
    if (auto v = t.get_double(p + "_factor_max", 1, 1000)) k.factor_max = *v;
    if (auto v = t.get_double(p + "_mean_s", 1, 1e7)) k.mean_s = *v;
    if (auto v = t.get_double(p + "_sigma", 0, 5)) k.sigma = *v;
    if (k.factor_max < k.factor_min) t.fail(p + "_factor_max", "must be >= " + p + "_factor_min");
  };
  kind("comm", "comm_rate_per_node_hour", d.communication);
  kind("compute", "compute_rate_per_gpu_hour", d.compute);
  if (auto v = t.get_double("flap_fraction", 0, 1)) d.flap_fraction = *v;
  if (auto v = t.get_int("flap_intervals_min", 1, 1000)) {
    d.flap_intervals_min = static_cast<int>(*v);
  }
  if (auto v = t.get_int("flap_intervals_max", 1, 1000)) {
    d.flap_intervals_max = static_cast<int>(*v);
  }
  if (d.flap_intervals_max < d.flap_intervals_min)
    t.fail("flap_intervals_max", "must be >= flap_intervals_min");
}

}  // namespace

Scenario builtin_scenario(Family family, int gpus) {
  if (gpus < 8 || gpus % 8 != 0) {
    throw InputError("scenario gpus = " + std::to_string(gpus) + ": must be a multiple of 8, >= 8");
  }
  Scenario s;
  s.family = family;
  s.name = to_string(family);
  s.model = *model_preset("llama2-7b");
  const bool mixed_gpus = family == Family::kHetero || family == Family::kMixed;
  s.cluster =
      *cluster_preset(mixed_gpus ? mixed_cluster(gpus) : std::to_string(gpus / 8) + "x8xa100-80g");
  s.space = default_space();
  // Families switch off the dynamics they do not model.
  if (family != Family::kStraggler && family != Family::kMixed) s.straggler.rate_per_gpu_hour = 0;
  if (family != Family::kCongestion && family != Family::kMixed) {
    s.congestion.rate_per_node_hour = 0;
  }
  if (family != Family::kFailure && family != Family::kMixed) s.failure.rate_per_node_hour = 0;
  if (family != Family::kPhase && family != Family::kMixed) {
    s.phase.seq_len_factor = 1;
    s.phase.batch_start_fraction = 1;
    s.phase.compression = false;
  }
  if (family == Family::kPhase) {
    // A thinner network (200 Gb/s per node, as on many cloud and Ethernet clusters): the
    // gradient reduction is exposed, so how well gradients compress matters.
    for (NodeGroup& g : s.cluster.groups) g.inter_node_Gbps = 25;
  }
  if (s.phase.compression) {
    // ZeRO-1's parameter all-gather cannot be compressed; a plain all-reduce can.
    s.space.zero = {0, 1};
  }
  if (family == Family::kCongestion) s.congestion.rate_per_node_hour = 0.08;
  if (family == Family::kFailure) s.failure.rate_per_node_hour = 0.03;
  if (family == Family::kFailSlow) {
    // Raised from production rates (Greyhound: 16 of 27 jobs of 512+ GPUs hit over their runs)
    // so that every episode sees a few: about 2 communication and 1.3 compute fail-slows an
    // hour on 64 GPUs.
    s.failslow.communication.rate = 0.25;
    s.failslow.compute.rate = 0.02;
    s.horizon = 180;  // an hour of llama2-7b's 18 s intervals
    fit_failslow_timing(s);
  }
  return s;
}

StatusOr<Scenario> load_scenario(const std::string& path) {
  return catch_input_error([&]() -> Scenario {
  const toml::table root = parse_toml_file(path);
  const toml::node* node = root.get("scenario");
  if (!node || !node->as_table()) throw InputError(path + ": no [scenario] table in this file");
  TableReader r(*node->as_table(), path, "scenario");
  const auto family_name =
      r.get_choice("family",
                   {"hetero", "straggler", "congestion", "failure", "phase", "mixed", "failslow"});
  if (!family_name) r.fail("family", "missing (required)");
  // The size: `gpus` builds the family's cluster of 8-GPU nodes; a `cluster` (preset or spec
  // file) gives its own, of any size, and `gpus`, when also given, must agree with it.
  const auto gpus_value = r.get_int("gpus", 1, 1 << 16);
  // A model or cluster file named by a relative path lies beside the scenario file.
  auto beside = [&](const std::string& value) {
    if (!looks_like_path(value) || std::filesystem::path(value).is_absolute()) return value;
    return (std::filesystem::path(path).parent_path() / value).string();
  };
  const auto cluster_name = r.get_string("cluster");
  std::optional<ClusterSpec> cluster;
  if (cluster_name) cluster = take(load_cluster(beside(*cluster_name)));
  if (cluster && gpus_value && *gpus_value != cluster->num_gpus())
    r.fail("gpus", "is " + std::to_string(*gpus_value) + " but the cluster has " +
                       std::to_string(cluster->num_gpus()) + " GPUs");
  const int gpus = static_cast<int>(gpus_value.value_or(64));
  if (!cluster && gpus % 8 != 0) r.fail("gpus", "must be a multiple of 8 (or give a cluster)");
  Scenario s = builtin_scenario(take(parse_family(*family_name)), cluster ? 8 : gpus);
  if (cluster) s.cluster = *cluster;
  s.name = r.get_string("name").value_or(s.name);
  const auto model_name = r.get_string("model");
  if (model_name) s.model = take(load_model(beside(*model_name)));
  if (auto v = r.get_int("horizon", 1, 1 << 20)) s.horizon = static_cast<int>(*v);
  const auto interval_s = r.get_double("interval_s", 1, 1e6);
  if (interval_s) s.interval_s = *interval_s;
  if (auto v = r.get_int("global_batch", 1, 1 << 24)) s.global_batch = static_cast<int>(*v);
  if (auto v = r.get_double("restart_s", 0, 1e6)) s.restart_s = *v;
  if (auto v = r.get_double("staging_slowdown", 0, 0.9)) s.staging_slowdown = *v;
  const auto switch_pause_s = r.get_double("switch_pause_s", 0, 1e5);
  if (switch_pause_s) s.switch_pause_s = *switch_pause_s;

  auto sub = [&](const char* name, auto&& read) {
    if (const toml::node* n = r.get_node(name)) {
      if (!n->as_table()) r.fail(name, "must be a table");
      TableReader t(*n->as_table(), path, std::string("scenario.") + name);
      read(t);
      t.reject_unknown();
    }
  };
  bool steps_given = false;
  sub("telemetry", [&](TableReader& t) {
    if (auto v = t.get_double("noise", 0, 1)) s.telemetry.noise = *v;
    if (auto v = t.get_int("delay_intervals", 1, 100))
      s.telemetry.delay_intervals = static_cast<int>(*v);
    if (auto v = t.get_double("missing_prob", 0, 0.99)) s.telemetry.missing_prob = *v;
    if (auto v = t.get_int("steps_per_interval", 1, 64))
      s.telemetry.steps_per_interval = static_cast<int>(*v);
    steps_given = t.get_node("steps_per_interval") != nullptr;
    if (auto v = t.get_string("beliefs")) {
      const std::optional<bool> exact = parse_exact_beliefs(*v);
      if (!exact) t.fail("beliefs", "must be \"monitor\" or \"exact\"");
      s.telemetry.exact_beliefs = *exact;
    }
  });
  sub("straggler", [&](TableReader& t) {
    auto& d = s.straggler;
    if (auto v = t.get_double("rate_per_gpu_hour", 0, 100)) d.rate_per_gpu_hour = *v;
    if (auto v = t.get_double("slowdown_min", 1, 100)) d.slowdown_min = *v;
    if (auto v = t.get_double("slowdown_max", 1, 100)) d.slowdown_max = *v;
    if (auto v = t.get_double("transient_fraction", 0, 1)) d.transient_fraction = *v;
    if (auto v = t.get_double("transient_s_min", 0, 1e6)) d.transient_s_min = *v;
    if (auto v = t.get_double("transient_s_max", 0, 1e6)) d.transient_s_max = *v;
    if (auto v = t.get_double("persistent_median_h", 0, 1e4)) d.persistent_median_h = *v;
    if (auto v = t.get_double("persistent_sigma", 0, 10)) d.persistent_sigma = *v;
    if (d.slowdown_max < d.slowdown_min) t.fail("slowdown_max", "must be >= slowdown_min");
    if (d.transient_s_max < d.transient_s_min)
      t.fail("transient_s_max", "must be >= transient_s_min");
  });
  sub("congestion", [&](TableReader& t) {
    auto& d = s.congestion;
    if (auto v = t.get_double("rate_per_node_hour", 0, 100)) d.rate_per_node_hour = *v;
    if (auto v = t.get_double("factor_min", 1, 1000)) d.factor_min = *v;
    if (auto v = t.get_double("factor_max", 1, 1000)) d.factor_max = *v;
    if (auto v = t.get_double("duration_median_s", 0, 1e7)) d.duration_median_s = *v;
    if (auto v = t.get_double("duration_sigma", 0, 10)) d.duration_sigma = *v;
    if (d.factor_max < d.factor_min) t.fail("factor_max", "must be >= factor_min");
  });
  sub("failure", [&](TableReader& t) {
    auto& d = s.failure;
    if (auto v = t.get_double("rate_per_node_hour", 0, 100)) d.rate_per_node_hour = *v;
    if (auto v = t.get_double("node_fraction", 0, 1)) d.node_fraction = *v;
    if (auto v = t.get_double("repair_median_s", 0, 1e7)) d.repair_median_s = *v;
    if (auto v = t.get_double("repair_sigma", 0, 10)) d.repair_sigma = *v;
  });
  sub("failslow", [&](TableReader& t) { read_failslow(t, s.failslow); });
  sub("phase", [&](TableReader& t) {
    auto& d = s.phase;
    if (auto v = t.get_double("at_fraction", 0, 1)) d.at_fraction = *v;
    if (auto v = t.get_int("seq_len_factor", 1, 64)) d.seq_len_factor = static_cast<int>(*v);
    if (auto v = t.get_double("batch_start_fraction", 1e-6, 1)) d.batch_start_fraction = *v;
    if (auto v = t.get_double("batch_ramp_fraction", 0, 1)) d.batch_ramp_fraction = *v;
    if (auto v = t.get_int("batch_ramp_steps", 1, 1024)) d.batch_ramp_steps = static_cast<int>(*v);
    if (auto v = t.get_bool("compression")) d.compression = *v;
    if (auto v = t.get_double("decay_at_fraction", 0, 1)) d.decay_at_fraction = *v;
    if (auto v = t.get_double("topk_ratio", 1e-6, 0.5)) d.topk_ratio = *v;
    if (auto v = t.get_int("powersgd_rank", 1, 1024)) d.powersgd_rank = static_cast<int>(*v);
    if (auto v = t.get_double("topk_error_before", 0, 1)) d.topk_error_before = *v;
    if (auto v = t.get_double("topk_error_after", 0, 1)) d.topk_error_after = *v;
    if (auto v = t.get_double("powersgd_error_before", 0, 1)) d.powersgd_error_before = *v;
    if (auto v = t.get_double("powersgd_error_after", 0, 1)) d.powersgd_error_after = *v;
    if (auto v = t.get_double("error_budget", 0, 1)) d.error_budget = *v;
    if (auto v = t.get_double("convergence_penalty", 0, 100)) d.convergence_penalty = *v;
    if (d.compression && d.error_budget < GradientStats{}.fp16_error) {
      t.fail("error_budget", "must be >= fp16's rounding error (4.9e-4) when compression is on");
    }
  });
  r.reject_unknown();
  s.space.zero = s.phase.compression ? std::vector<int>{0, 1} : std::vector<int>{1};
  // A [space] table in the same file restricts what the planner may choose (docs/planner.md).
  if (root.get("space")) s.space = take(load_search_space(path, s.model));
  // The failslow family times its decisions and switches by the file's model, cluster, batch
  // and space; what the file sets itself stays.
  if (s.family == Family::kFailSlow &&
      (cluster || model_name || s.global_batch > 0 || root.get("space"))) {
    const int steps = s.telemetry.steps_per_interval;
    fit_failslow_timing(s);
    if (interval_s) s.interval_s = *interval_s;
    if (switch_pause_s) s.switch_pause_s = *switch_pause_s;
    if (steps_given) s.telemetry.steps_per_interval = steps;
  }
  return s;
  });
}

StagedInterval stage_switch(double& staging_left_s, double remaining_s, double pause_s) {
  StagedInterval out;
  out.staged_s = std::min(staging_left_s, remaining_s);
  staging_left_s -= out.staged_s;
  remaining_s -= out.staged_s;
  if (staging_left_s <= 0 && remaining_s > 0) {
    out.pause_left_s = std::max(0.0, pause_s - remaining_s);
    remaining_s -= std::min(pause_s, remaining_s);
    out.committed = true;
  }
  out.rest_s = remaining_s;
  return out;
}

double run_pause(double& pause_left_s, double remaining_s) {
  const double paused = std::min(pause_left_s, remaining_s);
  pause_left_s -= paused;
  return remaining_s - paused;
}

int final_global_batch(const Scenario& s) {
  return s.global_batch > 0 ? s.global_batch : default_global_batch(s.cluster.num_gpus());
}

double compression_error(const Compression& c, const GradientStats& g, int layer) {
  switch (c.kind) {
    case Compression::Kind::kNone:
      return 0.0;
    case Compression::Kind::kFP16:
      return g.fp16_error;
    case Compression::Kind::kTopK: {
      if (g.topk_energy.empty()) return 1.0;  // unmeasured: assume nothing is kept
      const double kept = std::clamp(g.topk_energy[layer], 1e-12, 1.0);
      if (c.topk_ratio >= 1) return 0.0;
      if (g.topk_ratio <= 0 || g.topk_ratio >= 1 || c.topk_ratio <= 0) return 1.0 - kept;
      // kept(r) = r^alpha through the measured (topk_ratio, kept) point.
      return 1.0 - std::pow(kept, std::log(c.topk_ratio) / std::log(g.topk_ratio));
    }
    case Compression::Kind::kPowerSGD: {
      if (g.lowrank_residual.empty()) return 1.0;
      const double rank = std::max(c.powersgd_rank, 1);
      return std::min(1.0, g.lowrank_residual[layer] * g.powersgd_rank / rank);
    }
  }
  return 1.0;
}

double convergence_efficiency(const Strategy& s, int layers, const GradientStats& g,
                              double penalty) {
  if (layers <= 0) return 1.0;
  if (s.compression_overrides.empty() && s.compression.kind == Compression::Kind::kNone) {
    return 1.0;
  }
  double excess = 0;
  for (int l = 0; l < layers; ++l) {
    excess += std::max(0.0, compression_error(s.compression_of_layer(l), g, l) - g.error_budget);
  }
  return std::max(0.0, 1.0 - penalty * excess / layers);
}

void add_slowdown(std::vector<double>& extra, double interval_s, double start_s, double end_s,
                  double factor_minus_one) {
  const int first = static_cast<int>(start_s / interval_s);
  for (int i = std::max(first, 0); i < static_cast<int>(extra.size()); ++i) {
    const double lo = std::max(start_s, i * interval_s);
    const double hi = std::min(end_s, (i + 1) * interval_s);
    if (hi <= lo) break;
    extra[i] += factor_minus_one * (hi - lo) / interval_s;
  }
}

namespace {

double lognormal(double median, double sigma, std::mt19937_64& rng) {
  return median * std::exp(sigma * std::normal_distribution<double>(0, 1)(rng));
}

double uniform01(std::mt19937_64& rng) { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }

}  // namespace

SlowdownDraw draw_slowdown(const StragglerDynamics& d, std::mt19937_64& rng) {
  SlowdownDraw out;
  out.factor = d.slowdown_min + uniform01(rng) * (d.slowdown_max - d.slowdown_min);
  out.transient = uniform01(rng) < d.transient_fraction;
  out.duration_s =
      out.transient
          ? d.transient_s_min + uniform01(rng) * (d.transient_s_max - d.transient_s_min)
          : std::min(lognormal(d.persistent_median_h * 3600, d.persistent_sigma, rng),
                     kMaxPersistentSlowdownS);
  return out;
}

CongestionDraw draw_congestion(const CongestionDynamics& d, std::mt19937_64& rng) {
  CongestionDraw out;
  out.factor = d.factor_min + uniform01(rng) * (d.factor_max - d.factor_min);
  out.duration_s = lognormal(d.duration_median_s, d.duration_sigma, rng);
  return out;
}

FailSlowDraw draw_failslow(const FailSlowKind& k, double flap_fraction, std::mt19937_64& rng) {
  FailSlowDraw out;
  out.factor = k.factor_min + uniform01(rng) * (k.factor_max - k.factor_min);
  const double median_s = k.mean_s * std::exp(-0.5 * k.sigma * k.sigma);
  out.duration_s = std::min(lognormal(median_s, k.sigma, rng), kMaxPersistentSlowdownS);
  out.flapping = uniform01(rng) < flap_fraction;
  return out;
}

void add_failslow(std::vector<double>& extra, double interval_s, double start_s,
                  const FailSlowDraw& draw, const FailSlowDynamics& d, std::mt19937_64& rng) {
  const double end_s = start_s + draw.duration_s;
  if (!draw.flapping) {
    add_slowdown(extra, interval_s, start_s, end_s, draw.factor - 1);
    return;
  }
  const double window_s = static_cast<double>(extra.size()) * interval_s;
  std::uniform_int_distribution<int> phase(d.flap_intervals_min, d.flap_intervals_max);
  bool slow = true;
  for (double at = start_s; at < end_s && at < window_s; slow = !slow) {
    const double next = std::min(end_s, at + phase(rng) * interval_s);
    if (slow) add_slowdown(extra, interval_s, at, next, draw.factor - 1);
    at = next;
  }
}

double draw_repair_s(const FailureDynamics& d, std::mt19937_64& rng) {
  return lognormal(d.repair_median_s, d.repair_sigma, rng);
}

namespace {

// The scenario's workload phases into `truth` (no randomness): a global-batch ramp, the
// gradient regimes before and after the learning-rate decay, a long-context stage; each
// change is an event at its interval.
void add_workload_phases(const Scenario& s, int gpus, Truth& truth) {
  const int H = s.horizon;
  char text[160];
  // Phase: a global-batch ramp over the first part of the run.
  const int final_batch = final_global_batch(s);
  truth.global_batch.assign(H, final_batch);
  if (s.phase.batch_start_fraction < 1) {
    const int steps = s.phase.batch_ramp_steps;
    const int start = std::min(
        final_batch,
        std::max(gpus, static_cast<int>(s.phase.batch_start_fraction * final_batch) / gpus * gpus));
    const int ramp_end =
        std::clamp(static_cast<int>(std::lround(s.phase.batch_ramp_fraction * H)), 0, H);
    int previous = 0;
    for (int k = 0; k <= steps && start < final_batch; ++k) {
      const int from = k == 0 ? 0 : static_cast<int>(static_cast<int64_t>(ramp_end) * k / steps);
      const int batch = k == steps
                            ? final_batch
                            : std::clamp((start + (final_batch - start) * k / steps) / gpus * gpus,
                                         start, final_batch);
      for (int i = from; i < H; ++i) truth.global_batch[i] = batch;
      if (batch != previous && from < H) {
        std::snprintf(text, sizeof text, "global batch %d", batch);
        truth.events.emplace_back(from, text);
      }
      previous = batch;
    }
  }
  // Phase: gradients compress better after the learning-rate decay.
  if (s.phase.compression) {
    const int layers = s.model.layers;
    auto regime = [&](double topk_error, double powersgd_error) {
      GradientStats g;
      g.topk_ratio = s.phase.topk_ratio;
      g.topk_energy.assign(layers, 1.0 - topk_error);
      g.powersgd_rank = s.phase.powersgd_rank;
      g.lowrank_residual.assign(layers, powersgd_error);
      g.error_budget = s.phase.error_budget;
      return g;
    };
    truth.gradient_regimes = {regime(s.phase.topk_error_before, s.phase.powersgd_error_before),
                              regime(s.phase.topk_error_after, s.phase.powersgd_error_after)};
    const int decay = std::clamp(static_cast<int>(s.phase.decay_at_fraction * H), 0, H);
    truth.gradient_regime.assign(H, 0);
    for (int i = decay; i < H; ++i) truth.gradient_regime[i] = 1;
    if (decay < H) {
      std::snprintf(text, sizeof text,
                    "learning-rate decay: top-k error %.2f -> %.2f, PowerSGD %.2f -> %.2f",
                    s.phase.topk_error_before, s.phase.topk_error_after,
                    s.phase.powersgd_error_before, s.phase.powersgd_error_after);
      truth.events.emplace_back(decay, text);
    }
  }
  // Phase: a long-context stage multiplies the sequence length.
  if (s.phase.seq_len_factor > 1) {
    const int at = std::clamp(static_cast<int>(s.phase.at_fraction * H), 0, H);
    for (int i = at; i < H; ++i) truth.seq_len[i] = s.model.seq_len * s.phase.seq_len_factor;
    std::snprintf(text, sizeof text, "sequence length x%d", s.phase.seq_len_factor);
    if (at < H) truth.events.emplace_back(at, text);
  }
}

// The scenario's fail-slows into `gpu_extra` (compute) and `node_extra` (communication), as
// add_slowdown lays them out, with one event each at its onset. Draws nothing when both rates
// are 0. Per event: its place, its start, draw_failslow, then a flapping one's phases.
void add_failslows(const Scenario& s, const ClusterTopology& topo, std::mt19937_64& rng,
                   std::vector<std::vector<double>>& gpu_extra,
                   std::vector<std::vector<double>>& node_extra, Truth& truth) {
  const FailSlowDynamics& d = s.failslow;
  const int H = s.horizon;
  const double run_s = H * s.interval_s;
  const double run_h = run_s / 3600.0;
  char text[160];
  for (const bool communication : {true, false}) {
    const FailSlowKind& kind = communication ? d.communication : d.compute;
    const int places = communication ? topo.num_nodes() : topo.num_gpus();
    const double mean = kind.rate * places * run_h;
    const int events = mean > 0 ? std::poisson_distribution<int>(mean)(rng) : 0;
    for (int e = 0; e < events; ++e) {
      const int place = static_cast<int>(uniform01(rng) * places) % places;
      const double start = uniform01(rng) * run_s;
      const FailSlowDraw draw = draw_failslow(kind, d.flap_fraction, rng);
      std::vector<double>& extra = communication ? node_extra[place] : gpu_extra[place];
      if (extra.empty()) extra.assign(H, 0.0);
      add_failslow(extra, s.interval_s, start, draw, d, rng);
      std::snprintf(text, sizeof text, "%s %d %s%.1f for %.1f min%s",
                    communication ? "node" : "GPU", place,
                    communication ? "network /" : "compute x", draw.factor,
                    draw.duration_s / 60, draw.flapping ? ", flapping" : "");
      truth.events.emplace_back(static_cast<int>(start / s.interval_s), text);
    }
  }
}

}  // namespace

Truth generate_truth(const Scenario& s, uint64_t seed) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ULL + 0x5851F42D4C957F2DULL);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const int H = s.horizon;
  const double run_s = H * s.interval_s;
  const double run_h = run_s / 3600.0;
  const ClusterTopology topo(s.cluster);
  const int gpus = topo.num_gpus();
  const int nodes = topo.num_nodes();

  Truth truth;
  truth.conditions.assign(H, Conditions{});
  truth.seq_len.assign(H, s.model.seq_len);

  auto poisson = [&](double mean) {
    return mean > 0 ? static_cast<int>(std::poisson_distribution<int>(mean)(rng)) : 0;
  };
  char text[160];

  // Stragglers: per-GPU slowdowns, transient or persistent (heavy-tailed durations).
  std::vector<std::vector<double>> gpu_extra(gpus);
  const int slow_events = poisson(s.straggler.rate_per_gpu_hour * gpus * run_h);
  for (int e = 0; e < slow_events; ++e) {
    const int gpu = static_cast<int>(uniform(rng) * gpus) % gpus;
    const double start = uniform(rng) * run_s;
    const SlowdownDraw slow = draw_slowdown(s.straggler, rng);
    const double factor = slow.factor;
    const bool transient = slow.transient;
    const double duration = slow.duration_s;
    if (gpu_extra[gpu].empty()) gpu_extra[gpu].assign(H, 0.0);
    add_slowdown(gpu_extra[gpu], s.interval_s, start, start + duration, factor - 1);
    if (!transient) {
      std::snprintf(text, sizeof text, "GPU %d %.1fx slower for %.1f h", gpu, factor,
                    duration / 3600);
      truth.events.emplace_back(static_cast<int>(start / s.interval_s), text);
    }
  }
  // Congestion: a node's network bandwidth divided by 2-10x for a while.
  std::vector<std::vector<double>> node_extra(nodes);
  const int congestion_events = poisson(s.congestion.rate_per_node_hour * nodes * run_h);
  for (int e = 0; e < congestion_events; ++e) {
    const int node = static_cast<int>(uniform(rng) * nodes) % nodes;
    const double start = uniform(rng) * run_s;
    const CongestionDraw congestion = draw_congestion(s.congestion, rng);
    const double factor = congestion.factor;
    const double duration = congestion.duration_s;
    if (node_extra[node].empty()) node_extra[node].assign(H, 0.0);
    add_slowdown(node_extra[node], s.interval_s, start, start + duration, factor - 1);
    std::snprintf(text, sizeof text, "node %d network /%.1f for %.0f min", node, factor,
                  duration / 60);
    truth.events.emplace_back(static_cast<int>(start / s.interval_s), text);
  }
  // Failures: a GPU or a whole node is lost, then repaired.
  std::vector<std::vector<bool>> failed(H);
  const int failure_events = poisson(s.failure.rate_per_node_hour * nodes * run_h);
  for (int e = 0; e < failure_events; ++e) {
    const int node = static_cast<int>(uniform(rng) * nodes) % nodes;
    const bool whole_node = uniform(rng) < s.failure.node_fraction;
    const int first_gpu = topo.nodes[node].first_gpu;
    const int count = topo.nodes[node].gpus;
    const int gpu = first_gpu + static_cast<int>(uniform(rng) * count) % count;
    const double start = uniform(rng) * run_s;
    const double end = start + draw_repair_s(s.failure, rng);
    for (int i = static_cast<int>(start / s.interval_s); i < H && i * s.interval_s < end; ++i) {
      if (failed[i].empty()) failed[i].assign(gpus, false);
      if (whole_node) {
        for (int g = first_gpu; g < first_gpu + count; ++g) failed[i][g] = true;
      } else {
        failed[i][gpu] = true;
      }
    }
    if (whole_node)
      std::snprintf(text, sizeof text, "node %d lost for %.0f min", node, (end - start) / 60);
    else
      std::snprintf(text, sizeof text, "GPU %d lost for %.0f min", gpu, (end - start) / 60);
    truth.events.emplace_back(static_cast<int>(start / s.interval_s), text);
  }
  add_failslows(s, topo, rng, gpu_extra, node_extra, truth);
  add_workload_phases(s, gpus, truth);

  for (int i = 0; i < H; ++i) {
    Conditions& c = truth.conditions[i];
    for (int g = 0; g < gpus; ++g) {
      if (gpu_extra[g].empty() || gpu_extra[g][i] == 0) continue;
      if (c.gpu_speed.empty()) c.gpu_speed.assign(gpus, 1.0);
      c.gpu_speed[g] = 1.0 / (1.0 + gpu_extra[g][i]);
    }
    for (int n = 0; n < nodes; ++n) {
      if (node_extra[n].empty() || node_extra[n][i] == 0) continue;
      if (c.node_inter_bw.empty()) c.node_inter_bw.assign(nodes, 1.0);
      c.node_inter_bw[n] = 1.0 / (1.0 + node_extra[n][i]);
    }
    if (!failed[i].empty()) c.gpu_failed = failed[i];
  }
  std::sort(truth.events.begin(), truth.events.end());
  return truth;
}

}  // namespace parapilot::env
