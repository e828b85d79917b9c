// A LayoutState to and from a layout-independent TrainingState (checkpoint.h), libtorch side: the
// save gathers every rank's shards of the parameters and of Adam's moments into full tensors;
// the load gives each rank its own shards of them under its layout (layout.h rank_shards).
//
// Thread-safety: none; the training thread.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "env/live/checkpoint.h"
#include "env/live/layout_state.h"

namespace parapilot::live {

/// The whole model's parameters and optimizer state (Adam: exp_avg, exp_avg_sq and the step
/// count, when the optimizer has stepped; SGD has none) as full tensors in model_layers order,
/// and `next_step`, on every rank of `world`: one sum all-reduce over the world of zero-filled
/// full tensors into which exactly one rank (writes_in_gather) copied each element, so the
/// values are exact. Then what the compressors owe, one slot per replica, and PowerSGD's
/// bases (gather_feedback; exact too). Every rank of the world must call it. The failed
/// all-reduce's Status.
StatusOr<TrainingState> gather_checkpoint(LayoutState& state, Collectives& world,
                                       const ModelConfig& model, const std::string& optimizer,
                                       std::uint64_t next_step);

/// Copies this rank's shards of `c`'s parameters into `state`'s model and, when `c` holds Adam
/// state, sets the optimizer's state of every parameter (its shards of the moments, the step
/// count); gives its compressors their part of what `c` owes (install_feedback: under the
/// saved number of replicas each its own residuals, else the folded sums). Precondition: `c`
/// was read for state's model and optimizer (read_checkpoint).
void install_checkpoint(LayoutState& state, const TrainingState& c);

}  // namespace parapilot::live
