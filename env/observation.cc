#include "env/observation.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace parapilot::env {

namespace {
double at(const std::vector<double>& v, int i) { return v.empty() ? 1.0 : v[i]; }
}  // namespace

std::vector<Candidate> select_candidates(const PlanResult& result, const Strategy& current) {
  std::vector<Candidate> out;
  for (const Candidate& c : result.candidates) {
    if (c.strategy == current) continue;
    if (static_cast<int>(out.size()) == kMaxCandidates) break;
    out.push_back(c);
  }
  return out;
}

bool beliefs_moved(const Conditions& now, const Conditions& at_plan, int gpus, int nodes) {
  if (now.gpu_failed != at_plan.gpu_failed) {
    // Empty and all-false mean the same.
    const bool a =
        std::find(now.gpu_failed.begin(), now.gpu_failed.end(), true) != now.gpu_failed.end();
    const bool b = std::find(at_plan.gpu_failed.begin(), at_plan.gpu_failed.end(), true) !=
                   at_plan.gpu_failed.end();
    if (a || b) return true;
  }
  for (int i = 0; i < gpus; ++i) {
    if (std::abs(std::log(at(now.gpu_speed, i) / at(at_plan.gpu_speed, i))) > 0.15) return true;
  }
  for (int i = 0; i < nodes; ++i) {
    if (std::abs(std::log(at(now.node_inter_bw, i) / at(at_plan.node_inter_bw, i))) > 0.2) {
      return true;
    }
  }
  return false;
}

const char* feature_name(StateFeature f) {
  static constexpr const char* kNames[] = {"min_speed", "mean_speed", "worst_slowdown", "speed_std", "slowed_fraction", "min_bandwidth", "mean_bandwidth", "congested_fraction", "failed_fraction", "min_speed_trend", "min_bandwidth_trend", "telemetry_age", "missing_fraction", "current_vs_best", "current_feasible", "current_fits", "since_last_switch", "run_left", "staging", "staging_left", "bubble_fraction", "exposed_dp_fraction", "seq_len_log", "candidates", "condition_age", "condition_loss"};
  return kNames[static_cast<int>(f)];
}

const char* feature_name(CandidateFeature f) {
  static constexpr const char* kNames[] = {"log_gain", "migration_time", "memory_headroom", "tp_differs", "pp_differs", "dp_differs", "elastic", "payback", "amortised_gain", "switch_cost"};
  return kNames[static_cast<int>(f)];
}

FeatureRange feature_range(StateFeature f) {
  // Speeds and bandwidths are at most 1.5; their trends the difference of two such values;
  // run_left is -1 when unknown; seq_len_log covers a sequence 16x shorter to 16x longer.
  static constexpr FeatureRange kRanges[] = {
      {0, 1.5f}, {0, 1.5f}, {0, 1},     {0, 1}, {0, 1},  {0, 1.5f}, {0, 1.5f}, {0, 1},
      {0, 1},    {-1.5f, 1.5f}, {-1.5f, 1.5f}, {0, 1}, {0, 1}, {0, 1}, {0, 1}, {0, 1},
      {0, 1},    {-1, 1},   {0, 1},     {0, 1}, {0, 1},  {0, 1},    {-1, 1},   {0, 1},
      {0, 1},    {0, 1}};
  static_assert(std::size(kRanges) == kStateDim);
  return kRanges[static_cast<int>(f)];
}

FeatureRange feature_range(CandidateFeature f) {
  static constexpr FeatureRange kRanges[] = {{-2, 2}, {0, 4}, {0, 1},  {0, 1},  {0, 1},
                                             {0, 1},  {0, 1}, {-1, 1}, {-1, 1}, {0, 4}};
  static_assert(std::size(kRanges) == kCandidateDim);
  return kRanges[static_cast<int>(f)];
}

FeatureRange input_range(int input) {
  if (input >= kStateDim) return feature_range(static_cast<CandidateFeature>(input - kStateDim));
  return feature_range(static_cast<StateFeature>(input));
}

std::string input_name(int input) {
  if (input >= 0 && input < kStateDim) return feature_name(static_cast<StateFeature>(input));
  if (input >= kStateDim && input < kStateDim + kCandidateDim) {
    return std::string("candidate.") + feature_name(static_cast<CandidateFeature>(input - kStateDim));
  }
  return "?";
}

Observation build_observation(const ObservationInputs& in) {
  Observation o;
  const Conditions& belief = *in.beliefs;
  const int gpus = in.gpus;
  const int nodes = in.nodes;
  double min_speed = 1.5, sum = 0, sum2 = 0, slowed = 0;
  for (int i = 0; i < gpus; ++i) {
    const double v = at(belief.gpu_speed, i);
    min_speed = std::min(min_speed, v);
    sum += v;
    sum2 += v * v;
    slowed += v < 0.9;
  }
  const double mean = sum / gpus;
  double min_bw = 1.5, bw_sum = 0, congested = 0;
  for (int i = 0; i < nodes; ++i) {
    const double v = at(belief.node_inter_bw, i);
    min_bw = std::min(min_bw, v);
    bw_sum += v;
    congested += v < 0.8;
  }
  double failed = 0;
  for (bool f : belief.gpu_failed) failed += f;
  const int H = in.horizon;
  feature(o, StateFeature::kMinSpeed) = static_cast<float>(min_speed);
  feature(o, StateFeature::kMeanSpeed) = static_cast<float>(mean);
  feature(o, StateFeature::kWorstSlowdown) = static_cast<float>(std::min(1.0 / std::max(min_speed, 1e-3), 10.0) / 10.0);
  feature(o, StateFeature::kSpeedStd) = static_cast<float>(std::sqrt(std::max(0.0, sum2 / gpus - mean * mean)));
  feature(o, StateFeature::kSlowedFraction) = static_cast<float>(slowed / gpus);
  feature(o, StateFeature::kMinBandwidth) = static_cast<float>(min_bw);
  feature(o, StateFeature::kMeanBandwidth) = static_cast<float>(bw_sum / nodes);
  feature(o, StateFeature::kCongestedFraction) = static_cast<float>(congested / nodes);
  feature(o, StateFeature::kFailedFraction) = static_cast<float>(failed / gpus);
  feature(o, StateFeature::kMinSpeedTrend) = static_cast<float>(min_speed - in.previous_min_speed);
  feature(o, StateFeature::kMinBandwidthTrend) = static_cast<float>(min_bw - in.previous_min_bw);
  feature(o, StateFeature::kTelemetryAge) = static_cast<float>(std::min(in.telemetry_age_intervals, 4) / 4.0);
  feature(o, StateFeature::kMissingFraction) = static_cast<float>(in.missing_fraction);
  const CostBreakdown* cur = in.current_cost ? &*in.current_cost : nullptr;
  const bool cur_ok = cur && cur->feasible && cur->fits_in_memory;
  const std::vector<Candidate>& candidates = *in.candidates;
  const double best_pred = candidates.empty() ? 0.0 : candidates.front().cost.tokens_per_s;
  const double cur_pred = cur_ok ? cur->tokens_per_s : 0.0;
  feature(o, StateFeature::kCurrentVsBest) = static_cast<float>(
      std::max(best_pred, cur_pred) > 0 ? cur_pred / std::max(best_pred, cur_pred) : 1.0);
  feature(o, StateFeature::kCurrentFeasible) = cur && cur->feasible ? 1.0f : 0.0f;
  feature(o, StateFeature::kCurrentFits) = cur && cur->fits_in_memory ? 1.0f : 0.0f;
  // Recent switches matter, old ones do not: intervals since the last, saturating at
  // kSwitchMemoryIntervals (a job that never switched reads as one that switched long ago, a
  // state training sees often, rather than a rare 1 on the horizon's scale).
  feature(o, StateFeature::kSinceLastSwitch) = static_cast<float>(
      in.last_migration < 0 ? 1.0
                            : std::min(1.0, (in.interval - in.last_migration) /
                                                static_cast<double>(kSwitchMemoryIntervals)));
  feature(o, StateFeature::kRunLeft) =
      in.remaining_intervals < 0 ? -1.0f : static_cast<float>(in.remaining_intervals / H);
  feature(o, StateFeature::kStaging) = in.staging ? 1.0f : 0.0f;
  feature(o, StateFeature::kStagingLeft) = static_cast<float>(in.staging ? std::min(1.0, in.staging_left_s / in.interval_s) : 0.0);
  feature(o, StateFeature::kBubbleFraction) = static_cast<float>(cur_ok ? cur->bubble_s / cur->iteration_time_s : 0.0);
  feature(o, StateFeature::kExposedDpFraction) = static_cast<float>(cur_ok ? cur->dp_comm_s / cur->iteration_time_s : 0.0);
  feature(o, StateFeature::kSeqLenLog) =
      static_cast<float>(std::clamp(std::log2(in.seq_len_ratio) / 4.0, -1.0, 1.0));
  feature(o, StateFeature::kCandidates) = static_cast<float>(candidates.size()) / kMaxCandidates;

  // Payback over the run left; over half the horizon when the run's length is unknown.
  const double remaining_s =
      (in.remaining_intervals < 0 ? H / 2.0 : in.remaining_intervals) * in.interval_s;
  const Strategy& current = *in.current;
  for (size_t k = 0; k < candidates.size() && k < static_cast<size_t>(kMaxCandidates); ++k) {
    const Candidate& c = candidates[k];
    const double gain = cur_pred > 0 ? c.cost.tokens_per_s / cur_pred : 10.0;
    feature(o, static_cast<int>(k), CandidateFeature::kLogGain) = static_cast<float>(std::clamp(std::log(gain), -2.0, 2.0));
    feature(o, static_cast<int>(k), CandidateFeature::kMigrationTime) = static_cast<float>(std::min(c.migration_s / in.interval_s, 4.0));
    feature(o, static_cast<int>(k), CandidateFeature::kMemoryHeadroom) = static_cast<float>(1.0 - c.cost.memory_gib / std::max(c.cost.memory_capacity_gib, 1e-9));
    feature(o, static_cast<int>(k), CandidateFeature::kTpDiffers) = c.strategy.tp != current.tp ? 1.0f : 0.0f;
    feature(o, static_cast<int>(k), CandidateFeature::kPpDiffers) = c.strategy.pp != current.pp ? 1.0f : 0.0f;
    feature(o, static_cast<int>(k), CandidateFeature::kDpDiffers) = c.strategy.dp != current.dp ? 1.0f : 0.0f;
    feature(o, static_cast<int>(k), CandidateFeature::kElastic) = c.strategy.dp_shares.empty() ? 0.0f : 1.0f;
    const double gained = (c.cost.tokens_per_s - cur_pred) * remaining_s;
    const double lost = std::max(cur_pred, c.cost.tokens_per_s) *
                            (in.switch_pause_s + in.staging_slowdown * c.migration_s) +
                        1.0;
    feature(o, static_cast<int>(k), CandidateFeature::kPayback) = static_cast<float>(std::clamp(gained / lost, -10.0, 10.0) / 10.0);
    // The relative gain left over the run left after paying for the switch: over R of the
    // current layout's tokens the switch leaves gain * (R - L), L the tokens lost switching.
    const double left = remaining_s * cur_pred;
    feature(o, static_cast<int>(k), CandidateFeature::kAmortisedGain) = static_cast<float>(
        left > 0 ? std::clamp((c.cost.tokens_per_s * remaining_s - lost) / left - 1.0, -1.0, 1.0)
                 : 0.0);
    // What the switch costs, in intervals of the current layout's throughput: the pause plus
    // the staged transfer's slowdown (the rules' switch cost; capped as migration_time is).
    feature(o, static_cast<int>(k), CandidateFeature::kSwitchCost) = static_cast<float>(std::min(
        in.switch_pause_s / in.interval_s +
            in.staging_slowdown * std::min(c.migration_s / in.interval_s, 4.0),
        4.0));
    o.mask[k] = 1;
  }
  return o;
}

void ObservationHistory::annotate(Observation& o) {
  const double shortfall = 1.0 - static_cast<double>(feature(o, StateFeature::kCurrentVsBest));
  const bool broken = feature(o, StateFeature::kCurrentFeasible) < 0.5f ||
                      feature(o, StateFeature::kCurrentFits) < 0.5f;
  if (broken || shortfall >= kConditionShortfall) {
    ++age_;
    loss_ += std::clamp(shortfall, 0.0, 1.0);
  } else {
    age_ = 0;
    loss_ = 0;
  }
  feature(o, StateFeature::kConditionAge) =
      static_cast<float>(std::min(1.0, age_ / static_cast<double>(kSwitchMemoryIntervals)));
  feature(o, StateFeature::kConditionLoss) =
      static_cast<float>(std::min(1.0, loss_ / kConditionLossIntervals));
}

}  // namespace parapilot::env
