// The planner's search, split by job over planner_search.cc (shapes, bounds and the ranking),
// planner_placement.cc (tensor-parallel groups and their placement) and
// planner_compression.cc (per-layer gradient compression). Internal to strategy/: the public
// contract is strategy/planner.h.
//
// A Search lives for one Planner::plan() call on one thread; it borrows per-thread scratch
// buffers (a search never runs inside another).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "strategy/cost_model.h"
#include "strategy/partitioner.h"
#include "strategy/planner.h"
#include "strategy/space.h"

namespace parapilot {

// Per-microbatch times on one tensor-parallel group of a GPU type at nominal speed, read off
// the cost model: one transformer block (forward + backward + recompute), the embedding on the
// first rank, the final norm + logits + loss on the last rank.
struct BlockCosts {
  double block_s = 0;  // without the tensor-parallel collectives and the ring
  double embedding_s = 0;
  double logits_s = 0;
  CostModel::RingAttention ring;  // what the context-parallel ring hides under
};

// Block costs keyed by (GPU type, tp, microbatch, sp, recompute), shared by every plan() call
// of a Planner and its copies.
// (GPU type, tp, cp, microbatch, sp, recompute); the kernel settings are the search's own.
using BlockKey = std::tuple<int, int, int, int, bool, Recompute, Attention, bool, bool>;

struct BlockCostCache {
  std::mutex mutex;
  std::map<BlockKey, BlockCosts> costs;
};

namespace planner_internal {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr int kDefaultMaxVirtualStages = 8;

// A stage's GPUs: tp x cp usable GPUs of one type (cp tensor-parallel groups side by side),
// inside one node or filling whole nodes.
struct Group {
  int first = 0;       // index into the flat GPU list
  int node = 0;        // its node whose NVLink is slowest (the pace of its tp collectives)
  int first_node = 0;  // the node of its first GPU (its end of point-to-point links)
  int type = 0;
  double slow = 1;  // 1 / speed of its slowest member
  double speed_proxy = 0;
  // One step of its context-parallel ring: NVLink inside a node, else the network at its
  // slowest node's end (as the cost model prices it).
  double ring_latency_s = 0, ring_s_per_byte = 0;
};

// Which group runs (replica, pipeline rank): group[r * pp + p].
struct Placement {
  int dp = 0, pp = 0, tp = 0, cp = 1;
  std::vector<int> group;  // index into the groups of its tp
  // Per slot r * pp + p: the group's GPU type and slowness.
  std::vector<int> type;
  std::vector<double> slow;
  unsigned types_used = 0;  // bit k: some slot has GPU type k (k < 8)
  // Per replica: the first replica of its run of replicas whose slots match slot for slot in
  // type, slowness, NVLink class and, with cp > 1, ring links (without context parallelism
  // there is no ring to time): their bounds are equal, computed once.
  std::vector<int> like_replica;
  // Distinct NVLink speeds among the slots (tp collectives differ only by those).
  std::vector<int> slot_link, link_node;
  // Filled when a shape of the placement is first evaluated (most never are):
  bool detailed = false;
  // Point-to-point link of each slot to its pipeline successor and predecessor (cyclic, for
  // interleaving): latency and seconds per byte.
  std::vector<double> next_latency_s, next_s_per_byte, prev_latency_s, prev_s_per_byte;
  std::vector<int> gpus;  // explicit GPU list for Strategy::gpus (empty = default order)
  // The replicas whose costs differ, whatever the shape, from the previous replica's, in
  // order: replica 0 alone when every replica's slots match replica 0's (type, slowness,
  // links); otherwise replica 0 and each replica that is not like the previous one (same
  // like_replica) with the same pipeline links slot for slot. A replica left out costs the
  // same as the one before it, term by term.
  std::vector<int> cost_leaders;
  std::vector<double> capacity_gib;  // per pipeline rank: the least memory among its GPUs
};

struct Family {
  int tp, pp, dp, cp;
  bool sp;
  Schedule schedule;
  Recompute recompute;
  auto key() const { return std::tie(tp, pp, dp, cp, sp, schedule, recompute); }
  bool operator<(const Family& o) const { return key() < o.key(); }
  bool operator==(const Family& o) const { return key() == o.key(); }
};

inline Family family_of(const Strategy& s) {
  return Family{s.tp, s.pp, s.dp, s.cp, s.sp, s.schedule, s.recompute};
}

// One layout to evaluate before its boundaries and shares are chosen.
struct Shape {
  double upper_tokens_per_s;  // bound on its throughput (branch and bound)
  int placement;              // index into the search's placements
  int tp;
  int cp;
  bool sp;
  Schedule schedule;
  int v;
  Recompute recompute;
  int zero;
  int mb;
  int global_batch;
};

// Buffers the searches of one thread reuse (a search never runs inside another).
struct SearchScratch {
  std::vector<Placement> placements;  // the running search's first placement_count_
  // Indexed by a stage's GPU count tp x cp: its groups, their GPUs group after group, the
  // group indices fastest first (stable) and the group speeds they were sorted by.
  std::vector<std::vector<Group>> groups;
  std::vector<std::vector<int>> flat_gpus;
  std::vector<std::vector<int>> speed_order;
  std::vector<std::vector<double>> speed_order_keys;
  // Per node, this search's point-to-point latency and seconds per byte over NVLink, and over
  // the network when the node's end is the slower one; and its network bandwidth per GPU
  // (nominal GB/s times the conditions' factor), which picks the slower end of a link.
  std::vector<double> intra_latency_s, intra_s_per_byte, inter_latency_s, inter_s_per_byte;
  std::vector<double> inter_GBps;
  std::vector<double> inverse_speed;  // per GPU, this search's 1 / speed
  // This search's usable GPUs, node after node: node n's are usable[usable_first[n] ..
  // usable_first[n + 1]).
  std::vector<int> usable, usable_first;
  std::vector<int> chosen, replicas;
  std::vector<std::vector<int>> by_type;
  std::vector<double> type_block_s, link_speed;
  // Per node: this search's NVLink speed (intra_GBps x its factor), and its class in the
  // placement being finished, valid where node_link_stamp equals link_stamp.
  std::vector<double> node_link_speed;
  std::vector<int> node_link;
  std::vector<unsigned long> node_link_stamp;
  unsigned long link_stamp = 0;
  std::vector<Shape> shapes;  // the running search's
};

// Indices 0 .. speed.size() - 1 of groups with those speeds, fastest first: exactly the order
// std::stable_sort gives them when a goes before b if speed[a] > speed[b] * (1 + 1e-12) (speeds
// within that tolerance count as equal). Into order, resized.
void speed_order(const std::vector<double>& speed, std::vector<int>& order);

// Shapes that differ only in microbatch and global batch: a microbatch that does not fit rules
// out every larger one.
using FitKey = std::tuple<int, int, bool, Schedule, int, Recompute, int>;

inline FitKey fit_key(const Shape& shape) {
  return {shape.placement, shape.tp,        shape.sp,  shape.schedule,
          shape.v,         shape.recompute, shape.zero};
}

// One ranking of layout families: the search keeps one for every layout in the space and, when
// ZeRO-0 variants are searched as well (docs/planner.md), one for the ZeRO-0 layouts alone.
// Each prunes by its own K-th best family, exactly as a search over its layouts alone would.
struct Track {
  int top_k = 1;
  bool zero0_only = false;
  std::map<Family, Candidate> best;  // best layout per family
  std::vector<double> top;           // best throughput per family, for the K-th best
  std::map<FitKey, int> no_fit_mb;   // smallest microbatch known not to fit, per shape kind
  double kth = 0;     // K-th best family throughput so far (0 until K families are known)
  // Families finish() ranks: K, or 2K when compression may reorder the leaders; and the
  // keep-th best family throughput so far (0 until `keep` families are known). A layout below
  // it can change nothing finish() returns.
  int keep = 1;
  double keep_kth = 0;
  bool done = false;  // no remaining layout can enter its top K
  bool covers(const Shape& shape) const { return !zero0_only || shape.zero == 0; }
};

// What evaluating one shape gave: nothing to record, a layout that cannot fit (memory or
// partition), one whose pipeline alone is too slow to matter (not costed), or a costed layout.
struct Outcome {
  enum class Kind { kNone, kNoFit, kBelow, kEvaluated } kind = Kind::kNone;
  Strategy strategy;
  CostBreakdown cost;
};

// Whether the search keeps ZeRO-0 variants as well (docs/planner.md): the request asks for it,
// compression may be chosen, the statistics let some block take top-k or PowerSGD (error
// within the budget, as choose_compression requires) and the space has ZeRO 0 next to other
// stages.
bool searches_zero0_variants(const PlanRequest& req, int layers);

// Whether tp splits the model's heads and key/value heads.
bool tp_legal(int tp, const ModelSpec& model);

// Everything one plan() call computes and reuses.
class Search {
 public:
  Search(const ModelSpec& model, const CostModel& cost, const std::vector<CostModel>& probes,
         BlockCostCache& shared_block_costs, const PlanRequest& request)
      : model_(model),
        cost_(cost),
        probes_(probes),
        shared_block_costs_(shared_block_costs),
        topo_(cost.topology()),
        req_(request),
        c_(request.conditions),
        space_(request.space),
        scratch_(thread_scratch()),
        shapes_(scratch_.shapes) {
    shapes_.clear();
    find_off_nominal(c_, off_nominal_);
    // How the job runs its kernels is not the planner's choice: the current layout's, if any.
    if (request.current) {
      kernels_.attention = request.current->attention;
      kernels_.fp8 = request.current->fp8;
      kernels_.tp_comm_overlap = request.current->tp_comm_overlap;
      kernels_.overlap_param_gather = request.current->overlap_param_gather;
      kernels_.overlap_grad_reduce = request.current->overlap_grad_reduce;
    }
  }

  PlanResult run();

 private:
  const BlockCosts& block_costs(int type, int tp, int cp, int mb, bool sp, Recompute rc);
  double tp_comm_per_block_s(int node, int tp, int cp, int mb, Recompute rc) const;
  // The exposed ring attention of one block and microbatch on group g (0 without cp).
  static double cp_ring_per_block_s(const Group& g, const BlockCosts& bc, int cp, double slow,
                                    Recompute rc);
  double nvlink_s(int node, double bytes) const;
  double network_link_s(int slower_node, double bytes) const;
  std::vector<int> global_batches(int dp, int mb, int unit) const;
  void make_groups(int tp, int cp);
  // An upper bound on the throughput of every layout of (tp, cp) in the space.
  double pair_bound(int tp, int cp);
  void add_placements(int tp, int cp, int pp, int dp);
  void add_shapes(int placement_index);
  // add_shapes' pieces: the values of each axis, the replica runs' rates (cached per sp), the
  // (microbatch, global batch) pairs.
  struct ShapeAxes {
    std::vector<bool> sps;
    std::vector<Recompute> rcs;
    std::vector<int> zeros;
    std::vector<Schedule> schedules;
  };
  const ShapeAxes& shape_axes(int tp) const;
  struct RateCache {
    struct Rates {
      Recompute rc;
      int mb;
      double sum_rate;
      size_t at;  // store[at + 2i] = run i's rate, store[at + 2i + 1] its beta_min
    };
    std::vector<Rates> rates;
    std::vector<double> store;
  };
  const RateCache::Rates& rates_of(const Placement& pl, const std::vector<int>& like_begin,
                                   RateCache& cache, bool sp, Recompute rc, int mb);
  const std::vector<std::pair<int, int>>& batches_of(int dp, int unit) const;
  // run()'s phases: the placements and shapes of one (tp, cp); branch and bound over
  // shapes_[from, end); the final ranking of the tracks' candidates.
  void add_pair(int tp, int cp, int max_node, int max_pp);
  void branch_and_bound(size_t from);
  std::vector<Candidate> rank_candidates(bool with_zero0);
  Placement& new_placement(int tp, int cp, int pp, int dp);
  const Placement& detailed(int placement_index);
  // Boundaries and shares of `shape`, then its cost; kBelow, not costed, when its pipeline
  // time alone bounds its throughput below `floor_tokens_per_s`.
  Outcome evaluate_shape(const Shape& shape, double floor_tokens_per_s);
  // The stage boundaries and elastic shares of `shape` on placement `pl` within
  // pipeline_.max_blocks (total microbatches in multiples of unit), into pipeline_; false when
  // no boundaries fit the block limits.
  bool split_pipeline(const Shape& shape, const Placement& pl, int total, int unit);
  // split_pipeline's first phase: the rank costs of each run of like replicas (run k is replicas
  // run_begin[k] .. run_begin[k + 1] - 1, its costs costs[k * pp .. (k + 1) * pp)). Per thread;
  // valid until the calling thread's next call.
  struct ReplicaRuns {
    std::vector<RankCost> costs;
    std::vector<int> run_begin;  // runs + 1 entries, the last dp
    int runs = 0;
  };
  const ReplicaRuns& replica_runs(const Shape& shape, const Placement& pl);
  static SearchScratch& thread_scratch() {
    thread_local SearchScratch scratch;
    return scratch;
  }
  // Records the outcome of `shape` on a track that takes it. The tracks that take a shape share
  // its outcome; the last of them (`last_taker`) may move the outcome's strategy out.
  void record(Track& track, const Shape& shape, Outcome& outcome, bool last_taker);
  std::vector<Candidate> finish(const Track& track);
  void choose_compression(Candidate& c);

  const ModelSpec& model_;
  const CostModel& cost_;
  const std::vector<CostModel>& probes_;
  BlockCostCache& shared_block_costs_;
  const ClusterTopology& topo_;
  const PlanRequest& req_;
  const Conditions& c_;
  OffNominal off_nominal_;  // of c_: every layout the search costs is costed under c_
  const SearchSpace& space_;

  Strategy kernels_;  // attention, fp8 and overlap settings every searched layout takes
  std::map<BlockKey, BlockCosts> block_cache_;
  SearchScratch& scratch_;
  size_t placement_count_ = 0;  // placements of this search: scratch_.placements[0, count)
  bool links_ready_ = false;    // scratch_'s per-node links hold this search's conditions
  // scratch_.inverse_speed, usable, usable_first and node_link_speed hold this search's
  // conditions
  bool gpus_ready_ = false;
  std::vector<Shape>& shapes_;  // scratch_.shapes
  std::vector<Track> tracks_;
  // Compression chosen per candidate, shared by the tracks (a family's best layout is often
  // its best ZeRO-0 one too).
  std::vector<std::pair<Strategy, Candidate>> compressed_;  // (uncompressed layout, result)
  long evaluated_ = 0;
  long pruned_ = 0;

  // What a shape's pipeline depends on: everything but its ZeRO stage (and the block limits).
  using PipelineKey = std::tuple<int, int, int, bool, Schedule, int, Recompute, int, int>;
  // The last split_pipeline() and what it was for.
  struct SplitPipeline {
    PipelineKey key{-1, 0, 0, false, Schedule::k1F1B, 0, Recompute::kNone, 0, 0};
    std::vector<int> max_blocks;
    bool fits = false;
    std::vector<int> counts;  // blocks per pipeline rank
    std::vector<int> micro;   // microbatches per replica
    double pipeline_s = 0;    // the slowest replica's pipeline time
  } pipeline_;
};

}  // namespace planner_internal
}  // namespace parapilot
