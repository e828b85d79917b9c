// SplitJobSim: the hidden truth of one simulated learned job whose split (env/dp/split_model.h)
// a policy decides, step by step, and the telemetry its ranks would send: a data-parallel
// job's batch shares (DataParallelJobSim, env/dp/job_sim.h) or a pipeline's blocks per stage
// (PipelineJobSim, env/pp/pipeline_sim.h). DataParallelEnv (env/dp/dp_env.h) drives either.
//
// Thread-safety: none; one episode is driven by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "env/dp/decider.h"
#include "env/dp/split_model.h"
#include "env/monitor/monitor.h"

namespace parapilot::env::dp {

struct FailSlow;

class SplitJobSim {
 public:
  struct Step {
    uint64_t step = 0;
    double wall_ms = 0;    ///< the step's wall time, pause included
    double best_ms = 0;    ///< the same step (same noise) on the best split, no pause
    double paused_ms = 0;  ///< the switch pause this step paid
    std::vector<monitor::StepSample> samples;  ///< the samples sent (dropped ones left out)
  };

  virtual ~SplitJobSim() = default;

  virtual int ranks() const = 0;
  /// Samples per step.
  virtual int global_batch() const = 0;
  /// Runs the next step. The returned step stays valid until the next call; the caller may
  /// move its samples out (e.g. into Monitor::ingest).
  virtual Step& step() = 0;
  /// A new split (one >= 1 entry per rank, summing to the job's units; asserted): in force from
  /// the next step, which pays the switch pause. Equal to the split in force: no-op.
  virtual void set_counts(const std::vector<int>& counts) = 0;
  virtual const std::vector<int>& counts() const = 0;
  virtual uint64_t next_step() const = 0;
  virtual const std::vector<FailSlow>& events() const = 0;
  /// The true per-rank slowdowns and communication slowdown at step `s` (1: nominal).
  virtual void truth_at(uint64_t s, std::vector<double>* rank_slowdown,
                        double* comm_slowdown) const = 0;
  /// Hindsight, for the oracle: the best split under the truth of step `s`, the noiseless step
  /// time of `counts` at step `s`, and the pause a switch from `from` to `to` at `s` costs.
  virtual std::vector<int> best_counts_at(uint64_t s) const = 0;
  virtual double true_step_ms_at(uint64_t s, const std::vector<int>& counts) const = 0;
  virtual double switch_pause_ms_at(uint64_t s, const std::vector<int>& from,
                                    const std::vector<int>& to) const = 0;
  /// The noiseless step on the starting split with no fail-slow: the job's nominal step, which
  /// sets the env's interval length.
  virtual double nominal_step_ms() const = 0;
  /// The split model deploy's decider would use for this job (as deploy makes it from the
  /// job's JobInfo), with `o`'s noise bands.
  virtual std::unique_ptr<SplitModel> decider_model(const DataParallelOptions& o) const = 0;
};

}  // namespace parapilot::env::dp
