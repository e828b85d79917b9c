// One training step's forward and backward passes through this rank's pipeline stage
// (libtorch): the 1F1B order of schedule.h, activations received from the previous stage and
// sent to the next, their gradients back the other way, by point-to-point transfers in the
// replica's pipeline group. With one stage it is gradient accumulation over the microbatches.
//
// Gradients accumulate into the stage model's parameters (.grad()); the caller zeroes them
// before and reduces them across data-parallel replicas after.
//
// Thread-safety: none; one step at a time per rank.
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/ATen.h>

#include "core/status.h"
#include "env/live/collectives.h"
#include "env/live/hybrid_model.h"

namespace parapilot::live {

struct PipelineStepOptions {
  int microbatches = 0;        ///< this replica's microbatches in the step (>= 0).
  int sequences = 1;           ///< sequences per microbatch.
  double loss_divisor = 1;     ///< each microbatch's mean loss is divided by this (step's total).
  double slow_factor = 1;      ///< fault injection: compute takes this many times as long.
  std::uint32_t tag_base = 0;  ///< added to the transfer tags (microbatch index x 2 + direction).
};

struct PipelineStepStats {
  /// Building the microbatches and the forward and backward passes (with a slowdown), less
  /// the TP all-reduces.
  double compute_ms = 0;
  double p2p_ms = 0;            ///< waiting to receive and for sends to complete.
  std::uint64_t p2p_bytes = 0;  ///< bytes this rank sent to its neighbours.
  std::uint32_t p2p_calls = 0;  ///< sends and receives.
  double loss = 0;  ///< sum of this rank's scaled microbatch losses (last stage; else 0).
};

/// Runs the step through `model`. `batch(i)` gives the replica's microbatch i (the same on every
/// stage: the last stage takes its targets from it). `pipe` is the replica's pipeline group
/// (group rank = stage), null with one stage; `tp` the model's TP group or null. A failed
/// transfer or TP all-reduce returns kCollectiveFailed (gradients are then undefined).
StatusOr<PipelineStepStats> run_pipeline_step(StageModel& model, PointToPoint* pipe,
                                              TensorParallelGroup* tp,
                                              const PipelineStepOptions& options,
                                              const std::function<at::Tensor(int)>& batch);

}  // namespace parapilot::live
