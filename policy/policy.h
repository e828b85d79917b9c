// Policy: what decides, each interval, whether to keep the layout or switch to one of the
// planner's candidates. The baselines (policy/baselines.h) are the rules teams use today; the
// learned policy (policy/loader.h) implements the same interface. The hindsight oracle is not a
// policy: it needs the future, so envs that can see it provide Env::oracle().
//
// A Policy holds per-episode state (begin_episode() clears it); use one per env, not shared
// between threads.
#pragma once

#include <string>
#include <vector>

#include "env/env.h"

namespace parapilot::policy {

/// The inputs of an observation a policy cannot read as training taught it, by flat input index:
/// StateFeature indices, and kStateDim + a CandidateFeature index for a candidate's feature (once
/// per feature, whichever candidates); env::input_name names them.
struct InputReport {
  /// Normalised value at the clip (ObservationNormalizer::kClip): read, but saturated.
  std::vector<int> clipped;
  /// Outside the range training produced (ObservationNormalizer::outside_training).
  std::vector<int> unseen;
};

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string name() const = 0;
  // How the env should start an episode for this policy.
  virtual env::ResetOptions reset_options() const { return {}; }
  virtual void begin_episode() {}
  // Returns 0 (keep) or k in 1..kMaxCandidates (switch to candidate k-1).
  virtual int act(const env::Observation& observation) = 0;
  /// The inputs of `observation` a learned policy reads at its clip or never saw in training.
  /// Rules read every input as it is: empty.
  virtual InputReport check_inputs(const env::Observation&) const { return {}; }
};

}  // namespace parapilot::policy
