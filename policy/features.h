// Feature encoding of observations for the learned policy: the schema version of what the
// network reads, and running observation normalisation.
//
// The network reads env::Observation as it is (docs/observation.md), normalised feature by
// feature with running statistics gathered during training and saved with the policy, together
// with the range of values training produced. The statistics are plain doubles (no libtorch),
// so they serialise exactly and update deterministically. Not thread-safe; the const members
// may be called concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "env/env.h"

namespace parapilot::policy {

// Bumped whenever the meaning or layout of the observation the network reads changes; a
// checkpoint with another version is refused.
inline constexpr uint32_t kFeatureSchemaVersion = 5;

// Running mean, variance and range per dimension (Welford).
struct RunningStats {
  std::vector<double> mean, m2;  // m2: sum of squared deviations
  std::vector<double> min, max;  // the smallest and largest value added
  double count = 0;

  explicit RunningStats(int dims = 0)
      : mean(dims, 0.0), m2(dims, 0.0), min(dims, 0.0), max(dims, 0.0) {}
  int dims() const { return static_cast<int>(mean.size()); }
  // Adds one sample of dims() values.
  void add(const float* values);
  double stddev(int i) const;
};

// Normalises the state vector and each present candidate's features: (x - mean) / s, clipped to
// ±kClip, where s is the standard deviation, raised where needed so that every value of the
// feature's range (env::feature_range) maps within ±kRangeZ, inside the clip: a rare but
// legitimate value (a failure, a straggler's onset) keeps its magnitude instead of saturating,
// and only a value outside its feature's range can reach the clip. Missing candidates stay all
// zero (the mask says they are missing).
class ObservationNormalizer {
 public:
  static constexpr double kClip = 5.0;
  static constexpr double kRangeZ = 4.0;
  /// How far past training's range an input may lie before outside_training() names it, as a
  /// fraction of the feature's range (env::feature_range): noise, not a new regime.
  static constexpr double kRangeSlack = 0.02;

  ObservationNormalizer() : state_(env::kStateDim), candidate_(env::kCandidateDim) {}

  // Folds an observation into the statistics (candidates only where present).
  void update(const env::Observation& o);
  env::Observation normalise(const env::Observation& o) const;
  /// The features of `o` whose normalised value reaches ±kClip (InputReport::clipped), by
  /// flat input index (env::input_name); each feature at most once.
  std::vector<int> clipped(const env::Observation& o) const;
  /// The features of `o` outside the range training produced, widened by kRangeSlack
  /// (InputReport::unseen); empty before any statistics exist.
  std::vector<int> outside_training(const env::Observation& o) const;

  const RunningStats& state_stats() const { return state_; }
  const RunningStats& candidate_stats() const { return candidate_; }
  RunningStats& state_stats() { return state_; }
  RunningStats& candidate_stats() { return candidate_; }

 private:
  RunningStats state_, candidate_;
};

}  // namespace parapilot::policy
