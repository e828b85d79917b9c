// The baselines: the rules teams use today, behind the Policy interface (policy/policy.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "env/sim/scenario.h"
#include "policy/policy.h"
#include "strategy/planner.h"

namespace parapilot::policy {

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
  double staging_slowdown = env::kDefaultStagingSlowdown;
  // ...and the switch pause stalls it for this fraction of an interval.
  double pause_fraction = kSwitchPauseS / env::kDefaultIntervalS;
};
std::unique_ptr<Policy> make_reactive(const ReactiveOptions& options);

}  // namespace parapilot::policy
