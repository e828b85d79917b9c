#include "env/template_env.h"

#include "core/error.h"
#include "env/registry.h"

namespace parapilot::env {

BanditEnv::BanditEnv(int horizon, int best, double noise)
    : horizon_(horizon), best_(best), noise_(noise) {}

std::string BanditEnv::id() const {
  return "bandit(horizon=" + std::to_string(horizon_) + ",best=" + std::to_string(best_) + ")";
}

StatusOr<Observation> BanditEnv::reset(uint64_t seed, const ResetOptions& /*options*/) {
  rng_.seed(seed);
  t_ = 0;
  Observation o;
  o.state[0] = 1.0f;  // a constant observation: the best arm never changes
  o.mask.fill(1);
  return o;
}

StepResult BanditEnv::step(int action) {
  StepResult r;
  const int arm = action >= 0 && action < kNumActions ? action : 0;
  r.reward = mean(arm) + std::normal_distribution<double>(0.0, noise_)(rng_);
  r.info.interval = t_;
  r.info.tokens = r.reward;
  r.info.best_tokens = mean(best_);
  r.info.migration_started = arm >= 1;  // as in the simulator, actions 1.. start a switch
  ++t_;
  r.truncated = t_ >= horizon_;
  r.observation.state[0] = 1.0f;
  r.observation.state[1] = static_cast<float>(static_cast<double>(t_) / horizon_);
  r.observation.mask.fill(1);
  return r;
}

std::optional<OracleResult> BanditEnv::oracle() {
  OracleResult o;
  o.tokens_per_interval.assign(horizon_, mean(best_));
  return o;
}

StatusOr<std::unique_ptr<Env>> make_bandit_env(const EnvId& id) {
  return catch_input_error([&]() -> std::unique_ptr<Env> {
    reject_unknown(id, {"horizon", "best"});
    return std::make_unique<BanditEnv>(int_param(id, "horizon", 16, 1, 1 << 20),
                                       int_param(id, "best", 3, 0, kNumActions - 1), 0.1);
  });
}

}  // namespace parapilot::env
