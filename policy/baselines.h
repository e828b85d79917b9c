// The baselines: the rules teams use today, behind the Policy interface (policy/policy.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "env/observation.h"
#include "env/sim/scenario.h"
#include "policy/policy.h"
#include "strategy/planner.h"

namespace parapilot::policy {

// static: plan once from the nominal specs, never change (restarts after a crash are the
// env's). uniform-dp: pure data parallel with equal shares, never change. reactive: re-plan
// when the monitor's beliefs change and switch when the predicted gain over a short look-ahead
// pays for the migration by a margin, with hysteresis and a cool-down. threshold (AdaptDL /
// Pollux): switch only when the predicted gain, after the migration cost is amortised over the
// run left, is at least 5%. ski-rental (Greyhound): count the throughput lost since the
// condition began and take the best action whose switch cost that loss has paid for, so cheap
// actions come first and costly ones only once a slowdown has lasted. All of them replace a
// layout believed broken (a lost GPU, out of memory) at once and never act while a switch is
// staged. reactive-tuned: reactive with its parameters chosen on training seeds
// (tuned_reactive_options). docs/policy.md gives their sources. They are registered by name in
// policy/registry.h, which is how the CLI and tests make them from a string.
std::unique_ptr<Policy> make_static();
std::unique_ptr<Policy> make_uniform_dp();

/// The cost of switching to candidate k of `o`, in intervals of the current layout's tokens:
/// its switch_cost feature (the pause plus the staged transfer's slowdown, as the env measures
/// or models them).
double switch_cost_intervals(const env::Observation& o, int k);

// Parameters of the reactive rule.
struct ReactiveOptions {
  double min_gain = 1.05;       // candidate must be predicted >= 5% faster (hysteresis)
  int lookahead_intervals = 6;  // the gain is counted over this many intervals ahead
  double margin = 2.0;          // gain over the look-ahead must exceed this x the switch cost
  int cooldown_intervals = 2;   // intervals to wait after a switch
  // The switch cost is the observation's (switch_cost_intervals).
};
std::unique_ptr<Policy> make_reactive(const ReactiveOptions& options);
/// reactive-tuned: the reactive rule with the min_gain, margin and cool-down that
/// build/benchmarks/policy/tune_rules reactive chose on the training distribution's seeds.
ReactiveOptions tuned_reactive_options();
/// The reactive rule with tuned_reactive_options(), named "reactive-tuned".
std::unique_ptr<Policy> make_reactive_tuned();

// Parameters of the threshold rule.
struct ThresholdOptions {
  double min_amortised_gain = 1.05;  // Pollux's 5%: gain left after paying for the switch
};
std::unique_ptr<Policy> make_threshold(const ThresholdOptions& options);

// Parameters of the ski-rental rule.
struct SkiRentalOptions {
  // A condition holds while the current layout is predicted at least this much slower than the
  // best candidate (1 - current_vs_best); below it, the count starts again.
  double min_shortfall = env::kConditionShortfall;
};
std::unique_ptr<Policy> make_ski_rental(const SkiRentalOptions& options);

// measured-shares: deploy's rule for data-parallel jobs (env/dp/decider.h): switch to the
// candidate with the largest predicted gain once it reaches min_gain and the condition has held
// for confirm_decisions decisions in a row (env::StateFeature::kConditionAge: on a data-parallel
// job, a shortfall shedding work from the same ranks). A broken layout is replaced at once; no
// action while a switch is staged.
struct MeasuredSharesOptions {
  double min_gain = 1.10;
  int confirm_decisions = 2;  // 1..kSwitchMemoryIntervals
};
std::unique_ptr<Policy> make_measured_shares(const MeasuredSharesOptions& options);

}  // namespace parapilot::policy
