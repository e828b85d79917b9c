// The pipeline schedule of one training step: the order in which a stage runs the forward and
// backward passes of its microbatches. No libtorch here.
//
// 1F1B (PipeDream-flush, Megatron's default): stage s of P first runs min(P - 1 - s, M)
// warm-up forwards, then alternates one forward and one backward until every forward ran, then
// runs the remaining (cool-down) backwards. Forwards and backwards each go in microbatch order,
// so a stage receives its neighbours' activations and gradients in the order they are sent. At
// most P - s microbatches' activations are alive on stage s at once. One stage (P = 1) gives
// F0 B0 F1 B1 ..., gradient accumulation as a pure data-parallel worker runs it.
//
// Thread-safety: pure functions.
#pragma once

#include <vector>

namespace parapilot::live {

struct PipeOp {
  enum class Kind { forward, backward };
  Kind kind = Kind::forward;
  int microbatch = 0;  ///< index among the step's microbatches of this replica, from 0.
  bool operator==(const PipeOp&) const = default;
};

/// The 1F1B order of `stage` (0-based) of `stages` over `microbatches` (>= 0): every microbatch
/// once forward and once backward, each after its forward. Preconditions: 0 <= stage < stages.
std::vector<PipeOp> one_f_one_b(int stage, int stages, int microbatches);

}  // namespace parapilot::live
