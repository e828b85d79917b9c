// What a job's gradient compression owes the model (error feedback, grad_sync.h), taken out of a
// LayoutState as full-model tensors and put back into another (libtorch). A layout switch
// carries it from the old layout to the new one, and a checkpoint saves and restores it, with
// these two functions.
//
// Residuals. What the job owes is, per element of every full tensor, the sum of its residuals
// over the data-parallel replicas (under tensor parallelism the TP copies of a replicated
// tensor are mirrors of one another and count once). gather_feedback adds old replica d's
// residuals into slot d % slots; install_feedback gives new replica d the sum of the slots s
// with s % dp == d, and nothing to the replicas from `slots` on. So the sum over the new
// replicas is the sum over the old ones for every element, on ranks that hold the element, and
// a layout with the saved number of replicas gets each replica's own residuals back exactly.
//
// PowerSGD's bases. A PowerSGD layer's Q (n x rank) is the same on every rank of its DP group;
// it is kept per (tensor, TP piece), with the number of pieces the tensor was cut into.
// install_feedback gives a shard the Q of its piece when the tensor is cut into as many pieces
// (the same part of it) and the compressor's n x rank is the saved shape; otherwise the
// compressor starts from the seed's Q, the same on every rank.
//
// Thread-safety: none; the training thread.
#pragma once

#include <vector>

#include <ATen/ATen.h>

#include "core/status.h"
#include "env/live/collectives.h"
#include "env/live/layout_state.h"

namespace parapilot::live {

/// Error feedback in full-model coordinates, model_layers order.
struct FeedbackState {
  int slots = 0;  ///< replica slots of `residual`.
  /// Per tensor: [slots, full shape...] residual sums; undefined when no rank owes anything
  /// for the tensor.
  std::vector<at::Tensor> residual;
  /// Per tensor: [pieces, n, rank]: the Q of each TP piece; undefined when no rank has one.
  std::vector<at::Tensor> basis;
  /// No tensor has a residual or a basis.
  bool empty() const;
};

/// What `state`'s compressors owe, over every rank of `world` (which must be the whole job:
/// every rank calls it at the same point). One max all-reduce of a small header (which tensors
/// owe, the bases' shapes), then, unless nothing is owed, one sum all-reduce of zero-filled
/// slots into which each rank adds its shards (exact where a slot has one contributor).
/// Precondition: slots >= 1. The failed all-reduce's Status.
StatusOr<FeedbackState> gather_feedback(LayoutState& state, Collectives& world, int slots);

/// Replaces what `state`'s compressors owe and their bases by this rank's part of `f` (the
/// rule above). Precondition: `f` is of state's model (its tensors' shapes).
void install_feedback(LayoutState& state, const FeedbackState& f);

}  // namespace parapilot::live
