// PipelineJobSim: the hidden truth of one simulated pipeline job (S stages, one rank each, over
// B blocks; docs/deploy.md, "Learned pipeline jobs") and the per-step telemetry its stages
// would send, for training and judging the policy that picks each stage's blocks (the pp:
// family of env/dp/dp_env.h).
//
// The job. Block i costs block_ms[i] per step (forward and backward over all M micro-batches)
// on a nominal stage; stage s runs at 1 / its slowdown. A step lasts
//   (M + S - 1) / M x max_s (its blocks' cost x its factor) + max_s fixed_ms x its factor
//   + p2p_ms x the communication slowdown,
// the schedule's fill and drain around the slowest stage, the optimizer steps, and the exposed
// activation transfers (which no split shortens).
//
// What draw_pipeline() draws (assumptions; uniform unless said): 2-8 blocks per stage of equal
// size (1e6-1e8 parameters, log-uniform; 4 bytes of gradient each) costing 2-40 ms per step
// (log-uniform), the first block (the embedding) 0.2-1x a middle one's cost and 0.5-4x its
// size, the last (the head and the loss) 1-3x its cost and 0.5-4x its size; micro-batches S to
// 4S (at most 64); a fixed part of 1-10 ms; exposed transfers of 0.5-5 ms per step; a pipeline
// bandwidth of 1-10 GB/s (log-uniform).
//
// Everything else comes from the data-parallel simulator's Episode (env/dp/job_sim.h, drawn
// with ranks = S): its fail-slow events of one rank (a stage here) or of the communication, its
// mixed family's slower second GPU type, its telemetry noise, hiccups, dropped samples,
// interference and misreports, with the same rates and durations.
//
// A switch takes effect at the next step boundary and pauses that step by the last step's wall
// time plus the moved blocks' state (gradient bytes x 3, Adam) over the bandwidth.
//
// Random draws do not depend on the split in force (same seed, same noise whatever a policy
// does); deterministic for (episode, shape, seed). Thread-safety: none.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "env/dp/job_sim.h"
#include "env/dp/split_sim.h"

namespace parapilot::env::pp {

/// The pipeline's nominal figures besides what the Episode holds.
struct PipelineShape {
  std::vector<double> block_ms;        ///< per block, ms per step on a nominal stage, > 0
  std::vector<uint64_t> block_params;  ///< per block
  std::vector<uint64_t> block_bytes;   ///< per block: its gradients' bytes
  int microbatches = 1;                ///< M >= 1
  double fixed_ms = 0;                 ///< a nominal stage's optimizer step and loss, >= 0
  double p2p_ms = 0;                   ///< exposed activation transfers per step, >= 0
  double bytes_per_ms = 1e6;           ///< the pipeline's bandwidth, > 0
};

/// Draws a pipeline of `stages` stages (>= 1; asserted).
PipelineShape draw_pipeline(int stages, uint64_t seed);

class PipelineJobSim final : public dp::SplitJobSim {
 public:
  /// Precondition (asserted): episode.job.ranks == the stages, shape.block_ms.size() >= stages,
  /// one params and bytes entry per block. `seed` drives the noise. Starts at step 0 on the
  /// even split.
  PipelineJobSim(dp::Episode episode, PipelineShape shape, uint64_t seed);

  int ranks() const override { return episode_.job.ranks; }
  /// M x 4 samples: the job's global batch as its JobInfo would say.
  int global_batch() const override { return 4 * shape_.microbatches; }
  Step& step() override;
  void set_counts(const std::vector<int>& counts) override;
  const std::vector<int>& counts() const override { return counts_; }
  uint64_t next_step() const override { return step_; }
  const std::vector<dp::FailSlow>& events() const override { return episode_.events; }
  void truth_at(uint64_t s, std::vector<double>* rank_slowdown,
                double* comm_slowdown) const override;
  std::vector<int> best_counts_at(uint64_t s) const override;
  double true_step_ms_at(uint64_t s, const std::vector<int>& counts) const override;
  /// The step of `from` at `s` plus the moved blocks' transfer.
  double switch_pause_ms_at(uint64_t s, const std::vector<int>& from,
                            const std::vector<int>& to) const override;
  double nominal_step_ms() const override;
  /// PipelineModel, as deploy makes it from the job's JobInfo.
  std::unique_ptr<dp::SplitModel> decider_model(const dp::DataParallelOptions& o) const override;

  const PipelineShape& shape() const { return shape_; }
  /// The transfer a switch from `from` to `to` streams, ms.
  double transfer_ms(const std::vector<int>& from, const std::vector<int>& to) const;

 private:
  // The step on `counts` where stage s's compute is scaled by factor[s] and transfers by comm.
  double wall_of(const std::vector<int>& counts, const std::vector<double>& factor,
                 double comm) const;

  dp::Episode episode_;
  PipelineShape shape_;
  std::mt19937_64 rng_;
  std::vector<int> counts_;
  std::vector<int> previous_;  // the split before a switch not yet taken effect
  bool switched_ = false;
  uint64_t step_ = 0;
  double last_wall_ms_ = 0;
  uint64_t clock_ns_ = 0;
  std::vector<double> factor_, report_;
  std::vector<double> truth_slowdown_;  // the truth best_ was found for
  std::vector<int> best_;               // the balanced split under it
  Step out_;
};

}  // namespace parapilot::env::pp
