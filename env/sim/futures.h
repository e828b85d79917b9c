// Futures of a scenario sampled from what is believed now: the conditions of the next intervals
// if the conditions believed now run their course and new ones start per the scenario's
// dynamics (env/sim/scenario.h). What a look-ahead policy plans over (policy/lookahead.h).
//
// A future is drawn from the scenario's distributions, the beliefs and how long each believed
// condition has lasted; nothing else. Pure functions; deterministic for the generator's state.
#pragma once

#include <random>
#include <vector>

#include "env/sim/scenario.h"
#include "strategy/cost_model.h"

namespace parapilot::env {

/// How long each condition believed now has lasted, in seconds, as far as the beliefs show
/// it (0 for a GPU or node believed nominal). Vectors are per GPU and per node; empty: every
/// condition has just begun.
struct ConditionAges {
  std::vector<double> gpu_slow_s;        ///< GPUs believed slower than nominal
  std::vector<double> node_congested_s;  ///< nodes believed below nominal bandwidth
  std::vector<double> gpu_failed_s;      ///< GPUs believed lost
};

/// Conditions of `intervals` intervals from now (entry 0 is the interval about to run), one draw:
///  * a GPU believed slowed keeps its believed speed until the rest of its slowdown is over,
///    drawn from the straggler dynamics given that it has lasted its age (transient or
///    persistent by how likely each is to have lasted that long); a congested node likewise
///    from the congestion dynamics; a lost GPU returns after the rest of a repair time given its
///    age (the GPUs of a node lost at the same time return together); where the scenario has
///    no stragglers (congestion) but compute (communication) fail-slows, the rest is drawn from
///    the fail-slow kind's duration given its age, and a flapping one stays slow;
///  * new slowdowns, congestions, failures and fail-slows start at the scenario's rates, drawn
///    as generate_truth draws them, uniformly over the window;
///  * a slowdown or congestion believed where the scenario's rate of them is zero is the
///    monitor's noise (no such condition can occur): read as nominal;
///  * slowdowns show per interval as generate_truth's do (add_slowdown), NVLink bandwidth stays
///    as believed.
/// Nominal vectors are empty, as in the monitor's beliefs. Precondition: intervals >= 1;
/// beliefs and ages have the scenario's GPU and node counts or are empty.
std::vector<Conditions> sample_future(const Scenario& scenario, const Conditions& beliefs,
                                      const ConditionAges& ages, int intervals,
                                      std::mt19937_64& rng);

}  // namespace parapilot::env
