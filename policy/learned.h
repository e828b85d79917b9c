// LearnedPolicy: the greedy policy of a trained actor-critic, over a snapshot of its actor
// (copied into the hand-written FastActor) and the observation normalisation. Made by the PPO
// trainer (its current policy) and by the loader (a checkpoint). Includes libtorch.
#pragma once

#include <string>

#include "policy/features.h"
#include "policy/network.h"
#include "policy/policy.h"

namespace parapilot::policy {

class LearnedPolicy : public Policy {
 public:
  LearnedPolicy(ActorCritic& net, ObservationNormalizer normalizer)
      : actor_(net), normalizer_(std::move(normalizer)) {}
  std::string name() const override { return "rl"; }
  int act(const env::Observation& o) override {
    const auto logits = actor_.logits(normalizer_.normalise(o));
    return greedy_action(logits.data(), env::kNumActions);
  }
  InputReport check_inputs(const env::Observation& o) const override {
    return {normalizer_.clipped(o), normalizer_.outside_training(o)};
  }

 private:
  FastActor actor_;
  ObservationNormalizer normalizer_;
};

}  // namespace parapilot::policy
