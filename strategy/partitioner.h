// Pipeline partitioning and elastic data-parallel shares: the exact min-max allocations the
// planner solves for every candidate layout.
//
// All functions are pure, deterministic and allocation-free except where they return vectors;
// they are safe to call concurrently. Costs are in seconds per microbatch.
#pragma once

#include <climits>
#include <optional>
#include <vector>

namespace parapilot {

// The time of one pipeline rank as a function of the transformer blocks it holds:
//   fixed_s + per_block_s * blocks, with at most max_blocks blocks (its memory limit).
// fixed_s carries what does not depend on the boundaries: the embedding on the first rank, the
// logits and loss on the last, point-to-point transfers. Slowdowns are already folded in.
struct RankCost {
  double fixed_s = 0;
  double per_block_s = 0;
  int max_blocks = INT_MAX;
};

// Block counts per pipeline rank that minimise the slowest rank's time, where the time of rank p
// is the largest over rows j of costs[j * pp + p] (one row per distinct data-parallel replica,
// already weighted by its microbatch count, so the objective is the slowest replica's
// bottleneck). Every rank gets at least min_blocks blocks (virtual_stages: one per chunk) and at
// most its max_blocks; counts sum to `blocks`.
//
// Exact: bisection on the bottleneck value with an O(pp * rows) feasibility test (rank p can
// take every count whose time is <= T, and the counts are independent because any vector of
// counts is realised by contiguous stages), finished on the exact optimum since the optimum is
// one of the rank times. Returns false (and leaves *out unspecified) when no allocation fits
// the memory limits; otherwise stores the counts in out[0..pp) and the bottleneck in
// *bottleneck_s.
bool partition_blocks(const RankCost* costs, int rows, int pp, int blocks, int min_blocks, int* out,
                      double* bottleneck_s);

// Spreads each rank's block count over its virtual_stages chunks (as evenly as possible) in the
// cost model's chunk order: chunk k of rank p is entry k * pp + p.
std::vector<int> chunk_layers(const std::vector<int>& blocks_per_rank, int virtual_stages);

// Contiguous partition of layers with individual costs layer_cost_s[l] (nominal seconds) over
// stages in a fixed order: stage s takes a contiguous range, at least one layer, at most
// max_layers[s] layers, and runs in stage_fixed_s[s] + stage_factor[s] * (sum of its layers'
// costs). Minimises the slowest stage exactly (bisection with a greedy-prefix feasibility test,
// which is exact for contiguous chains). Returns nullopt when no partition fits max_layers.
struct ChainPartition {
  std::vector<int> layers_per_stage;
  double bottleneck_s = 0;  // the slowest stage's time
};
std::optional<ChainPartition> partition_chain(const std::vector<double>& layer_cost_s,
                                              const std::vector<double>& stage_factor,
                                              const std::vector<double>& stage_fixed_s,
                                              const std::vector<int>& max_layers);

// Elastic data parallel: integer microbatch counts m[r] (multiples of `unit`, at least `unit`,
// summing to `total`) minimising max_r (m[r] * per_microbatch_s[r] + fixed_s[r]), i.e. the
// replicas finish together as closely as integers allow. Exact, and the same allocation as
// partition_blocks with one row (ties go to the higher replicas). `total` must be a positive
// multiple of unit with total >= replicas * unit.
void allocate_microbatches(const double* per_microbatch_s, const double* fixed_s, int replicas,
                           int total, int unit, int* out);

// The same allocation for replicas given as runs of equal costs: run k is replicas
// run_begin[k] .. run_begin[k + 1] - 1 (run_begin[0] == 0, each run at least one replica,
// replicas = run_begin[runs]), each with per_microbatch_s[k] and fixed_s[k]. out[r] is exactly
// what the overload above gives for the times repeated replica by replica; with few runs the
// work is per run, apart from writing out.
void allocate_microbatches(const double* per_microbatch_s, const double* fixed_s,
                           const int* run_begin, int runs, int total, int unit, int* out);

}  // namespace parapilot
