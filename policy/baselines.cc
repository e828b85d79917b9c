#include "policy/baselines.h"

#include <cmath>

#include "env/observation.h"
#include "strategy/error.h"

namespace parapilot::policy {

namespace {

class StaticPolicy : public Policy {
 public:
  std::string name() const override { return "static"; }
  int act(const env::Observation&) override { return 0; }
};

class UniformDpPolicy : public Policy {
 public:
  std::string name() const override { return "uniform-dp"; }
  env::ResetOptions reset_options() const override {
    env::ResetOptions o;
    o.initial_layout = "uniform-dp";
    return o;
  }
  int act(const env::Observation&) override { return 0; }
};

class ReactivePolicy : public Policy {
 public:
  explicit ReactivePolicy(ReactiveOptions options) : options_(options) {}
  std::string name() const override { return "reactive"; }
  void begin_episode() override { since_switch_ = options_.cooldown_intervals; }

  int act(const env::Observation& o) override {
    ++since_switch_;
    const bool staging = feature(o, env::StateFeature::kStaging) > 0.5f;
    if (staging) return 0;
    // A layout the monitor believes broken is replaced at once with the best candidate.
    const bool broken = feature(o, env::StateFeature::kCurrentFeasible) < 0.5f ||
                        feature(o, env::StateFeature::kCurrentFits) < 0.5f;
    int best = 0;
    double best_gain = 0;
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      if (!o.mask[k]) continue;
      const double gain =
          std::exp(static_cast<double>(feature(o, k, env::CandidateFeature::kLogGain)));
      // Tokens gained over the look-ahead and lost while switching, in intervals of the
      // current layout's tokens.
      const double gained = (gain - 1.0) * options_.lookahead_intervals;
      const double lost =
          options_.pause_fraction +
          options_.staging_slowdown *
              static_cast<double>(feature(o, k, env::CandidateFeature::kMigrationTime));
      const bool worth = broken || (gain >= options_.min_gain && gained >= options_.margin * lost &&
                                    since_switch_ >= options_.cooldown_intervals);
      if (worth && gain > best_gain) {
        best_gain = gain;
        best = k + 1;
      }
    }
    if (best != 0) since_switch_ = 0;
    return best;
  }

 private:
  ReactiveOptions options_;
  int since_switch_ = 0;
};

}  // namespace

std::unique_ptr<Policy> make_reactive(const ReactiveOptions& options) {
  return std::make_unique<ReactivePolicy>(options);
}

std::unique_ptr<Policy> make_baseline(const std::string& name) {
  if (name == "static") return std::make_unique<StaticPolicy>();
  if (name == "uniform-dp") return std::make_unique<UniformDpPolicy>();
  if (name == "reactive") return make_reactive({});
  throw InputError("unknown policy \"" + name + "\" (baselines: static, reactive, uniform-dp; "
                   "and oracle)");
}

std::vector<std::string> baseline_names() { return {"static", "reactive", "uniform-dp"}; }

}  // namespace parapilot::policy
