// The policy's observation (docs/observation.md), built from beliefs, the current layout and
// the planner's candidates. The simulator and the deploy agent both build it here, so a policy
// trained in the simulator acts on a deployed job unchanged. Also the shared candidate
// selection and re-plan thresholds.
//
// Pure functions; safe from any thread.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "env/env.h"
#include "env/sim/scenario.h"
#include "strategy/planner.h"

namespace parapilot::env {

/// The state vector's features by name (docs/observation.md lists them, by index and name;
/// a test holds the two together). Values are their indices into Observation::state.
enum class StateFeature : int {
  kMinSpeed,  ///< 0
  kMeanSpeed,  ///< 1
  kWorstSlowdown,  ///< 2
  kSpeedStd,  ///< 3
  kSlowedFraction,  ///< 4
  kMinBandwidth,  ///< 5
  kMeanBandwidth,  ///< 6
  kCongestedFraction,  ///< 7
  kFailedFraction,  ///< 8
  kMinSpeedTrend,  ///< 9
  kMinBandwidthTrend,  ///< 10
  kTelemetryAge,  ///< 11
  kMissingFraction,  ///< 12
  kCurrentVsBest,  ///< 13
  kCurrentFeasible,  ///< 14
  kCurrentFits,  ///< 15
  kSinceLastSwitch,  ///< 16
  kRunLeft,  ///< 17
  kStaging,  ///< 18
  kStagingLeft,  ///< 19
  kBubbleFraction,  ///< 20
  kExposedDpFraction,  ///< 21
  kSeqLenLog,  ///< 22
  kCandidates,  ///< 23
  kConditionAge,  ///< 24 (ObservationHistory)
  kConditionLoss,  ///< 25 (ObservationHistory)
  kCount
};
static_assert(static_cast<int>(StateFeature::kCount) == kStateDim);

/// One candidate row's features by name; indices into a row of Observation::candidates.
enum class CandidateFeature : int {
  kLogGain,  ///< 0
  kMigrationTime,  ///< 1
  kMemoryHeadroom,  ///< 2
  kTpDiffers,  ///< 3
  kPpDiffers,  ///< 4
  kDpDiffers,  ///< 5
  kElastic,  ///< 6
  kPayback,  ///< 7
  kAmortisedGain,  ///< 8
  kSwitchCost,  ///< 9
  kCount
};
static_assert(static_cast<int>(CandidateFeature::kCount) == kCandidateDim);

/// The snake_case name of a feature, as docs/observation.md writes it.
const char* feature_name(StateFeature f);
const char* feature_name(CandidateFeature f);
/// An input by flat index: a StateFeature's name below kStateDim, "candidate.NAME" for
/// kStateDim + a CandidateFeature.
std::string input_name(int input);

/// The values a feature can take by construction: build_observation yields every feature inside
/// [lo, hi] for any inputs (beliefs' speeds and bandwidths in [0.01, 1.5], as the monitor
/// reports them), and docs/observation.md lists these ranges (a test holds the three together).
/// The policy's normaliser never clips a value inside its feature's range.
struct FeatureRange {
  float lo = 0, hi = 1;
};
FeatureRange feature_range(StateFeature f);
FeatureRange feature_range(CandidateFeature f);
/// By flat index, as input_name.
FeatureRange input_range(int input);

inline float& feature(Observation& o, StateFeature f) { return o.state[static_cast<int>(f)]; }
inline float feature(const Observation& o, StateFeature f) {
  return o.state[static_cast<int>(f)];
}
/// Candidate k's (0-based) feature f.
inline float& feature(Observation& o, int k, CandidateFeature f) {
  return o.candidates[k * kCandidateDim + static_cast<int>(f)];
}
inline float feature(const Observation& o, int k, CandidateFeature f) {
  return o.candidates[k * kCandidateDim + static_cast<int>(f)];
}

/// since_last_switch and condition_age saturate after this many intervals.
inline constexpr int kSwitchMemoryIntervals = 8;

/// A condition holds while the current layout is predicted at least this far behind the best
/// candidate (1 - current_vs_best): the monitor's noise floor (it reads speeds within 5% of
/// nominal as nominal). condition_age and condition_loss count it; the ski-rental rule too.
inline constexpr double kConditionShortfall = 0.05;

/// condition_loss saturates at this many intervals of lost throughput.
inline constexpr double kConditionLossIntervals = 4;

/// ObservationInputs::remaining_intervals when the run's planned length is unknown.
inline constexpr double kUnknownRemaining = -1;

/// Everything one observation is made of. Pointers must be non-null.
struct ObservationInputs {
  const Conditions* beliefs = nullptr;  ///< the monitor's beliefs (empty vectors: nominal).
  int gpus = 0;
  int nodes = 0;
  double previous_min_speed = 1;  ///< lowest believed speed at the previous decision.
  double previous_min_bw = 1;     ///< lowest believed node bandwidth at the previous decision.
  int telemetry_age_intervals = 0;
  double missing_fraction = 0;
  const Strategy* current = nullptr;
  std::optional<CostBreakdown> current_cost;           ///< the current layout under `beliefs`.
  const std::vector<Candidate>* candidates = nullptr;  ///< <= kMaxCandidates, current excluded.
  int interval = 0;                                    ///< decision intervals so far (t).
  int horizon = 96;                                    ///< H: normalises time features.
  /// Intervals of the run left (H - t in the simulator); kUnknownRemaining when the run's
  /// length is unknown (run_left reads -1).
  double remaining_intervals = 96;
  int last_migration = -1;          ///< interval of the last committed switch; -1 when none.
  bool staging = false;
  double staging_left_s = 0;
  double interval_s = kDefaultIntervalS;
  double seq_len_ratio = 1;  ///< current sequence length / the run's start.
  double staging_slowdown = kDefaultStagingSlowdown;
  /// The pause a switch costs at its boundary, on top of its staging (payback and
  /// amortised_gain charge it): the planner's fixed pause for a layout switch, about one step
  /// for a share change.
  double switch_pause_s = kSwitchPauseS;
};

/// The features only the past can give, for build_observation's caller to add: condition_age
/// (intervals the current condition has lasted, this one included, ÷ kSwitchMemoryIntervals,
/// at most 1; 0 without a condition) and condition_loss (the throughput it has cost so far,
/// the sum over its intervals of 1 - current_vs_best, ÷ kConditionLossIntervals, at most 1).
/// The simulator and the deploy decider keep one per episode or job and pass it every
/// observation in order, so a blip reads differently from a persistent change.
class ObservationHistory {
 public:
  void reset() { *this = ObservationHistory(); }
  /// Folds `o` into the history and writes its history features.
  void annotate(Observation& o);

 private:
  int age_ = 0;
  double loss_ = 0;
};

/// Every feature but the history's (which read 0 until ObservationHistory::annotate).
Observation build_observation(const ObservationInputs& in);

/// The planner's candidates minus the current layout, at most kMaxCandidates, best first.
std::vector<Candidate> select_candidates(const PlanResult& result, const Strategy& current);

/// True when beliefs moved enough since the last plan to re-plan (the simulator's thresholds:
/// 15% for a GPU's speed, 20% for a node's bandwidth, or a change of the failed set).
bool beliefs_moved(const Conditions& now, const Conditions& at_plan, int gpus, int nodes);

}  // namespace parapilot::env
