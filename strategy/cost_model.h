// Cost and memory model: predicts one training iteration's time and per-GPU memory for a
// (model, cluster, strategy) under runtime conditions. Documented in docs/cost-model.md.
//
// CostModel is immutable after construction and evaluate() is const, allocation-free on the
// common path (once its per-thread caches are warm) and safe to call concurrently from many
// threads: the planner and the RL loop call it millions of times.
#pragma once

#include <string>
#include <vector>

#include "strategy/cluster.h"
#include "strategy/model.h"
#include "strategy/strategy.h"

namespace parapilot {

// What the monitor currently believes about the cluster. Empty vectors mean nominal.
struct Conditions {
  std::vector<double> gpu_speed;      // per GPU: 1 = nominal, 0.5 = computes at half speed
  std::vector<double> node_inter_bw;  // per node: factor on its network bandwidth
  std::vector<double> node_intra_bw;  // per node: factor on its NVLink bandwidth
  std::vector<bool> gpu_failed;       // per GPU: true = lost, no layout may use it

  double speed(int gpu) const { return gpu_speed.empty() ? 1.0 : gpu_speed[gpu]; }
  double inter(int node) const { return node_inter_bw.empty() ? 1.0 : node_inter_bw[node]; }
  double intra(int node) const { return node_intra_bw.empty() ? 1.0 : node_intra_bw[node]; }
  bool failed(int gpu) const { return !gpu_failed.empty() && gpu_failed[gpu]; }
};

// Where conditions are not nominal: what evaluate() scans every GPU and node for, listed once
// so that many evaluations under the same conditions (a planner search costs hundreds of
// layouts) skip the scan.
struct OffNominal {
  std::vector<int> gpus;   // slowed or failed, ascending
  std::vector<int> nodes;  // with a bandwidth factor other than 1, ascending
};
// Fills `out` from `c` (reusing its memory).
void find_off_nominal(const Conditions& c, OffNominal& out);

// One iteration, split so that the parts add up to iteration_time_s: the critical replica's
// bottleneck pipeline rank runs its microbatches (compute, recompute, tensor-parallel
// collectives, pipeline p2p), the pipeline fill/drain adds the bubble, then the exposed part
// of the data-parallel reduction and the optimizer step.
struct CostBreakdown {
  bool feasible = false;  // false: the layout uses a failed GPU (see reason)
  std::string reason;     // why infeasible or why it does not fit; empty otherwise
  double iteration_time_s = 0;
  double compute_s = 0;            // forward + backward matmuls and element-wise work
  double recompute_s = 0;          // activation recomputation
  double tp_comm_s = 0;            // tensor/sequence-parallel collectives
  double cp_comm_s = 0;            // context-parallel ring transfers not hidden by attention
  double pp_comm_s = 0;            // pipeline point-to-point transfers on the critical path
  double bubble_s = 0;             // pipeline fill and drain (and waiting on slower stages)
  double dp_comm_s = 0;            // exposed data-parallel gradient reduction / ZeRO gathers
  double optimizer_s = 0;          // optimizer step
  // The GPU with the least headroom (the largest footprint / capacity): its footprint and its
  // capacity (on one GPU type, the largest footprint).
  double memory_gib = 0;
  double memory_capacity_gib = 0;
  bool fits_in_memory = false;
  double model_flops = 0;  // per iteration (SC'21 convention, see docs/cost-model.md)
  double tflops_per_gpu = 0;
  double mfu = 0;  // model FLOPs without recompute / (time * sum of peaks)
  double tokens_per_s = 0;
};

// Per-GPU memory, split by kind, in GiB.
struct MemoryBreakdown {
  double weights_gib = 0;
  double gradients_gib = 0;
  double optimizer_gib = 0;
  double activations_gib = 0;
  double reserved_gib = 0;  // runtime: CUDA context, allocator and communication buffers
  double total_gib() const {
    return weights_gib + gradients_gib + optimizer_gib + activations_gib + reserved_gib;
  }
};

// The timeline pieces of the critical replica, for traces and tests.
struct PipelineTimings {
  int replica = 0;                   // the slowest data-parallel replica
  int microbatches = 0;              // of that replica
  std::vector<double> forward_s;     // per chunk (pp * virtual_stages), one microbatch
  std::vector<double> backward_s;    // per chunk, one microbatch, recompute included
  std::vector<double> p2p_s;         // per chunk: sending its output to the next chunk
  std::vector<double> dp_exposed_s;  // per pipeline rank
  double optimizer_s = 0;
};

class CostModel {
 public:
  CostModel(ModelSpec model, ClusterSpec cluster);

  const ModelSpec& model() const { return model_; }
  const ClusterSpec& cluster() const { return cluster_; }
  const ClusterTopology& topology() const { return topo_; }

  // Predicts one iteration. The strategy must be legal (find_problem() returned nullopt):
  // evaluate() does not re-validate it. A layout touching a failed GPU is returned with
  // feasible = false and an infinite iteration time.
  CostBreakdown evaluate(const Strategy& s, const Conditions& c = {}) const;
  // The same, with `where` found from `c` by find_off_nominal (not checked).
  CostBreakdown evaluate(const Strategy& s, const Conditions& c, const OffNominal& where) const;

  // The same prediction as evaluate(), obtained by timing every replica and pipeline rank one
  // by one instead of once per class of identical replicas. Slower; the reference the tests
  // hold evaluate() to.
  CostBreakdown evaluate_exhaustive(const Strategy& s, const Conditions& c = {}) const;

  // Memory of the GPUs of one pipeline rank in one replica.
  MemoryBreakdown memory(const Strategy& s, int replica, int pp_rank) const;

  // Timeline pieces used by the Chrome-trace export (allocates; not for hot loops).
  PipelineTimings pipeline_timings(const Strategy& s, const Conditions& c = {}) const;

  // One transformer block and microbatch of `s` on GPU type `type` at nominal speed: the flash
  // attention kernel's forward and backward time, and the key/value bytes a context rank passes
  // at each ring step. With the ring's links, what exposed_cp_ring_s (cost_formulas.h) needs;
  // the planner's bounds price the ring with it exactly as evaluate() does.
  struct RingAttention {
    double attention_fwd_s = 0, attention_bwd_s = 0, kv_block_bytes = 0;
  };
  RingAttention ring_attention(int type, const Strategy& s) const;

 private:
  struct BlockTimes;
  struct Work;
  struct Placement;
  // What a layout's replicas share regardless of conditions (cached per thread; the
  // reference returned stays valid until the calling thread's next call).
  const Placement& placement(const Strategy& s) const;
  // placement()'s phases, filling a new cache entry in this order.
  void place_ranks(Placement& l, const Strategy& s) const;
  void classify_replicas(Placement& l) const;
  void find_dp_groups(Placement& l) const;
  BlockTimes block_times(int type, const Strategy& s) const;
  struct RankMemory;
  // memory() split in two: what does not depend on the replica's share, then the rest for a
  // replica with `microbatches` microbatches.
  RankMemory rank_memory(const Strategy& s, int pp_rank) const;
  MemoryBreakdown memory(const Strategy& s, const RankMemory& rank, int microbatches) const;
  // 0 when a context-parallel ring whose cp ranks start on `nodes` stays in one node, else the
  // node classes of its slowest network end (its transfers) and of its slowest NVLink (the
  // pace of its ranks' tensor-parallel collectives), each plus 1.
  unsigned long long cp_ring_class(const int* nodes, int cp) const;
  // One evaluation's phases (cost_model.cc).
  struct Evaluation;
  void run(const Strategy& s, const Conditions& c, Work& work) const;

  ModelSpec model_;
  ClusterSpec cluster_;
  ClusterTopology topo_;
  // Per node: an id shared by the nodes of one GPU type and the same link bandwidths.
  std::vector<int> node_class_;
  std::vector<int> class_first_node_;  // per node class: its first node
  unsigned long long id_;  // names this model's topology in the per-thread layout cache
};

}  // namespace parapilot
