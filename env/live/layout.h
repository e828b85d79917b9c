// The hybrid-parallel layout of a live job (data x tensor x pipeline degrees and the pipeline's
// stage boundaries), where each rank sits in it, which process groups it needs, and which part
// of every model tensor it holds. No libtorch here: pure functions over plain values.
//
// Rank mapping (the strategy language's default placement, Strategy::gpu_of_rank with
// placement tp-pp-dp): tensor parallel fastest, then pipeline stage, then data-parallel replica,
//
//     rank = (dp_index * pp + stage) * tp + tp_index.
//
// So the TP group of a stage is a block of consecutive ranks, a replica's pipeline is a block
// of tp * pp consecutive ranks, and a DP group holds the ranks with the same (stage, tp_index).
//
// Tensor parallel (Megatron's split of a transformer block): qkv and fc1 are column-parallel
// (rows of the weight: qkv's q, k and v blocks each cut into tp pieces by heads, fc1's 4d rows cut
// into tp pieces), proj and fc2 are row-parallel (columns of the weight cut into tp pieces);
// everything else (layer norms, the row-parallel layers' biases, embeddings, the output head)
// is replicated in the TP group.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "env/live/action.h"

namespace parapilot::live {

/// A layout the workers run. Invariants (what parse_layout and data_parallel_layout return):
/// dp, tp, pp >= 1; stages has pp entries, each >= 1, summing to the model's blocks.
struct LiveLayout {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  std::vector<int> stages;  ///< transformer blocks per pipeline stage, in stage order.

  int world_size() const { return dp * tp * pp; }
  bool pure_data_parallel() const { return tp == 1 && pp == 1; }
  bool operator==(const LiveLayout&) const = default;
};

/// Pure data parallel over `world_size` ranks: dp = world_size, one stage holding every block.
LiveLayout data_parallel_layout(int world_size, const ModelConfig& model);

/// Parses the strategy language's inline form restricted to the keys the workers run: "dp=2,
/// tp=1,pp=2,stages=[1,3]" (docs/specs.md; parsed and checked by load_strategy). Omitted keys:
/// tp = pp = 1, dp = world_size / (tp * pp), stages balanced as the simulator balances them.
/// Empty text is data_parallel_layout. kInvalidArgument starting "--layout: " and naming the
/// key when: a key is not dp, tp, pp or stages; dp*tp*pp != world_size; stages has not pp
/// entries or does not sum to the model's blocks; tp does not divide the heads (and so 4*d);
/// tp or pp > 1 on a model other than the transformer; or the text is malformed.
StatusOr<LiveLayout> parse_layout(std::string_view text, int world_size, const ModelConfig& model);

/// "dp=2,tp=1,pp=2,stages=[1,3]": parse_layout reads it back to an equal layout.
std::string layout_text(const LiveLayout& layout);

/// Where a rank sits. Precondition for the functions below: 0 <= rank < world_size().
struct RankCoords {
  int dp = 0;     ///< data-parallel replica.
  int tp = 0;     ///< index in the tensor-parallel group.
  int stage = 0;  ///< pipeline stage.
  bool operator==(const RankCoords&) const = default;
};
RankCoords coords_of(const LiveLayout& layout, int rank);
int rank_of(const LiveLayout& layout, const RankCoords& at);

/// The ranks of `rank`'s groups, in group-rank order (group rank i = entry i):
/// DP group: same (stage, tp), by replica; TP group: same (dp, stage), by tp index;
/// pipeline: same (dp, tp), by stage.
std::vector<int> dp_group(const LiveLayout& layout, int rank);
std::vector<int> tp_group(const LiveLayout& layout, int rank);
std::vector<int> pipeline_group(const LiveLayout& layout, int rank);

/// One process group of the layout.
struct GroupSpec {
  std::string name;        ///< unique within the layout: "dp/s0t1", "tp/d1s0", "pp/d0t1".
  std::vector<int> ranks;  ///< global ranks, in group-rank order.
};
/// Every DP, TP and pipeline group of more than one rank, in the one order every rank must
/// build them (skipping those it is not in): DP groups, then TP groups, then pipelines.
std::vector<GroupSpec> layout_groups(const LiveLayout& layout);

/// The first block of `stage` (blocks of earlier stages), and one past its last.
int first_block(const LiveLayout& layout, int stage);
int end_block(const LiveLayout& layout, int stage);

/// How a rank's tensor relates to the full model's tensor.
enum class ShardKind : std::uint8_t {
  replicated,  ///< the whole tensor.
  rows,        ///< dimension 0 seen as `parts` equal blocks, each cut into tp pieces: piece tp.
  columns,     ///< the same over dimension 1.
};

/// One tensor this rank holds, as a part of the full model's tensor `layer` (model_layers order).
struct ParamShard {
  int layer = 0;
  ShardKind kind = ShardKind::replicated;
  int parts = 1;   ///< rows/columns: equal blocks cut separately (qkv: 3, q, k and v).
  int pieces = 1;  ///< rows/columns: pieces per block (tp).
  int piece = 0;   ///< rows/columns: which piece (the rank's tp index).
  std::vector<std::int64_t> shape;  ///< this rank's tensor.
  bool operator==(const ParamShard&) const = default;
};

/// The tensors `rank` holds under `layout`, in the order its stage model registers them (the
/// full model's order restricted to the rank's stage). Transformer models only (mlp: pure DP,
/// every tensor replicated).
std::vector<ParamShard> rank_shards(const LiveLayout& layout, const ModelConfig& model, int rank);

/// True when `rank` is the one rank that writes `shard` into the gathered full model: replica 0,
/// and for a replicated tensor TP index 0 (every stage writes its own blocks).
bool writes_in_gather(const LiveLayout& layout, int rank, const ParamShard& shard);

}  // namespace parapilot::live
