// Feature encoding of observations for the learned policy: the schema version of what the
// network reads, and running observation normalisation.
//
// The network reads env::Observation as it is (docs/observation.md), normalised feature by
// feature with running statistics gathered during training and saved with the policy. The
// statistics are plain doubles (no libtorch), so they serialise exactly and update
// deterministically. Not thread-safe; normalise() is const and may be called concurrently.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "env/env.h"

namespace parapilot::policy {

// Bumped whenever the meaning or layout of the observation the network reads changes; a
// checkpoint with another version is refused.
inline constexpr uint32_t kFeatureSchemaVersion = 2;

// Running mean and variance per dimension (parallel Welford / Chan et al.).
struct RunningStats {
  std::vector<double> mean, m2;  // m2: sum of squared deviations
  double count = 0;

  explicit RunningStats(int dims = 0) : mean(dims, 0.0), m2(dims, 0.0) {}
  int dims() const { return static_cast<int>(mean.size()); }
  // Adds one sample of dims() values.
  void add(const float* values);
  double stddev(int i) const;
};

// Normalises the state vector and each present candidate's features: (x - mean) / std, clipped
// to ±clip. Missing candidates stay all zero (the mask says they are missing).
class ObservationNormalizer {
 public:
  static constexpr double kClip = 5.0;

  ObservationNormalizer() : state_(env::kStateDim), candidate_(env::kCandidateDim) {}

  // Folds an observation into the statistics (candidates only where present).
  void update(const env::Observation& o);
  env::Observation normalise(const env::Observation& o) const;
  /// The features of `o` whose normalised value reaches ±kClip (Policy::clipped_inputs).
  std::vector<int> clipped(const env::Observation& o) const;

  const RunningStats& state_stats() const { return state_; }
  const RunningStats& candidate_stats() const { return candidate_; }
  RunningStats& state_stats() { return state_; }
  RunningStats& candidate_stats() { return candidate_; }

 private:
  RunningStats state_, candidate_;
};

}  // namespace parapilot::policy
