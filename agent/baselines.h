// Policies: what decides, each interval, whether to keep the layout or switch to one of the
// planner's candidates. The baselines are the rules teams use today; the learned policy
// (policy/) implements the same interface. The hindsight oracle is not a policy: it needs the
// future, so envs that can see it provide Env::oracle().
//
// A Policy holds per-episode state (begin_episode() clears it); use one per env, not shared
// between threads.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "env/env.h"

namespace parapilot::agent {

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string name() const = 0;
  // How the env should start an episode for this policy.
  virtual env::ResetOptions reset_options() const { return {}; }
  virtual void begin_episode() {}
  // Returns 0 (keep) or k in 1..kMaxCandidates (switch to candidate k-1).
  virtual int act(const env::Observation& observation) = 0;
};

// static: plan once from the nominal specs, never change (restarts after a crash are the
// env's). uniform-dp: pure data parallel with equal shares, never change. reactive: re-plan
// when the monitor's beliefs change and switch when the predicted gain over the rest of the
// run pays for the migration by a margin, with hysteresis and a cool-down.
std::unique_ptr<Policy> make_baseline(const std::string& name);
std::vector<std::string> baseline_names();

// Parameters of the reactive rule.
struct ReactiveOptions {
  double min_gain = 1.05;       // candidate must be predicted >= 5% faster (hysteresis)
  int lookahead_intervals = 6;  // the gain is counted over this many intervals ahead
  double margin = 2.0;          // gain over the look-ahead must exceed this x the switch cost
  int cooldown_intervals = 2;   // intervals to wait after a switch
  // The switch cost the rule assumes, as a fraction of an interval's tokens: the staged
  // transfer slows training by this fraction of the migration time...
  double staging_slowdown = 0.1;
  // ...and the switch pause stalls it for this fraction of an interval.
  double pause_fraction = 2.0 / 300.0;
};
std::unique_ptr<Policy> make_reactive(const ReactiveOptions& options);

}  // namespace parapilot::agent
