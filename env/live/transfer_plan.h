// The transfer plan of a layout switch: for every rank's tensors under the new layout, which
// part it already holds under the old layout (a local copy) and which part comes from which
// other rank. The same plan moves a tensor's parameters and its optimizer state (Adam's
// exp_avg and exp_avg_sq have the parameter's shape; the step count is the same on every rank
// and stays local). No libtorch here: a pure function over LiveLayout and rank_shards.
//
// Coordinates: a piece is a range [begin, end) of one full-model tensor (model_layers order)
// along its split dimension, taken inside each of the tensor's `parts` equal blocks (qkv: the
// q, k and v blocks) — the same form rank_shards' rows/columns shards have. A replicated tensor
// is split along no dimension: the range is over its flattened elements.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include "env/live/layout.h"

namespace parapilot::live {

/// One piece of one tensor that `target` holds under the new layout, sent by `source` (which
/// holds it under the old layout; source == target: a local copy).
struct TransferPiece {
  int layer = 0;                    ///< full-model tensor, model_layers order.
  int dim = -1;                     ///< 0 rows, 1 columns, -1 flattened (replicated tensors).
  int parts = 1;                    ///< equal blocks along dim, the range taken in each.
  std::int64_t begin = 0, end = 0;  ///< the range inside each block (or over the elements).
  int source = 0;
  int target = 0;
  bool operator==(const TransferPiece&) const = default;
};

/// Every piece every rank needs to hold its tensors under `to`, given what the ranks hold
/// under `from`. Each element of each rank's new tensors has exactly one piece (and so one
/// source); a rank that held an element keeps it (local copy); otherwise the element comes
/// from the old holder that has sent the least so far (the lowest rank on a tie), which spreads
/// the sending over the holders. Sorted by (target,
/// layer, begin). Preconditions: both layouts valid for `model` (parse_layout) with the same
/// world size; the model is the transformer (or, for the MLP, both layouts pure DP).
std::vector<TransferPiece> transfer_plan(const LiveLayout& from, const LiveLayout& to,
                                         const ModelConfig& model);

/// The range a shard covers, in TransferPiece coordinates: its dim and [begin, end) within
/// each of its parts.
struct ShardRange {
  int dim = -1;
  int parts = 1;
  std::int64_t begin = 0, end = 0;
};
ShardRange shard_range(const ParamShard& shard, const ModelConfig& model);

/// Elements of a piece (over all its parts).
std::int64_t piece_numel(const TransferPiece& piece, const ModelConfig& model);

/// Totals of a plan for one rank: elements it copies locally, sends and receives (each per
/// tensor kind moved: multiply by 4 bytes and by 1 + the optimizer's state tensors).
struct TransferVolume {
  std::int64_t local = 0, sent = 0, received = 0;
};
TransferVolume transfer_volume(const std::vector<TransferPiece>& plan, int rank,
                               const ModelConfig& model);

}  // namespace parapilot::live
