// ModelConfig: the training model of a live worker (a byte-level language model), as the
// worker, the launcher and the live job describe it. No libtorch here.
//
// Thread-safety: a plain value and a pure function (defined in action.cc with the other parsers
// of the live cluster's inputs).
#pragma once

#include <string>

#include "core/status.h"

namespace parapilot::live {

/// The training model of a worker (a byte-level language model).
struct ModelConfig {
  std::string kind = "transformer";  ///< "transformer" or "mlp".
  int layers = 2;                    ///< transformer blocks, or MLP hidden layers.
  int d_model = 64;                  ///< embedding width.
  int heads = 4;                     ///< attention heads (transformer).
  int seq_len = 64;                  ///< bytes per training sequence.
  int context = 8;                   ///< bytes seen by the MLP per prediction.
  static constexpr int kVocab = 256;
};
/// kInvalidArgument naming the field when a value is out of range.
Status validate(const ModelConfig& m);

}  // namespace parapilot::live
