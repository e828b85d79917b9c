// Strategy: one concrete hybrid-parallel layout — the parallel-strategy language's value type.
//
// A Strategy is written by people as a TOML [strategy] table (docs/specs.md) or produced by
// the planner. It is a plain value: cheap to copy, safe to share read-only between threads.
// find_problem() is the single source of truth for what makes a layout impossible.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strategy/cluster.h"
#include "strategy/model.h"

namespace parapilot {

enum class Schedule { kGPipe, k1F1B, kInterleaved };
enum class Recompute { kNone, kSelective, kFull };
enum class PlacementOrder { kTpPpDp, kTpDpPp };  // innermost first
// How the attention core runs: one fused kernel that keeps the scores on chip (flash), or
// separate GEMMs and softmax with the s x s scores in memory (unfused, Megatron-LM 2021-22).
enum class Attention { kFlash, kUnfused };

// How one layer's gradients travel in the data-parallel reduction.
struct Compression {
  enum class Kind { kNone, kFP16, kTopK, kPowerSGD };
  Kind kind = Kind::kNone;
  double topk_ratio = 0;  // kTopK: fraction of entries sent, in (0, 1)
  int powersgd_rank = 0;  // kPowerSGD: rank of the low-rank factors, >= 1

  bool operator==(const Compression&) const = default;
};

// Compression for the inclusive block range [first_layer, last_layer].
struct CompressionOverride {
  int first_layer = 0;
  int last_layer = 0;
  Compression compression;
  bool operator==(const CompressionOverride&) const = default;
};

struct Strategy {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  // Context parallelism: the sequence is split over cp ranks that each hold a tensor-parallel
  // shard of the same stage; attention passes key/value blocks around them (ring attention).
  int cp = 1;
  bool sp = false;  // sequence parallelism inside the tensor-parallel group
  Attention attention = Attention::kFlash;
  bool fp8 = false;  // linear-layer GEMMs in FP8 (Transformer-Engine style; bf16 parameters)
  int microbatch_size = 1;
  int global_batch = 1;
  Schedule schedule = Schedule::k1F1B;
  int virtual_stages = 1;  // model chunks per pipeline rank (interleaved schedule only)
  Recompute recompute = Recompute::kNone;
  int zero = 0;                     // ZeRO stage 0-3; 1 is Megatron's distributed optimizer
  bool overlap_grad_reduce = true;  // bucketed DP reduction overlapped with backward
  // Tensor-parallel collectives pipelined with their GEMMs (Megatron's tp_comm_overlap).
  bool tp_comm_overlap = false;
  // ZeRO >= 1: the parameter all-gather after the step overlapped, bucket by bucket, with the
  // next forward pass (Megatron's overlap_param_gather).
  bool overlap_param_gather = false;
  // Transformer blocks per (virtual) stage in pipeline order; chunk c of pipeline rank p is
  // entry c * pp + p. Empty means balanced (as even as possible, remainder to the middle).
  std::vector<int> stage_layers;
  PlacementOrder placement = PlacementOrder::kTpPpDp;
  // Explicit GPU of each rank, rank = ((dp_index * pp + pp_index) * cp + cp_index) * tp +
  // tp_index. Empty means the placement order over GPUs 0..dp*tp*pp*cp-1.
  std::vector<int> gpus;
  // Samples per data-parallel replica; empty means uniform (global_batch / dp each).
  std::vector<int> dp_shares;
  Compression compression;  // default for every layer
  std::vector<CompressionOverride> compression_overrides;

  int num_gpus() const { return dp * tp * pp * cp; }
  int num_chunks() const { return pp * virtual_stages; }

  // Derived views (valid once find_problem() returned nullopt).
  std::vector<int> layers_per_chunk(int layers) const;  // resolves "balanced"
  std::vector<int> shares() const;                      // resolves uniform shares
  // The GPU of a rank. A stage's cp tensor-parallel groups sit next to one another, just
  // outside tp (Megatron's tp-cp order); cp_index 0 is the first of them.
  int gpu_of_rank(int dp_index, int pp_index, int tp_index, int cp_index = 0) const {
    return gpu_at(first_rank(dp_index, pp_index) + cp_index * tp + tp_index);
  }
  // The first rank of (replica, stage): its tp x cp GPUs are the tp * cp ranks from it on,
  // context rank after context rank.
  int first_rank(int dp_index, int pp_index) const {
    const int stage = placement == PlacementOrder::kTpPpDp || !gpus.empty()
                          ? dp_index * pp + pp_index
                          : pp_index * dp + dp_index;
    return stage * cp * tp;
  }
  // The GPU of a rank (as numbered by first_rank).
  int gpu_at(int rank) const { return gpus.empty() ? rank : gpus[rank]; }
  const Compression& compression_of_layer(int layer) const;

  bool operator==(const Strategy&) const = default;
};

// What is wrong with a strategy: the [strategy] key at fault and why.
struct StrategyProblem {
  std::string key;
  std::string reason;
};

// Returns the first reason the strategy cannot run this model on this cluster (divisibility,
// GPU counts, tp groups spanning nodes, stages that do not cover the layers, shares that do
// not sum to the batch, ...), or nullopt when it is a legal layout. Memory is not checked here:
// that is the cost model's job (a legal layout may not fit).
std::optional<StrategyProblem> find_problem(const Strategy& s, const ModelSpec& model,
                                            const ClusterSpec& cluster);

const char* to_string(Schedule schedule);
const char* to_string(Recompute recompute);
const char* to_string(PlacementOrder order);
const char* to_string(Attention attention);
std::string to_string(const Compression& compression);
// Parses "none", "fp16", "topk:RATIO", "powersgd:RANK"; nullopt when malformed.
std::optional<Compression> parse_compression(const std::string& text);

}  // namespace parapilot
