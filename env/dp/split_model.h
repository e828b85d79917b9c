// SplitModel: what a learned job's decider (env/dp/decider.h) knows of the one knob it moves —
// a split of `total()` units over the job's ranks, each rank at least one unit, in rank order —
// and the model that predicts the step a split gives, from the job's own telemetry. Two models
// stand behind the one decision core: a data-parallel job's batch shares (samples of the global
// batch per rank, env/dp/shares_model.h) and a pipeline job's stage split (contiguous blocks
// per stage, env/pp/pipeline_model.h). The core owns everything else: the observation, the
// guardrail, the verification and the revert.
//
// Call order, per decision: fit() once, then any of the const members (which read what fit()
// learned). Thread-safety: not thread-safe; owned by one decider.
#pragma once

#include <string>
#include <vector>

#include "env/monitor/monitor.h"
#include "strategy/strategy.h"

namespace parapilot::env::dp {

/// printf-style text of a reason or evidence (at most 319 bytes; longer text is cut).
__attribute__((format(printf, 1, 2))) std::string reason_text(const char* format, ...);

class SplitModel {
 public:
  /// A candidate split and what it is ("balanced", "even", ...: a literal).
  struct Proposal {
    std::vector<int> split;
    const char* what = "";
  };

  virtual ~SplitModel() = default;

  /// Units split over the ranks (the global batch's samples, the pipeline's blocks).
  virtual int total() const = 0;
  /// The knob's name in reasons ("shares", "split").
  virtual const char* noun() const = 0;
  /// The split in force as the ranks report it; empty when they do not report it. The decider
  /// takes it only when it sums to total() with every entry >= 1.
  virtual std::vector<int> reported(const monitor::Beliefs& b) const = 0;
  /// Fits the model to `b` with `current` in force. Returns the ranks with no measurement yet
  /// (or on a lost GPU), comma-separated; "" when every rank is measured.
  virtual std::string fit(const monitor::Beliefs& b, const std::vector<int>& current) = 0;
  /// Each rank's speed for the observation (the median rank's cost over the rank's, clamped to
  /// [0.01, 1.5]; 1 where not measured), noise-level differences removed.
  virtual std::vector<double> speeds() const = 0;
  /// The candidate splits beside the fastest one measured (which the decider adds): balanced,
  /// half-way from `current` to balanced, even. Precondition: fit() found every rank measured.
  virtual std::vector<Proposal> proposals(const std::vector<int>& current) const = 0;
  /// The model's step for `split`, ms (the part the split changes plus what it cannot).
  virtual double predict_ms(const std::vector<int>& split) const = 0;
  /// Seconds a switch from `from` to `to` stages ahead of its boundary (the candidate's
  /// migration_s), `step_s` being the measured step. The pause at the boundary, about one step
  /// (the boundary agreement), is the decider's to add.
  virtual double staged_s(const std::vector<int>& from, const std::vector<int>& to,
                          double step_s) const = 0;
  /// The share of the job's speed that staging takes while it runs (the observation's
  /// staging_slowdown: 0 when staging is the boundary agreement alone, 1 when a transfer holds
  /// the job up for as long as it runs).
  virtual double staging_slowdown() const = 0;
  /// The evidence for reasons: the rank `best` (the best candidate; nullptr when none) takes
  /// the most work from, or the slowest rank, with its figures against the median rank's.
  virtual std::string evidence(const std::vector<int>& current,
                               const std::vector<int>* best) const = 0;
  /// Why the measurements contradict a switch from `current` to `target` (the guardrail then
  /// keeps); "" when nothing does.
  virtual std::string disagrees(const std::vector<int>& current,
                                const std::vector<int>& target) const = 0;
  /// The step's wait the candidates' costs report as exposed communication, ms (0: none).
  virtual double exposed_wait_ms() const = 0;
  /// The layout `split` is, as the observation's candidates carry it.
  virtual Strategy layout(const std::vector<int>& split) const = 0;
};

}  // namespace parapilot::env::dp
