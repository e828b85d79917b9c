// PlanningView: what a policy that plans ahead may read of a simulated job at a decision
// (Env::planning_view()), beyond its observation: what the agent knows now, the scenario's
// dynamics to sample futures from (env/sim/futures.h) and the cost model to price a layout
// under sampled conditions. Nothing here reads the env's hidden truth or its future: the
// conditions come from the monitor's beliefs, the workload is the one the job runs now.
//
// A view belongs to its env and shows its current episode; read it between reset/step calls,
// from the env's thread.
#pragma once

#include <optional>
#include <vector>

#include "env/sim/scenario.h"
#include "strategy/planner.h"

namespace parapilot::env {

class PlanningView {
 public:
  virtual ~PlanningView() = default;

  /// The scenario: its stochastic dynamics (straggler, congestion and failure rates and
  /// distributions), the telemetry delay, the interval length, restart and staging costs. Its
  /// horizon is the env's; the job knows its length only when intervals_left() says so.
  virtual const Scenario& scenario() const = 0;
  /// Decision intervals since the episode's start: the interval about to run.
  virtual int interval() const = 0;
  /// Intervals of the run left, the one about to run included, when the job declared its
  /// length (the observation's run_left); nullopt when the length is unknown.
  virtual std::optional<int> intervals_left() const = 0;
  /// What the monitor believes now (empty vectors: nominal).
  virtual const Conditions& beliefs() const = 0;
  /// The running layout.
  virtual const Strategy& current_layout() const = 0;
  /// The observation's candidates in its order: action k switches to candidates()[k - 1],
  /// whose migration_s is what that switch stages and pauses for.
  virtual const std::vector<Candidate>& candidates() const = 0;
  /// Tokens per second that would count for layout `s` under conditions `c` at the workload
  /// the job runs now (its sequence length and global batch, the gradient statistics the
  /// monitor has measured): the cost model's throughput times the convergence efficiency of
  /// its compression, as the simulator counts them; 0 when it cannot run (a lost GPU, out of
  /// memory, a batch it cannot split).
  virtual double tokens_per_s(const Strategy& s, const Conditions& c) const = 0;
};

}  // namespace parapilot::env
