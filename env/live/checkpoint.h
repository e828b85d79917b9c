// The worker's training checkpoint (`parapilot worker --save-state DIR`, `--load-state DIR`):
// the whole model's parameters and the optimizer's state, in the full model's coordinates
// (model_layers order, whatever layout wrote them), what gradient compression owes the model
// (error feedback: per replica residuals, PowerSGD's bases; feedback_state.h), and the step to
// train next. A job can so stop under one layout and resume under any other: each rank takes
// its own shards of the full tensors (checkpoint_state.h). No libtorch here: the file format
// and its checks.
//
// On disk: DIR/parapilot-state.bin, one file written through a temporary file renamed into
// place. A first line "parapilot-state 2", a one-line JSON header (the model, its tensors'
// names and shapes, the optimizer, Adam's step count, the next step, the error feedback's
// table, the payload's size and CRC32C), then the payload: raw little-endian
// float32, every parameter in model order, then (Adam) every exp_avg, then every exp_avg_sq,
// then for each tensor of the feedback table its residuals (replicas x the tensor's elements)
// and its bases (pieces x n x rank), each when the table lists them. A "parapilot-state 1"
// file (no feedback table) still loads: it owes nothing.
//
// Thread-safety: plain values and free functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "env/live/action.h"

namespace parapilot::live {

/// What a checkpoint folder holds: the whole model's training state, layout-independent.
struct TrainingState {
  ModelConfig model;
  std::string optimizer = "adam";  ///< "adam" or "sgd".
  /// The step the resumed job trains first (the data order continues from it).
  std::uint64_t next_step = 0;
  /// Adam's step count (the same for every tensor); 0 with no Adam state (SGD, or no step yet).
  std::int64_t adam_step = 0;
  /// Full tensors in model_layers(model) order, flattened. exp_avg and exp_avg_sq are empty
  /// when there is no Adam state, else one per parameter of its size.
  std::vector<std::vector<float>> params, exp_avg, exp_avg_sq;
  /// Replica slots of every residual below (the saving layout's dp); 0 when nothing is owed.
  int feedback_replicas = 0;
  /// What compression owes, for the tensors that owe anything or have a basis, by increasing
  /// layer.
  struct TensorFeedback {
    int layer = 0;  ///< model_layers order.
    /// feedback_replicas x the tensor's elements (replica-major); empty: nothing owed.
    std::vector<float> residual;
    /// PowerSGD's Q per TP piece: {pieces, n, rank}; empty: none (and `basis` empty).
    std::vector<std::int64_t> basis_shape;
    std::vector<float> basis;
  };
  std::vector<TensorFeedback> feedback;
};

/// The checkpoint file inside a --save-state / --load-state folder.
std::string checkpoint_path(const std::string& dir);

/// Writes `c` into `dir` (created when missing) atomically: a reader finds the old checkpoint
/// or the new one, never a mix. Precondition: the tensors match model_layers(c.model).
/// kInvalidArgument naming the folder when it cannot be written.
Status write_checkpoint(const std::string& dir, const TrainingState& c);

/// Reads `dir`'s checkpoint and checks it fits a job of `model` with `optimizer`.
/// kInvalidArgument starting "--load-state DIR: " and saying what is wrong when: the folder or
/// file is missing or unreadable; the file is not a checkpoint (first line, header); its model
/// differs (names the first tensor whose name or shape differs, or the counts); its optimizer
/// differs; its error-feedback table is malformed (names the entry and what is wrong: a layer
/// out of range or out of order, no replicas, a basis shape that is not {pieces, n, rank} of
/// positive sizes within the tensor's); the file is shorter or longer than its header says
/// (truncated); the checksum fails.
/// With `header_only` the payload is neither read nor checksummed (the tensors stay empty) but
/// its size is still checked against the file's.
StatusOr<TrainingState> read_checkpoint(const std::string& dir, const ModelConfig& model,
                                     const std::string& optimizer, bool header_only = false);

}  // namespace parapilot::live
