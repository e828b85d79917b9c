// lookahead: a Monte-Carlo look-ahead over sampled futures, after Parcae (NSDI'24). At each
// decision it samples K futures of the next H intervals from the scenario's own dynamics given
// what the monitor believes now (env/sim/futures.h), prices keeping the layout and switching to
// each candidate in every future the way the simulator charges them (staging at the scenario's
// slowdown, then the switch pause; a lost GPU crashes a layout, which restarts on the best of
// them), and takes the one with the most expected tokens when it beats keeping by min_gain.
// Workload changes (a batch ramp, a long-context stage, the learning-rate decay) are not
// forecast: the job does not announce them, so every future runs the present workload.
//
// It is causal: it reads the observation and the env's planning view (env/sim/planning_view.h),
// never the env's truth. It needs an env with dynamics to sample from; it is a reference, not a
// rule a deployed agent runs, and costs K x H cost-model evaluations per layout and decision.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "env/env.h"
#include "policy/policy.h"
#include "policy/registry.h"

namespace parapilot::policy {

struct LookaheadOptions {
  int futures = 32;    ///< K: futures sampled per decision (>= 1)
  int intervals = 12;  ///< H: intervals each future spans (>= 1), fewer when the run has fewer left
  /// Switch only when the best switch's expected tokens are at least this x keeping's: the
  /// monitor's beliefs are noisy, and without a margin the policy chases predicted gains of 1-3%
  /// (shares rebalanced off GPUs believed a little slow). 1.02 was the best of 1, 1.02 and 1.05
  /// on training seeds (10 episodes each of phase, mixed and straggler from 2^40).
  double min_gain = 1.02;
  uint64_t seed = 1;   ///< the decision at interval t samples from a stream keyed by (seed, t)
  /// Whose dynamics the futures follow. false ("own"): the scenario's own, the distributions
  /// that generated the episode (the simulator's privilege: a real job does not know them).
  /// true ("family"): the built-in dynamics of the scenario's family (docs/scenarios.md), the
  /// prior a rule could assume without knowing the job.
  bool family_dynamics = false;
};

/// The lookahead policy on `env`, which must outlive it (the policy reads env.planning_view()
/// at every decision). kInvalidArgument naming the env when it has no planning view (a trace
/// replay, a live job: no dynamics to sample futures from) or when an option is out of range.
StatusOr<std::unique_ptr<Policy>> make_lookahead(const env::Env& env,
                                                 const LookaheadOptions& options);

/// The options of a checked "lookahead(k=K,h=H,min_gain=G,seed=S,dynamics=own|family)" id
/// (policy/registry.h, which declares the keys, their defaults and ranges).
/// Precondition: args.info().name == "lookahead".
LookaheadOptions lookahead_options(const PolicyArgs& args);

}  // namespace parapilot::policy
