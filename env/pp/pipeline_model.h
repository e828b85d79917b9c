// PipelineModel: the split model (env/dp/split_model.h) of a pipeline job learned from its
// ranks (docs/deploy.md, "Learned pipeline jobs"): S stages, one rank each, stage s holding the
// contiguous blocks [first_s, first_s + n_s) of the job's B blocks; the split is (n_0, ...,
// n_{S-1}), each >= 1, summing to B.
//
// The model, from each stage's telemetry (Beliefs::rank_stage, rank_compute_ms):
// * a stage's compute per step T_s is its blocks' compute (info/block_ms/<i>, or T_s split
//   equally over its blocks when it reports none) plus a fixed part (T_s minus its blocks: the
//   loss, the optimizer step), which no split moves;
// * each rank has a speed v_s and each block a cost at speed 1: blocks of equal size (the same
//   params in the JobInfo) cost the same at equal speed, which separates a rank's speed from its
//   blocks' costs (alternating medians, the median rank at speed 1). A speed within `equal_band`
//   of 1, or within `noise_k` standard errors of the stage's compute, reads as 1;
// * a split's step, for GPipe and 1F1B alike: (M + S - 1) x the slowest stage's time per
//   micro-batch (its blocks' cost over its speed, over M) plus the largest fixed part.
// Candidates: the balanced split (contiguous blocks minimising the slowest stage, exact by
// binary search over the bottleneck), half-way from the current split to it, the even split.
// A switch streams the parameters and optimizer state of the blocks that change stage
// (grad_bytes x (1 + optimizer_states) each) over the measured pipeline bandwidth ("p2p/pp"
// bytes over its ms, which counts waits too: a bound from below), counted as time the job
// loses, then pauses at the boundary: the candidates' switch cost is the transfer plus the pause.
//
// Thread-safety: pure functions are safe from any thread; PipelineModel is not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "env/dp/split_model.h"

namespace parapilot::env::pp {

/// The step of `split` (blocks per stage, in order) when block i costs block_cost[i] ms per
/// step at speed 1 and stage s runs at stage_speed[s] (> 0): (M + S - 1) / M x the slowest
/// stage's blocks' cost over its speed, plus fixed_ms. Precondition: the split covers the
/// blocks, each entry >= 1; microbatches >= 1.
double pipeline_step_ms(const std::vector<double>& block_cost,
                        const std::vector<double>& stage_speed, const std::vector<int>& split,
                        int microbatches, double fixed_ms);

/// The contiguous split of the blocks over the stages (each >= 1) minimising the slowest
/// stage's cost over its speed: binary search over the bottleneck, each bound checked exactly
/// in O(stages x blocks), until nothing below the best split found is reachable (exact to a
/// relative 1e-12) or the bracket is within a relative 1e-10; among the splits that reach the
/// bottleneck, earlier stages hold as many blocks as they can. Precondition:
/// block_cost.size() >= stage_speed.size() >= 1, costs >= 0, speeds > 0.
std::vector<int> balanced_split(const std::vector<double>& block_cost,
                                const std::vector<double>& stage_speed);

/// The layout a pipeline job runs: dp 1, pp = split.size(), the split's stage boundaries, and
/// global_batch / microbatches sequences per micro-batch. Its schedule is the job's, which deploy
/// does not know (JobInfo does not carry it) and the model does not need (a split's step is the
/// same expression under GPipe and 1F1B): its plans leave it out (plan_prepare_keeping_schedule,
/// env/job.h), and the Strategy's schedule field is not the job's.
Strategy pipeline_layout(const std::vector<int>& split, int global_batch, int microbatches);

struct PipelineModelOptions {
  int stages = 0;                     ///< S >= 1.
  int global_batch = 0;               ///< samples per step, >= 1.
  std::vector<uint64_t> block_params;  ///< per block (JobInfo layers), B >= S entries.
  std::vector<uint64_t> block_bytes;   ///< per block: its gradients' bytes (as many entries).
  int microbatches = 1;  ///< until the stages report theirs ("info/microbatches").
  double optimizer_states = 2;  ///< optimizer state per parameter, in parameters (Adam: 2).
  /// Bytes per ms a switch streams at until the pipeline's sends are measured (1 GB/s).
  double default_bytes_per_ms = 1e6;
  double equal_band = 0.2;
  double noise_k = 3.0;
};

class PipelineModel final : public dp::SplitModel {
 public:
  /// Precondition (asserted): stages >= 1, global_batch >= 1, block_params.size() ==
  /// block_bytes.size() >= stages, microbatches >= 1, default_bytes_per_ms > 0.
  explicit PipelineModel(PipelineModelOptions options);

  int total() const override { return static_cast<int>(o_.block_params.size()); }
  const char* noun() const override { return "split"; }
  std::vector<int> reported(const monitor::Beliefs& b) const override;
  std::string fit(const monitor::Beliefs& b, const std::vector<int>& current) override;
  std::vector<double> speeds() const override { return speed_; }
  std::vector<Proposal> proposals(const std::vector<int>& current) const override;
  double predict_ms(const std::vector<int>& split) const override;
  double staged_s(const std::vector<int>& from, const std::vector<int>& to,
                  double step_s) const override;
  /// The transfer is counted as holding the job up for as long as it runs.
  double staging_slowdown() const override { return 1; }
  std::string evidence(const std::vector<int>& current,
                       const std::vector<int>* best) const override;
  std::string disagrees(const std::vector<int>&, const std::vector<int>&) const override {
    return "";
  }
  double exposed_wait_ms() const override { return 0; }
  Strategy layout(const std::vector<int>& split) const override;

  /// What fit() learned: each block's cost per step at speed 1, each stage's speed (noise
  /// removed), the fixed part, the micro-batches, the pipeline's bytes per ms.
  const std::vector<double>& block_cost() const { return cost_; }
  double fixed_ms() const { return fixed_; }
  int microbatches() const { return microbatches_; }
  double bytes_per_ms() const { return bytes_per_ms_; }

 private:
  // Speeds and block costs from each block's measured compute on its stage (see the header).
  void separate(const std::vector<std::vector<double>>& measured_ms,
                const std::vector<int>& first, const std::vector<double>& relative_se);

  PipelineModelOptions o_;
  std::vector<int> class_of_;    // per block: its size class (equal params)
  int classes_ = 0;
  std::vector<double> cost_;     // per block, ms per step at speed 1
  std::vector<double> speed_;    // per stage
  std::vector<double> stage_ms_; // per stage: measured compute per step (for evidence)
  double fixed_ = 0;
  int microbatches_ = 1;
  double bytes_per_ms_ = 0;
};

}  // namespace parapilot::env::pp
