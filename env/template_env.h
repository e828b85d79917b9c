// BanditEnv: the smallest complete Env, and the template to copy when adding one
// (docs/adding-an-env.md). Each episode is `horizon` pulls of kNumActions arms; arm a pays
// means[a] plus Gaussian noise. The optimum is known, so learners can be tested against it.
//
// Registered as "bandit", e.g. "bandit(horizon=16,best=3)". Not thread-safe; deterministic
// for its seed.
#pragma once

#include <random>

#include "env/env.h"
#include "env/registry.h"

namespace parapilot::env {

class BanditEnv : public Env {
 public:
  // best: the arm with the highest mean; noise: standard deviation of each reward.
  BanditEnv(int horizon, int best, double noise);

  std::string id() const override;
  int horizon() const override { return horizon_; }
  double interval_s() const override { return 1.0; }
  StatusOr<Observation> reset(uint64_t seed, const ResetOptions& options = {}) override;
  StepResult step(int action) override;
  std::optional<OracleResult> oracle() override;

  double mean(int arm) const { return arm == best_ ? 1.0 : 0.2 + 0.1 * arm; }

 private:
  int horizon_;
  int best_;
  double noise_;
  int t_ = 0;
  std::mt19937_64 rng_;
};

// The "bandit" factory the registry holds: parameters horizon (16) and best (3).
// kInvalidArgument naming a bad parameter.
StatusOr<std::unique_ptr<Env>> make_bandit_env(const EnvId& id);

}  // namespace parapilot::env
