#include "strategy/planner.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "strategy/error.h"
#include "strategy/partitioner.h"

namespace parapilot {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr int kDefaultMaxVirtualStages = 8;

double ring_allreduce_s(int n, double bytes, double bw_Bps, double latency_s) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) * latency_s + 2.0 * (n - 1) / n * bytes / bw_Bps;
}

// Gradient bytes per parameter as the cost model accounts them (fp32 buffer for bf16 models).
double grad_bytes_per_param(const ModelSpec& model) {
  return model.dtype == DType::kBF16 ? 4.0 : 2.0;
}

// Per-microbatch times on one tensor-parallel group of a GPU type at nominal speed, read off
// the cost model: one transformer block (forward + backward + recompute), the embedding on the
// first rank, the final norm + logits + loss on the last rank.
struct BlockCosts {
  double block_s = 0;
  double embedding_s = 0;
  double logits_s = 0;
};

}  // namespace

struct BlockCostCache {
  std::mutex mutex;
  std::map<std::tuple<int, int, int, bool, Recompute>, BlockCosts> costs;
};

namespace {

// A tensor-parallel group: tp usable GPUs inside one node.
struct Group {
  int first = 0;  // index into the flat GPU list
  int node = 0;
  int type = 0;
  double slow = 1;  // 1 / speed of its slowest member
  double speed_proxy = 0;
};

// Which group runs (replica, pipeline rank): group[r * pp + p].
struct Placement {
  int dp = 0, pp = 0, tp = 0;
  std::vector<int> group;  // index into the groups of its tp
  // Per slot r * pp + p: the group's GPU type and slowness.
  std::vector<int> type;
  std::vector<double> slow;
  unsigned types_used = 0;  // bit k: some slot has GPU type k (k < 8)
  // Distinct NVLink speeds among the slots (tp collectives differ only by those).
  std::vector<int> slot_link, link_node;
  // Filled when a shape of the placement is first evaluated (most never are):
  bool detailed = false;
  // Point-to-point link of each slot to its pipeline successor and predecessor (cyclic, for
  // interleaving): latency and seconds per byte.
  std::vector<double> next_latency_s, next_s_per_byte, prev_latency_s, prev_s_per_byte;
  std::vector<int> gpus;  // explicit GPU list for Strategy::gpus (empty = default order)
};

// Buffers the searches of one thread reuse (a search never runs inside another).
struct SearchScratch {
  std::vector<Placement> placements;        // the running search's first placement_count_
  std::vector<std::vector<Group>> groups;   // per tp: its tensor-parallel groups
  std::vector<std::vector<int>> flat_gpus;  // per tp: the GPUs of its groups, group after group
  // Per tp: group indices fastest first (stable), and the group speeds it was sorted by.
  std::vector<std::vector<int>> speed_order;
  std::vector<std::vector<double>> speed_order_keys;
  // Per node, this search's point-to-point latency and seconds per byte over NVLink, and over
  // the network when the node's end is the slower one.
  std::vector<double> intra_latency_s, intra_s_per_byte, inter_latency_s, inter_s_per_byte;
  std::vector<int> usable, chosen, replicas;
  std::vector<std::vector<int>> by_type;
  std::vector<double> type_block_s, link_speed;
};

struct Family {
  int tp, pp, dp;
  bool sp;
  Schedule schedule;
  Recompute recompute;
  auto key() const { return std::tie(tp, pp, dp, sp, schedule, recompute); }
  bool operator<(const Family& o) const { return key() < o.key(); }
  bool operator==(const Family& o) const { return key() == o.key(); }
};

Family family_of(const Strategy& s) {
  return Family{s.tp, s.pp, s.dp, s.sp, s.schedule, s.recompute};
}

// One layout to evaluate before its boundaries and shares are chosen.
struct Shape {
  double upper_tokens_per_s;  // bound on its throughput (branch and bound)
  int placement;              // index into the search's placements
  int tp;
  bool sp;
  Schedule schedule;
  int v;
  Recompute recompute;
  int zero;
  int mb;
  int global_batch;
};

// Shapes that differ only in microbatch and global batch: a microbatch that does not fit rules
// out every larger one.
using FitKey = std::tuple<int, int, bool, Schedule, int, Recompute, int>;

FitKey fit_key(const Shape& shape) {
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
  bool done = false;  // no remaining layout can enter its top K
  bool covers(const Shape& shape) const { return !zero0_only || shape.zero == 0; }
};

// What evaluating one shape gave: nothing to record, a layout that cannot fit (memory or
// partition), or a costed layout.
struct Outcome {
  enum class Kind { kNone, kNoFit, kEvaluated } kind = Kind::kNone;
  Strategy strategy;
  CostBreakdown cost;
};

// Blocks per chunk of the balanced layout, as the cost model resolves an empty stage list:
// as even as possible, the remainder on the middle chunks (the ends carry embedding and logits).
std::vector<int> balanced_chunks(int layers, int chunks) {
  std::vector<int> out(chunks, layers / chunks);
  const int remainder = layers % chunks;
  const int first_extra = (chunks - remainder) / 2;
  for (int c = first_extra; c < first_extra + remainder; ++c) out[c] += 1;
  return out;
}

std::vector<int> resolved_chunks(const Strategy& s, int layers) {
  return s.stage_layers.empty() ? balanced_chunks(layers, s.num_chunks()) : s.stage_layers;
}

// Whether the search keeps ZeRO-0 variants as well (docs/planner.md): the request asks for it,
// compression may be chosen, the statistics let some block take top-k or PowerSGD (error
// within the budget, as choose_compression requires) and the space has ZeRO 0 next to other
// stages.
bool searches_zero0_variants(const PlanRequest& req, int layers) {
  const SearchSpace& space = req.space;
  const GradientStats& g = req.gradients;
  if (!req.zero0_variants || !space.compression || g.empty()) return false;
  const std::vector<int>& zero = space.zero;
  const bool zero0_and_more =
      zero.empty() || (zero.size() > 1 && std::find(zero.begin(), zero.end(), 0) != zero.end());
  if (!zero0_and_more) return false;
  for (int l = 0; l < layers; ++l) {
    if (!g.topk_energy.empty() && 1.0 - g.topk_energy[l] <= g.error_budget) return true;
    if (!g.lowrank_residual.empty() && g.lowrank_residual[l] <= g.error_budget) return true;
  }
  return false;
}

bool tp_legal(int tp, const ModelSpec& model) {
  return model.heads % tp == 0 && (model.kv_heads % tp == 0 || tp % model.kv_heads == 0);
}

}  // namespace

Planner::Planner(ModelSpec model, ClusterSpec cluster)
    : model_(std::move(model)),
      cluster_(std::move(cluster)),
      cost_(model_, cluster_),
      block_cache_(std::make_shared<BlockCostCache>()) {
  const ClusterTopology& topo = cost_.topology();
  int max_node = 1;
  for (const auto& n : topo.nodes) max_node = std::max(max_node, n.gpus);
  ModelSpec probe_model = model_;
  probe_model.layers = 3;
  for (size_t k = 0; k < topo.types.size(); ++k) {
    const ClusterTopology::Node* node = nullptr;
    for (const auto& n : topo.nodes) {
      if (n.type == static_cast<int>(k)) {
        node = &n;
        break;
      }
    }
    ClusterSpec probe;
    probe.name = "probe";
    NodeGroup g;
    g.count = 1;
    g.gpus_per_node = 2 * max_node;
    g.gpu = topo.types[k];
    g.intra_node_GBps = node->intra_GBps;
    g.inter_node_Gbps = node->inter_GBps * 8.0;
    probe.groups.push_back(g);
    probe.intra_node_latency_us = cluster_.intra_node_latency_us;
    probe.inter_node_latency_us = cluster_.inter_node_latency_us;
    probe.intra_node_efficiency = cluster_.intra_node_efficiency;
    probe.inter_node_efficiency = cluster_.inter_node_efficiency;
    probes_.emplace_back(probe_model, probe);
  }
}

namespace {

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
        scratch_(thread_scratch()) {}

  PlanResult run();

 private:
  const BlockCosts& block_costs(int type, int tp, int mb, bool sp, Recompute rc);
  double tp_comm_per_block_s(int node, int tp, int mb, Recompute rc) const;
  double nvlink_s(int node, double bytes) const;
  int slower_end(int node_a, int node_b) const;
  double network_link_s(int slower_node, double bytes) const;
  std::vector<int> global_batches(int dp, int mb, int unit) const;
  void make_groups(int tp);
  void add_placements(int tp, int pp, int dp);
  void add_shapes(int placement_index, int tp);
  Placement& new_placement(int tp, int pp, int dp);
  const Placement& detailed(int placement_index);
  Outcome evaluate_shape(const Shape& shape);
  static SearchScratch& thread_scratch() {
    thread_local SearchScratch scratch;
    return scratch;
  }
  void record(Track& track, const Shape& shape, const Outcome& outcome);
  std::vector<Candidate> finish(const Track& track);
  void choose_compression(Candidate& c);

  const ModelSpec& model_;
  const CostModel& cost_;
  const std::vector<CostModel>& probes_;
  BlockCostCache& shared_block_costs_;
  const ClusterTopology& topo_;
  const PlanRequest& req_;
  const Conditions& c_;
  const SearchSpace& space_;

  std::map<std::tuple<int, int, int, bool, Recompute>, BlockCosts> block_cache_;
  SearchScratch& scratch_;
  size_t placement_count_ = 0;  // placements of this search: scratch_.placements[0, count)
  bool links_ready_ = false;    // scratch_'s per-node links hold this search's conditions
  std::vector<Shape> shapes_;
  std::vector<Track> tracks_;
  // Compression chosen per candidate, shared by the tracks (a family's best layout is often
  // its best ZeRO-0 one too).
  std::vector<std::pair<Strategy, Candidate>> compressed_;  // (uncompressed layout, result)
  long evaluated_ = 0;
  long pruned_ = 0;
};

const BlockCosts& Search::block_costs(int type, int tp, int mb, bool sp, Recompute rc) {
  auto key = std::make_tuple(type, tp, mb, sp, rc);
  auto it = block_cache_.find(key);
  if (it != block_cache_.end()) return it->second;
  {
    std::lock_guard<std::mutex> lock(shared_block_costs_.mutex);
    auto shared = shared_block_costs_.costs.find(key);
    if (shared != shared_block_costs_.costs.end()) {
      return block_cache_.emplace(key, shared->second).first->second;
    }
  }
  const CostModel& probe = probes_[type];
  Strategy s;
  s.dp = 1;
  s.tp = tp;
  s.pp = 1;
  s.sp = sp;
  s.microbatch_size = mb;
  s.global_batch = mb;
  s.recompute = rc;
  s.zero = 0;
  for (int g = 0; g < tp; ++g) s.gpus.push_back(g);
  const CostBreakdown whole = probe.evaluate(s);
  const double all_compute = whole.compute_s + whole.recompute_s;  // 3 blocks + ends
  const double tpc = whole.tp_comm_s / 3.0;
  s.pp = 2;
  for (int g = tp; g < 2 * tp; ++g) s.gpus.push_back(g);
  s.stage_layers = {1, 2};
  const PipelineTimings one = probe.pipeline_timings(s);
  s.stage_layers = {2, 1};
  const PipelineTimings two = probe.pipeline_timings(s);
  const double first1 = one.forward_s[0] + one.backward_s[0];  // block + embedding + tp
  const double first2 = two.forward_s[0] + two.backward_s[0];  // 2 blocks + embedding + 2 tp
  BlockCosts out;
  out.block_s = first2 - first1 - tpc;
  out.embedding_s = std::max(0.0, first1 - out.block_s - tpc);
  out.logits_s = std::max(0.0, all_compute - 3.0 * out.block_s - out.embedding_s);
  {
    std::lock_guard<std::mutex> lock(shared_block_costs_.mutex);
    shared_block_costs_.costs.emplace(key, out);
  }
  return block_cache_.emplace(key, out).first->second;
}

// Mirrors the cost model: 4 collectives per block (6 with full recompute) over NVLink.
double Search::tp_comm_per_block_s(int node, int tp, int mb, Recompute rc) const {
  if (tp <= 1) return 0;
  const double bytes = static_cast<double>(mb) * model_.seq_len * model_.hidden * 2.0;
  const double bw = topo_.nodes[node].intra_GBps * 1e9 * topo_.intra_efficiency * c_.intra(node);
  const int collectives = 4 + (rc == Recompute::kFull ? 2 : 0);
  return collectives * ring_allreduce_s(tp, bytes, bw, topo_.intra_latency_s);
}

// One p2p message between two GPUs of a node.
double Search::nvlink_s(int node, double bytes) const {
  const double bw = topo_.nodes[node].intra_GBps * 1e9 * topo_.intra_efficiency * c_.intra(node);
  return topo_.intra_latency_s + bytes / bw;
}

// The node whose network bandwidth a link between two nodes runs at (std::min's choice).
int Search::slower_end(int na, int nb) const {
  const double a = topo_.nodes[na].inter_GBps * c_.inter(na);
  const double b = topo_.nodes[nb].inter_GBps * c_.inter(nb);
  return b < a ? nb : na;
}

double Search::network_link_s(int slower, double bytes) const {
  const double bw =
      topo_.nodes[slower].inter_GBps * c_.inter(slower) * 1e9 * topo_.inter_efficiency;
  return topo_.inter_latency_s + bytes / bw;
}

// Global batches to try for dp replicas of microbatch mb whose microbatch counts are multiples
// of unit (elastic shares need only a multiple of mb * unit, with at least one unit each).
std::vector<int> Search::global_batches(int dp, int mb, int unit) const {
  const int step = mb * unit;
  if (space_.global_batch > 0) {
    const int b = space_.global_batch;
    if (b % step == 0 && b >= dp * step) return {b};
    return {};
  }
  const int hi = space_.global_batch_max / step * step;
  if (hi >= space_.global_batch_min && hi >= dp * step) {
    // Prefer a batch that splits evenly, when the range has one close to the top.
    const int even = space_.global_batch_max / (step * dp) * (step * dp);
    if (even >= space_.global_batch_min && even > 0 && even != hi) return {hi, even};
    return {hi};
  }
  return {};
}

void Search::make_groups(int tp) {
  if (scratch_.groups.size() <= static_cast<size_t>(tp)) {
    scratch_.groups.resize(tp + 1);
    scratch_.flat_gpus.resize(tp + 1);
    scratch_.speed_order.resize(tp + 1);
    scratch_.speed_order_keys.resize(tp + 1);
  }
  std::vector<Group>& groups = scratch_.groups[tp];
  std::vector<int>& flat_gpus = scratch_.flat_gpus[tp];
  groups.clear();
  flat_gpus.clear();
  std::vector<int>& usable = scratch_.usable;
  for (int n = 0; n < topo_.num_nodes(); ++n) {
    const auto& node = topo_.nodes[n];
    usable.clear();
    for (int gpu = node.first_gpu; gpu < node.first_gpu + node.gpus; ++gpu) {
      if (!c_.failed(gpu)) usable.push_back(gpu);
    }
    for (size_t i = 0; i + tp <= usable.size(); i += tp) {
      Group g;
      g.first = static_cast<int>(flat_gpus.size());
      g.node = n;
      g.type = node.type;
      g.slow = 0;
      for (int t = 0; t < tp; ++t) {
        flat_gpus.push_back(usable[i + t]);
        g.slow = std::max(g.slow, 1.0 / c_.speed(usable[i + t]));
      }
      groups.push_back(g);
    }
  }
  // One block time per GPU type (negative: not looked up yet).
  std::vector<double>& type_block_s = scratch_.type_block_s;
  type_block_s.assign(topo_.types.size(), -1.0);
  for (auto& g : groups) {
    double& block_s = type_block_s[g.type];
    if (block_s < 0) block_s = block_costs(g.type, tp, 1, false, Recompute::kNone).block_s;
    g.speed_proxy = 1.0 / (block_s * g.slow);
  }
  // The order depends on the sequence of speeds alone: the same speeds as the last sort for
  // this tp (on this thread) give the same order.
  std::vector<int>& order = scratch_.speed_order[tp];
  std::vector<double>& keys = scratch_.speed_order_keys[tp];
  bool same = keys.size() == groups.size() && order.size() == groups.size();
  for (size_t i = 0; i < groups.size() && same; ++i) same = keys[i] == groups[i].speed_proxy;
  if (same) return;
  keys.clear();  // until the order below is complete
  const size_t n = groups.size();
  order.resize(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return groups[a].speed_proxy > groups[b].speed_proxy * (1 + 1e-12);
  });
  keys.resize(n);
  for (size_t i = 0; i < groups.size(); ++i) keys[i] = groups[i].speed_proxy;
}

// The next placement of this search, its per-slot vectors sized for dp * pp slots.
Placement& Search::new_placement(int tp, int pp, int dp) {
  std::vector<Placement>& pool = scratch_.placements;
  if (placement_count_ == pool.size()) pool.emplace_back();
  Placement& pl = pool[placement_count_++];
  const size_t used = static_cast<size_t>(dp) * pp;
  pl.dp = dp;
  pl.pp = pp;
  pl.tp = tp;
  pl.group.resize(used);
  pl.type.resize(used);
  pl.slow.resize(used);
  pl.slot_link.resize(used);
  pl.link_node.clear();
  pl.types_used = 0;
  pl.detailed = false;
  return pl;
}

void Search::add_placements(int tp, int pp, int dp) {
  const int used = dp * pp;
  const std::vector<int>& order = scratch_.speed_order[tp];
  const std::vector<Group>& groups = scratch_.groups[tp];

  // Per-slot type, slowness and NVLink speed class of a placement whose groups are set.
  auto finish = [&](Placement& pl) {
    std::vector<double>& link_speed = scratch_.link_speed;
    link_speed.clear();
    int last_node = -1, last_link = 0;
    for (int slot = 0; slot < used; ++slot) {
      const Group& g = groups[pl.group[slot]];
      pl.type[slot] = g.type;
      pl.slow[slot] = g.slow;
      if (g.type < 8) pl.types_used |= 1u << g.type;
      const int node = g.node;
      if (node != last_node) {  // the same node has the same speed, hence the same class
        const double speed = topo_.nodes[node].intra_GBps * c_.intra(node);
        size_t i = 0;
        while (i < link_speed.size() && link_speed[i] != speed) ++i;
        if (i == link_speed.size()) {
          link_speed.push_back(speed);
          pl.link_node.push_back(node);
        }
        last_node = node;
        last_link = static_cast<int>(i);
      }
      pl.slot_link[slot] = last_link;
    }
  };

  // Packed: replicas of similar speed (slow groups together; elastic shares absorb the rest).
  std::vector<int>& chosen = scratch_.chosen;
  if (space_.mixed_types_in_pipeline) {
    chosen.assign(order.begin(), order.begin() + used);
  } else {
    // Whole replicas per GPU type, fastest groups of each type first.
    std::vector<std::vector<int>>& by_type = scratch_.by_type;
    by_type.resize(topo_.types.size());
    for (auto& list : by_type) list.clear();
    for (int g : order) by_type[groups[g].type].push_back(g);
    std::vector<int>& replicas = scratch_.replicas;
    replicas.assign(by_type.size(), 0);
    int total = 0;
    for (size_t k = 0; k < by_type.size(); ++k) {
      replicas[k] = static_cast<int>(by_type[k].size()) / pp;
      total += replicas[k];
    }
    if (total < dp) return;
    // Drop whole replicas of the slowest groups until dp remain.
    for (int excess = total - dp; excess > 0; --excess) {
      int worst = -1;
      double worst_speed = kInf;
      for (size_t k = 0; k < by_type.size(); ++k) {
        if (replicas[k] == 0) continue;
        const double speed = groups[by_type[k][replicas[k] * pp - 1]].speed_proxy;
        if (speed < worst_speed) {
          worst_speed = speed;
          worst = static_cast<int>(k);
        }
      }
      --replicas[worst];
    }
    chosen.clear();
    for (size_t k = 0; k < by_type.size(); ++k) {
      chosen.insert(chosen.end(), by_type[k].begin(), by_type[k].begin() + replicas[k] * pp);
    }
  }
  {
    Placement& pl = new_placement(tp, pp, dp);
    std::copy(chosen.begin(), chosen.begin() + used, pl.group.begin());
    for (int r = 0; r < dp; ++r) {
      // Node order inside a replica.
      std::sort(pl.group.begin() + r * pp, pl.group.begin() + (r + 1) * pp);
    }
    finish(pl);
  }
  // Spread: every replica gets the same mix, stage p from the p-th speed tier.
  bool uniform = true;
  for (int i = 1; i < used && uniform; ++i) {
    uniform = uniform &&
              std::abs(groups[chosen[i]].speed_proxy / groups[chosen[0]].speed_proxy - 1.0) < 1e-9;
  }
  if (!uniform && dp > 1 && pp > 1 && space_.mixed_types_in_pipeline) {
    Placement& pl = new_placement(tp, pp, dp);
    for (int r = 0; r < dp; ++r) {
      for (int p = 0; p < pp; ++p) pl.group[r * pp + p] = chosen[p * dp + r];
    }
    finish(pl);
  }
}

// A placement with its point-to-point links and GPU list, computed on first use.
const Placement& Search::detailed(int placement_index) {
  Placement& pl = scratch_.placements[placement_index];
  if (pl.detailed) return pl;
  const int dp = pl.dp, pp = pl.pp, tp = pl.tp, used = dp * pp;
  const std::vector<Group>& groups = scratch_.groups[tp];
  const std::vector<int>& flat_gpus = scratch_.flat_gpus[tp];
  for (auto* v :
       {&pl.next_latency_s, &pl.next_s_per_byte, &pl.prev_latency_s, &pl.prev_s_per_byte}) {
    v->resize(used);
  }
  std::vector<double>& intra_latency_s = scratch_.intra_latency_s;
  std::vector<double>& intra_s_per_byte = scratch_.intra_s_per_byte;
  std::vector<double>& inter_latency_s = scratch_.inter_latency_s;
  std::vector<double>& inter_s_per_byte = scratch_.inter_s_per_byte;
  if (!links_ready_) {
    const int nodes = topo_.num_nodes();
    for (auto* v : {&intra_latency_s, &intra_s_per_byte, &inter_latency_s, &inter_s_per_byte}) {
      v->resize(nodes);
    }
    for (int n = 0; n < nodes; ++n) {
      intra_latency_s[n] = nvlink_s(n, 0.0);
      intra_s_per_byte[n] = nvlink_s(n, 1.0) - intra_latency_s[n];
      inter_latency_s[n] = network_link_s(n, 0.0);
      inter_s_per_byte[n] = network_link_s(n, 1.0) - inter_latency_s[n];
    }
    links_ready_ = true;
  }
  // The link between the first GPUs of two slots' groups: latency and seconds per byte.
  auto link = [&](int slot, int other, double& latency_s, double& s_per_byte) {
    const int na = topo_.node_of_gpu[flat_gpus[groups[pl.group[slot]].first]];
    const int nb = topo_.node_of_gpu[flat_gpus[groups[pl.group[other]].first]];
    if (na == nb) {
      latency_s = intra_latency_s[na];
      s_per_byte = intra_s_per_byte[na];
    } else {
      const int slower = slower_end(na, nb);
      latency_s = inter_latency_s[slower];
      s_per_byte = inter_s_per_byte[slower];
    }
  };
  for (int slot = 0; slot < used; ++slot) {
    const int r = slot / pp, p = slot % pp;
    link(slot, r * pp + (p + 1) % pp, pl.next_latency_s[slot], pl.next_s_per_byte[slot]);
    link(slot, r * pp + (p + pp - 1) % pp, pl.prev_latency_s[slot], pl.prev_s_per_byte[slot]);
  }
  pl.gpus.resize(static_cast<size_t>(used) * tp);
  bool identity = used * tp == topo_.num_gpus();
  for (int r = 0; r < dp; ++r) {
    for (int p = 0; p < pp; ++p) {
      const Group& g = groups[pl.group[r * pp + p]];
      for (int t = 0; t < tp; ++t) {
        const int rank = (r * pp + p) * tp + t;
        pl.gpus[rank] = flat_gpus[g.first + t];
        identity = identity && pl.gpus[rank] == rank;
      }
    }
  }
  if (identity) pl.gpus.clear();
  pl.detailed = true;
  return pl;
}

void Search::add_shapes(int placement_index, int tp) {
  const Placement& pl = scratch_.placements[placement_index];
  const int dp = pl.dp, pp = pl.pp;
  const int layers = model_.layers;

  thread_local std::vector<bool> sps;
  sps = space_.sp;
  if (sps.empty()) sps = {false, true};
  // Sequence parallelism splits inside a tensor-parallel group: without one (tp = 1) it does
  // not exist, so a space asking only for sp = true still allows tp = 1 layouts.
  if (tp == 1) sps = {false};
  thread_local std::vector<Recompute> rcs;
  rcs = space_.recompute;
  if (rcs.empty()) rcs = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  thread_local std::vector<int> zeros;
  zeros = space_.zero;
  if (zeros.empty()) zeros = {0, 1, 2, 3};
  thread_local std::vector<Schedule> schedules;
  schedules = space_.schedule;
  if (schedules.empty()) schedules = {Schedule::k1F1B, Schedule::kInterleaved};
  // GPipe runs as fast as 1F1B in the cost model and never needs less memory.
  const bool has_1f1b =
      std::find(schedules.begin(), schedules.end(), Schedule::k1F1B) != schedules.end();

  bool type_used[8];
  for (int k = 0; k < 8; ++k) type_used[k] = (pl.types_used >> k & 1u) != 0;
  const std::vector<int>& slot_link = pl.slot_link;
  const std::vector<int>& link_node = pl.link_node;
  thread_local std::vector<double> link_tp_s;
  link_tp_s.resize(link_node.size());
  thread_local std::vector<int> vs;
  // (microbatch, global batch) pairs of one v, the same for every ZeRO stage and recompute.
  thread_local std::vector<std::pair<int, int>> batches;
  // Bounds of one v, per (recompute, pair): the same for every ZeRO stage.
  thread_local std::vector<double> bounds;
  // Per (recompute, microbatch) of one sp: each replica's sum of 1 / beta and fastest beta,
  // which every schedule and v share.
  struct Rates {
    Recompute rc;
    int mb;
    double sum_rate;
    size_t at;  // rate_store[at + 2r] = replica r's rate, rate_store[at + 2r + 1] its beta_min
  };
  thread_local std::vector<Rates> rates;
  thread_local std::vector<double> rate_store;
  auto rates_of = [&](bool sp, Recompute rc, int mb) -> const Rates& {
    for (const Rates& e : rates) {
      if (e.rc == rc && e.mb == mb) return e;
    }
    if (pp == 1) {  // one v only: nothing to share
      rates.clear();
      rate_store.clear();
    }
    double block_s[8];
    for (size_t t = 0; t < topo_.types.size() && t < 8; ++t) {
      block_s[t] = type_used[t] ? block_costs(static_cast<int>(t), tp, mb, sp, rc).block_s : 0;
    }
    for (size_t n = 0; n < link_node.size(); ++n) {
      link_tp_s[n] = tp_comm_per_block_s(link_node[n], tp, mb, rc);
    }
    const size_t at = rate_store.size();
    rate_store.resize(at + 2 * static_cast<size_t>(dp));
    double sum_rate = 0;
    for (int r = 0; r < dp; ++r) {
      double rate = 0, beta_min = kInf;
      for (int p = 0; p < pp; ++p) {
        const int slot = r * pp + p;
        const double beta = block_s[pl.type[slot]] * pl.slow[slot] + link_tp_s[slot_link[slot]];
        rate += 1.0 / beta;
        beta_min = std::min(beta_min, beta);
      }
      rate_store[at + 2 * r] = rate;
      rate_store[at + 2 * r + 1] = beta_min;
      sum_rate += rate;
    }
    rates.push_back(Rates{rc, mb, sum_rate, at});
    return rates.back();
  };

  for (bool sp : sps) {
    if (sp && (tp == 1 || model_.seq_len % tp != 0)) continue;
    if (!sp && tp > 1 && space_.sp.empty() && model_.seq_len % tp == 0) {
      continue;  // sequence parallelism: less memory and less element-wise time, same traffic
    }
    rates.clear();
    rate_store.clear();
    for (Schedule sched : schedules) {
      if (sched == Schedule::kGPipe && has_1f1b) continue;
      vs.assign(1, 1);
      if (sched == Schedule::kInterleaved) {
        if (pp < 2) continue;
        vs.clear();
        if (!space_.virtual_stages.empty()) {
          for (int v : space_.virtual_stages) {
            if (v >= 2 && pp * v <= layers) vs.push_back(v);
          }
        } else {
          for (int v = 2; v <= kDefaultMaxVirtualStages && pp * v <= layers; ++v) vs.push_back(v);
        }
      }
      for (int v : vs) {
        const int unit = sched == Schedule::kInterleaved ? pp : 1;
        // Microbatch sizes: listed, or every divisor of the largest batch in play.
        batches.clear();
        auto add_batches = [&](int mb) {
          for (int batch : global_batches(dp, mb, unit)) batches.emplace_back(mb, batch);
        };
        if (!space_.microbatch_size.empty()) {
          for (int mb : space_.microbatch_size) add_batches(mb);
        } else {
          const int b = space_.global_batch > 0 ? space_.global_batch : space_.global_batch_max;
          for (int mb = 1; mb * dp * unit <= b; ++mb) {
            if (space_.global_batch_max > 0 || b % mb == 0) add_batches(mb);
            if (space_.global_batch_max > 0 && mb >= 64) break;
          }
        }
        bounds.clear();
        bool have_bounds = false;
        for (int zero : zeros) {
          if (zero >= 2 && pp > 1) continue;
          if (zero > 0 && dp == 1 && space_.zero.empty()) continue;  // nothing to shard
          size_t k = 0;
          for (Recompute rc : rcs) {
            bool have_rates = false;
            int last_mb = 0;
            double sum_rate = 0, weighted = 0;
            for (const auto& [mb, batch] : batches) {
              double upper_tokens_per_s;
              if (have_bounds) {
                upper_tokens_per_s = bounds[k];
              } else {
                // Bound: no stage can beat L / sum(1/beta) per microbatch and replica; the
                // pipeline adds at least (sum - max) / v (see docs/planner.md).
                // The rates depend on the microbatch, not the batch.
                if (!have_rates || mb != last_mb) {
                  const Rates& e = rates_of(sp, rc, mb);
                  const double* rate_beta = rate_store.data() + e.at;
                  sum_rate = e.sum_rate;
                  weighted = 0;
                  for (int r = 0; r < dp; ++r) {
                    weighted += layers * rate_beta[2 * r + 1] / v * rate_beta[2 * r];
                  }
                  have_rates = true;
                  last_mb = mb;
                }
                const int total = batch / mb;
                const double bound_s =
                    (layers * (total - static_cast<double>(dp) / v) + weighted) / sum_rate;
                upper_tokens_per_s = static_cast<double>(batch) * model_.seq_len / bound_s;
                bounds.push_back(upper_tokens_per_s);
              }
              ++k;
              Shape shape;
              shape.upper_tokens_per_s = upper_tokens_per_s;
              shape.placement = placement_index;
              shape.tp = tp;
              shape.sp = sp;
              shape.schedule = sched;
              shape.v = v;
              shape.recompute = rc;
              shape.zero = zero;
              shape.mb = mb;
              shape.global_batch = batch;
              shapes_.push_back(shape);
            }
          }
          have_bounds = true;
        }
      }
    }
  }
}

void Search::record(Track& track, const Shape& shape, const Outcome& outcome) {
  if (outcome.kind == Outcome::Kind::kNone) return;
  const CostBreakdown& b = outcome.cost;
  if (outcome.kind == Outcome::Kind::kNoFit || (b.feasible && !b.fits_in_memory)) {
    auto [it, inserted] = track.no_fit_mb.emplace(fit_key(shape), shape.mb);
    if (!inserted) it->second = std::min(it->second, shape.mb);
  }
  if (outcome.kind != Outcome::Kind::kEvaluated || !b.feasible || !b.fits_in_memory) return;
  const Strategy& s = outcome.strategy;
  const Family f = family_of(s);
  auto it = track.best.find(f);
  if (it == track.best.end()) {
    track.best.emplace(f, Candidate{s, b, 0, 0});
  } else if (b.tokens_per_s > it->second.cost.tokens_per_s) {
    it->second = Candidate{s, b, 0, 0};
  } else {
    return;
  }
  track.top.clear();
  for (const auto& [key, cand] : track.best) track.top.push_back(cand.cost.tokens_per_s);
  if (static_cast<int>(track.top.size()) >= track.top_k) {
    std::nth_element(track.top.begin(), track.top.begin() + (track.top_k - 1), track.top.end(),
                     std::greater<double>());
    track.kth = track.top[track.top_k - 1];
  }
}

Outcome Search::evaluate_shape(const Shape& shape) {
  const Placement& pl = detailed(shape.placement);
  const int dp = pl.dp, pp = pl.pp, tp = shape.tp, v = shape.v, mb = shape.mb;
  const int layers = model_.layers;
  Outcome no_fit;
  no_fit.kind = Outcome::Kind::kNoFit;

  Strategy s;
  s.dp = dp;
  s.tp = tp;
  s.pp = pp;
  s.sp = shape.sp;
  s.microbatch_size = mb;
  s.global_batch = shape.global_batch;
  s.schedule = shape.schedule;
  s.virtual_stages = v;
  s.recompute = shape.recompute;
  s.zero = shape.zero;
  s.gpus = pl.gpus;
  const int total = shape.global_batch / mb;
  const int unit = shape.schedule == Schedule::kInterleaved ? pp : 1;
  const bool even = total % (dp * unit) == 0;
  if (!even) {
    // Provisional shares (memory bound below uses the largest).
    s.dp_shares.assign(dp, 0);
    int left = total / unit;
    for (int r = 0; r < dp; ++r) {
      const int n = left / (dp - r);
      s.dp_shares[r] = n * unit * mb;
      left -= n;
    }
    std::sort(s.dp_shares.begin(), s.dp_shares.end(), std::greater<int>());
  }

  // Memory: per-GPU footprint is affine in the blocks a rank holds; find each rank's limit.
  thread_local std::vector<RankCost> costs;
  thread_local std::vector<int> counts;
  costs.assign(static_cast<size_t>(dp) * pp, RankCost{});
  counts.assign(pp, 0);
  thread_local std::vector<int> max_blocks;
  max_blocks.assign(pp, layers);
  {
    s.stage_layers.assign(static_cast<size_t>(pp) * v, 1);
    thread_local std::vector<double> m1, m2;
    m1.assign(pp, 0);
    m2.assign(pp, 0);
    for (int p = 0; p < pp; ++p) m1[p] = cost_.memory(s, 0, p).total_gib();
    s.stage_layers.assign(static_cast<size_t>(pp) * v, 2);
    for (int p = 0; p < pp; ++p) m2[p] = cost_.memory(s, 0, p).total_gib();
    for (int p = 0; p < pp; ++p) {
      double capacity = kInf;
      for (int r = 0; r < dp; ++r) {
        capacity = std::min(capacity, topo_.types[pl.type[r * pp + p]].memory_gib);
      }
      const double per_block = (m2[p] - m1[p]) / v;
      const double base = m1[p] - per_block * v;
      const double room = per_block > 0 ? (capacity - base) / per_block : layers;
      max_blocks[p] = room >= layers ? layers : static_cast<int>(std::floor(room + 1e-9));
      if (max_blocks[p] < v) return no_fit;
    }
  }

  // Per (replica, rank): time = fixed + per_block * blocks, for one microbatch.
  const double p2p_bytes = static_cast<double>(mb) * model_.seq_len * model_.hidden * 2.0 / tp;
  const BlockCosts* type_costs[8] = {};
  for (int slot = 0; slot < dp * pp; ++slot) {
    if (!type_costs[pl.type[slot]]) {
      type_costs[pl.type[slot]] = &block_costs(pl.type[slot], tp, mb, shape.sp, shape.recompute);
    }
  }
  thread_local std::vector<double> link_tp_s;
  link_tp_s.resize(pl.link_node.size());
  for (size_t n = 0; n < pl.link_node.size(); ++n) {
    link_tp_s[n] = tp_comm_per_block_s(pl.link_node[n], tp, mb, shape.recompute);
  }
  for (int r = 0; r < dp; ++r) {
    for (int p = 0; p < pp; ++p) {
      const int slot = r * pp + p;
      const double slow = pl.slow[slot];
      const BlockCosts& bc = *type_costs[pl.type[slot]];
      RankCost& rc = costs[slot];
      rc.per_block_s = bc.block_s * slow + link_tp_s[pl.slot_link[slot]];
      double fixed = 0;
      if (p == 0) fixed += bc.embedding_s * slow;
      if (p == pp - 1) fixed += bc.logits_s * slow;
      // Each chunk sends to the next chunk and (backward) to the previous one.
      const int sends_next = p == pp - 1 ? v - 1 : v;
      const int sends_prev = p == 0 ? v - 1 : v;
      fixed += sends_next * (pl.next_latency_s[slot] + p2p_bytes * pl.next_s_per_byte[slot]);
      fixed += sends_prev * (pl.prev_latency_s[slot] + p2p_bytes * pl.prev_s_per_byte[slot]);
      rc.fixed_s = fixed;
      rc.max_blocks = max_blocks[p];
    }
  }

  // One row per replica, weighted by its microbatch count; a single row when every replica is
  // identical. partition_blocks drops rows that can never be the slowest, so rows that differ
  // (e.g. by measured speed noise) cost little.
  bool replicas_alike = true;
  for (int r = 1; r < dp && replicas_alike; ++r) {
    for (int p = 0; p < pp && replicas_alike; ++p) {
      replicas_alike = costs[r * pp + p].fixed_s == costs[p].fixed_s &&
                       costs[r * pp + p].per_block_s == costs[p].per_block_s;
    }
  }
  thread_local std::vector<int> micro, before;
  thread_local std::vector<RankCost> rows;
  micro.assign(dp, total / dp);
  auto build_rows = [&]() {
    bool one = replicas_alike;
    for (int r = 1; r < dp && one; ++r) one = micro[r] == micro[0];
    const int count = one ? 1 : dp;
    rows.resize(static_cast<size_t>(count) * pp);
    for (int r = 0; r < count; ++r) {
      for (int p = 0; p < pp; ++p) {
        RankCost w = costs[r * pp + p];
        w.fixed_s *= micro[r];
        w.per_block_s *= micro[r];
        rows[r * pp + p] = w;
      }
    }
    return count;
  };
  auto shares_from_partition = [&]() {
    thread_local std::vector<double> per_mb, fixed;
    per_mb.assign(dp, 0);
    fixed.assign(dp, 0);
    for (int r = 0; r < dp; ++r) {
      double max = 0, sum = 0;
      for (int p = 0; p < pp; ++p) {
        const RankCost& c = costs[r * pp + p];
        const double t = c.fixed_s + c.per_block_s * counts[p];
        max = std::max(max, t);
        sum += t;
      }
      per_mb[r] = max;
      fixed[r] = (sum - max) / v;
    }
    allocate_microbatches(per_mb.data(), fixed.data(), dp, total, unit, micro.data());
  };

  double bottleneck = 0;
  thread_local std::vector<int> counts_before;
  for (int round = 0; round < 2; ++round) {
    const int row_count = build_rows();
    if (!partition_blocks(rows.data(), row_count, pp, layers, v, counts.data(), &bottleneck)) {
      return no_fit;
    }
    // The shares depend only on the counts: the same counts as the previous round give the
    // same shares again.
    if (round > 0 && counts == counts_before) break;
    counts_before = counts;
    before = micro;
    shares_from_partition();
    if (micro == before) break;
  }

  std::vector<int> per_rank(counts.begin(), counts.end());
  s.dp_shares.clear();
  s.stage_layers = chunk_layers(per_rank, v);
  if (s.stage_layers == balanced_chunks(layers, pp * v)) s.stage_layers.clear();
  bool uniform = true;
  for (int r = 1; r < dp; ++r) uniform = uniform && micro[r] == micro[0];
  if (!uniform) {
    s.dp_shares.resize(dp);
    for (int r = 0; r < dp; ++r) s.dp_shares[r] = micro[r] * mb;
  }
  if (uniform && !even) return {};  // cannot happen: an uneven total has no uniform split
  ++evaluated_;
  Outcome out;
  out.kind = Outcome::Kind::kEvaluated;
  out.cost = cost_.evaluate(s, c_);
  out.strategy = std::move(s);
  return out;
}

// Per-layer compression: among the methods whose error stays within the budget, the one that
// sends the fewest bytes; then only as many layers (largest savings first) as make the
// iteration faster. Lossless when compression does not pay.
void Search::choose_compression(Candidate& cand) {
  const GradientStats& g = req_.gradients;
  if (!space_.compression || g.empty() || cand.strategy.dp <= 1) return;
  const int layers = model_.layers;
  const double grad_bytes = grad_bytes_per_param(model_);
  const double params = static_cast<double>(model_.params_per_layer());
  struct Choice {
    Compression method;
    double saved_bytes;
    int layer;
  };
  std::vector<Choice> choices;
  for (int l = 0; l < layers; ++l) {
    Choice best{Compression{}, 0, l};
    auto offer = [&](const Compression& m, double error, double bytes) {
      if (error > g.error_budget) return;
      const double saved = params * grad_bytes - bytes;
      if (saved > best.saved_bytes) best = Choice{m, saved, l};
    };
    Compression fp16;
    fp16.kind = Compression::Kind::kFP16;
    offer(fp16, g.fp16_error, params * 2.0);
    if (!g.topk_energy.empty()) {
      Compression topk;
      topk.kind = Compression::Kind::kTopK;
      topk.topk_ratio = g.topk_ratio;
      // All-gathered values and indices grow with dp: count what one rank receives.
      offer(topk, 1.0 - g.topk_energy[l], params * g.topk_ratio * 6.0 * cand.strategy.dp / 2.0);
    }
    if (!g.lowrank_residual.empty()) {
      Compression psgd;
      psgd.kind = Compression::Kind::kPowerSGD;
      psgd.powersgd_rank = g.powersgd_rank;
      const double h = model_.hidden;
      const double f = model_.ffn_hidden;
      const double low_rank = 4.0 * (h + h) * g.powersgd_rank + 2.0 * (h + f) * g.powersgd_rank;
      offer(psgd, g.lowrank_residual[l], std::min(params, low_rank) * grad_bytes);
    }
    if (best.saved_bytes > 0) choices.push_back(best);
  }
  if (choices.empty()) return;
  std::stable_sort(choices.begin(), choices.end(),
                   [](const Choice& a, const Choice& b) { return a.saved_bytes > b.saved_bytes; });

  auto with_first = [&](size_t n) {
    Strategy s = cand.strategy;
    std::vector<Compression> per_layer(layers);
    for (size_t i = 0; i < n; ++i) per_layer[choices[i].layer] = choices[i].method;
    s.compression = Compression{};
    s.compression_overrides.clear();
    for (int l = 0; l < layers;) {
      int e = l;
      while (e + 1 < layers && per_layer[e + 1] == per_layer[l]) ++e;
      if (per_layer[l].kind != Compression::Kind::kNone) {
        s.compression_overrides.push_back(CompressionOverride{l, e, per_layer[l]});
      }
      l = e + 1;
    }
    // A single override covering every layer reads better as the default.
    if (s.compression_overrides.size() == 1 && s.compression_overrides[0].first_layer == 0 &&
        s.compression_overrides[0].last_layer == layers - 1) {
      s.compression = s.compression_overrides[0].compression;
      s.compression_overrides.clear();
    }
    return s;
  };
  const double base = cand.cost.iteration_time_s;
  if (cand.cost.dp_comm_s <= 1e-3 * base) return;  // nothing exposed to save
  Candidate best = cand;
  const size_t n = choices.size();
  for (size_t k : {n / 4, n / 2, (3 * n) / 4, n}) {
    if (k == 0) continue;
    Strategy s = with_first(k);
    ++evaluated_;
    const CostBreakdown b = cost_.evaluate(s, c_);
    // Lossy only when it pays by more than 0.5%.
    if (b.feasible && b.fits_in_memory &&
        b.iteration_time_s < best.cost.iteration_time_s - 0.005 * base) {
      best = Candidate{s, b, 0, 0};
    }
  }
  cand = best;
}

// A track's top K families, the leaders compressed where it pays, best first.
std::vector<Candidate> Search::finish(const Track& track) {
  std::vector<Candidate> ranked;
  for (const auto& [family, cand] : track.best) ranked.push_back(cand);
  auto by_throughput = [](const Candidate& a, const Candidate& b) {
    return a.cost.tokens_per_s > b.cost.tokens_per_s;
  };
  std::stable_sort(ranked.begin(), ranked.end(), by_throughput);
  // Compression can reorder the leaders: apply it to twice as many as returned.
  const int k = track.top_k;
  const size_t keep = std::min(ranked.size(), static_cast<size_t>(2 * k));
  ranked.resize(keep);
  // Compression only shortens the exposed DP reduction (the cost model's one term that depends
  // on it), so a layout compressed can at best run in iteration - dp_comm. Once K families are
  // final, one whose best case cannot reach the K-th of them is cut either way: not tried.
  std::vector<double> final_tps;
  for (size_t i = 0; i < ranked.size(); ++i) {
    Candidate& cand = ranked[i];
    if (static_cast<int>(i) >= k) {
      std::nth_element(final_tps.begin(), final_tps.begin() + (k - 1), final_tps.end(),
                       std::greater<double>());
      const double kth = final_tps[k - 1];
      const double floor_s = cand.cost.iteration_time_s - cand.cost.dp_comm_s;
      const double best_case =
          floor_s > 0 ? cand.cost.tokens_per_s * cand.cost.iteration_time_s / floor_s : kInf;
      if (best_case * (1 + 1e-9) < kth) continue;
    }
    auto done = std::find_if(compressed_.begin(), compressed_.end(),
                             [&](const auto& entry) { return entry.first == cand.strategy; });
    if (done != compressed_.end()) {
      cand = done->second;
    } else {
      const Strategy plain = cand.strategy;
      choose_compression(cand);
      compressed_.emplace_back(plain, cand);
    }
    final_tps.push_back(cand.cost.tokens_per_s);
  }
  std::stable_sort(ranked.begin(), ranked.end(), by_throughput);
  if (static_cast<int>(ranked.size()) > k) ranked.resize(k);
  return ranked;
}

PlanResult Search::run() {
  const auto start = std::chrono::steady_clock::now();
  const int gpus = topo_.num_gpus();
  if (req_.top_k < 1) throw InputError("--top: must be >= 1, got " + std::to_string(req_.top_k));
  auto check_size = [&](size_t size, int expected, const char* what) {
    if (size != 0 && static_cast<int>(size) != expected) {
      throw InputError(std::string("conditions: ") + what + " has " + std::to_string(size) +
                       " entries but the cluster has " + std::to_string(expected));
    }
  };
  check_size(c_.gpu_speed.size(), gpus, "gpu_speed");
  check_size(c_.gpu_failed.size(), gpus, "failed_gpus");
  check_size(c_.node_inter_bw.size(), topo_.num_nodes(), "node_inter_bw");
  check_size(c_.node_intra_bw.size(), topo_.num_nodes(), "node_intra_bw");
  for (double s : c_.gpu_speed) {
    if (!(s > 0)) throw InputError("conditions: gpu_speed factors must be > 0");
  }

  PlanResult result;
  if (req_.current) {
    Candidate cur{*req_.current, cost_.evaluate(*req_.current, c_), 0, 0};
    ++evaluated_;
    result.current = cur;
  }

  int usable = 0;
  for (int g = 0; g < gpus; ++g) usable += c_.failed(g) ? 0 : 1;
  if (usable == 0) throw InputError("conditions: every GPU is marked failed");

  int max_node = 1;
  for (const auto& n : topo_.nodes) max_node = std::max(max_node, n.gpus);
  std::vector<int> tps = space_.tp;
  if (tps.empty()) {
    for (int t = 1; t <= max_node; ++t) tps.push_back(t);
  }
  const int max_pp = space_.max_pp > 0 ? std::min(space_.max_pp, model_.layers) : model_.layers;

  for (int tp : tps) {
    if (!tp_legal(tp, model_)) continue;
    make_groups(tp);
    const int groups = static_cast<int>(scratch_.groups[tp].size());
    if (groups == 0) continue;
    // Healthy group count: pipeline depths that divide it are the defaults.
    int healthy = 0;
    for (const auto& n : topo_.nodes) healthy += n.gpus / tp;
    std::vector<int> pps = space_.pp;
    if (pps.empty()) {
      for (int pp = 1; pp <= max_pp; ++pp) {
        if (healthy % pp == 0 || groups % pp == 0) pps.push_back(pp);
      }
    }
    for (int pp : pps) {
      if (pp > max_pp || pp > groups || pp > model_.layers) continue;
      std::vector<int> dps = space_.dp;
      if (dps.empty()) dps.push_back(groups / pp);
      for (int dp : dps) {
        if (dp < 1 || dp * pp > groups) continue;
        const size_t first = placement_count_;
        add_placements(tp, pp, dp);
        for (size_t i = first; i < placement_count_; ++i) add_shapes(static_cast<int>(i), tp);
      }
    }
  }

  // Each track ranks its families as a search over its layouts alone would.
  tracks_.emplace_back();
  tracks_.back().top_k = req_.top_k;
  const bool with_zero0 = searches_zero0_variants(req_, model_.layers);
  if (with_zero0) {
    tracks_.emplace_back();
    tracks_.back().top_k = std::max(req_.top_k, req_.zero0_top_k);
    tracks_.back().zero0_only = true;
  }

  // Best bound first; a track stops once no remaining layout can enter its top K. A shape is
  // evaluated once, whichever tracks take it.
  std::stable_sort(shapes_.begin(), shapes_.end(), [](const Shape& a, const Shape& b) {
    return a.upper_tokens_per_s > b.upper_tokens_per_s;
  });
  for (size_t i = 0; i < shapes_.size(); ++i) {
    const Shape& shape = shapes_[i];
    bool taken = false, computed = false, all_done = true;
    Outcome outcome;
    for (Track& track : tracks_) {
      if (!track.done && shape.upper_tokens_per_s <= track.kth) track.done = true;
      all_done = all_done && track.done;
      if (track.done || !track.covers(shape)) continue;
      taken = true;
      if (auto it = track.no_fit_mb.find(fit_key(shape));
          it != track.no_fit_mb.end() && shape.mb >= it->second) {
        continue;
      }
      if (!computed) {
        outcome = evaluate_shape(shape);
        computed = true;
      }
      record(track, shape, outcome);
    }
    if (all_done) {
      pruned_ += static_cast<long>(shapes_.size() - i);
      break;
    }
    if (!taken) ++pruned_;
  }

  std::vector<Candidate> ranked = finish(tracks_[0]);
  if (with_zero0) {
    // The faster of each family's variants, best first (the first track's on a tie).
    std::vector<Candidate> all = std::move(ranked);
    const std::vector<Candidate> zero0 = finish(tracks_[1]);
    all.insert(all.end(), zero0.begin(), zero0.end());
    std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
      return a.cost.tokens_per_s > b.cost.tokens_per_s;
    });
    ranked.clear();
    for (const Candidate& cand : all) {
      if (static_cast<int>(ranked.size()) == req_.top_k) break;
      const Family family = family_of(cand.strategy);
      const bool same_family = std::any_of(ranked.begin(), ranked.end(), [&](const Candidate& o) {
        return family_of(o.strategy) == family;
      });
      if (!same_family) ranked.push_back(cand);
    }
  }
  result.candidates = std::move(ranked);

  result.evaluated = evaluated_;
  result.pruned = pruned_;
  result.search_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

// State of one GPU: per layer slot (embedding = -1, blocks 0..L-1, output = L), the fraction of
// the layer's tensor-parallel width it holds, and the fraction of that shard's optimizer state.
struct Holding {
  int first_layer, last_layer;  // inclusive, in [-1, L]
  double tp_lo, tp_hi;          // slice of the layer's parameters, in [0, 1)
  double opt_lo, opt_hi;        // slice of the optimizer state it owns (ZeRO), in [0, 1)
};

// The holdings of every GPU, flat: GPU g holds items[first[g]] .. items[first[g + 1] - 1].
struct Holdings {
  std::vector<Holding> items;
  std::vector<int> first;
};

void holdings_of(const Strategy& s, const ModelSpec& model, int gpu_count, Holdings& out) {
  const std::vector<int> chunks = resolved_chunks(s, model.layers);
  std::vector<int> first(chunks.size());
  for (size_t c = 1; c < chunks.size(); ++c) first[c] = first[c - 1] + chunks[c - 1];
  // Count per GPU, then fill in (replica, stage, tp rank, virtual stage) order, the order in
  // which a GPU's holdings are listed.
  out.first.assign(static_cast<size_t>(gpu_count) + 1, 0);
  for (int r = 0; r < s.dp; ++r)
    for (int p = 0; p < s.pp; ++p)
      for (int t = 0; t < s.tp; ++t) out.first[s.gpu_of_rank(r, p, t) + 1] += s.virtual_stages;
  for (int g = 0; g < gpu_count; ++g) out.first[g + 1] += out.first[g];
  out.items.resize(static_cast<size_t>(out.first[gpu_count]));
  thread_local std::vector<int> cursor;
  cursor.assign(out.first.begin(), out.first.end() - 1);
  for (int r = 0; r < s.dp; ++r) {
    for (int p = 0; p < s.pp; ++p) {
      for (int t = 0; t < s.tp; ++t) {
        const int gpu = s.gpu_of_rank(r, p, t);
        const double lo = static_cast<double>(t) / s.tp, hi = static_cast<double>(t + 1) / s.tp;
        const double olo = s.zero >= 1 ? static_cast<double>(r) / s.dp : 0.0;
        const double ohi = s.zero >= 1 ? static_cast<double>(r + 1) / s.dp : 1.0;
        for (int k = 0; k < s.virtual_stages; ++k) {
          const int c = k * s.pp + p;
          int a = first[c], b = first[c] + chunks[c] - 1;
          if (c == 0) a = -1;
          if (c == s.num_chunks() - 1) b = model.layers;
          out.items[static_cast<size_t>(cursor[gpu]++)] = Holding{a, b, lo, hi, olo, ohi};
        }
      }
    }
  }
}

double overlap(double a0, double a1, double b0, double b1) {
  return std::max(0.0, std::min(a1, b1) - std::max(a0, b0));
}

// Migration from a layout whose holdings are `before` to `to` (Planner::migration).
Migration migration_from(const Holdings& before, const Strategy& from, const Strategy& to,
                         const Conditions& c, const ModelSpec& model, const ClusterTopology& topo) {
  const int gpus = topo.num_gpus();
  thread_local Holdings after;
  holdings_of(to, model, gpus, after);
  const double weight_bytes = 2.0;
  const double grad_bytes = grad_bytes_per_param(model);
  const double optimizer_bytes = 12.0;
  auto layer_params = [&](int layer) {
    if (layer < 0) return static_cast<double>(model.embedding_params());
    if (layer >= model.layers) {
      return model.tied_embeddings ? static_cast<double>(model.vocab) * model.hidden
                                   : static_cast<double>(model.output_params());
    }
    return static_cast<double>(model.params_per_layer());
  };
  // Bytes of a holding's layers [a, b] (weights and gradients of the tp slice, optimizer state
  // of its ZeRO slice), optionally intersected with another holding.
  auto bytes_of = [&](const Holding& h, const Holding* other) {
    const int a = other ? std::max(h.first_layer, other->first_layer) : h.first_layer;
    const int b = other ? std::min(h.last_layer, other->last_layer) : h.last_layer;
    if (a > b) return 0.0;
    double params = 0;
    if (a < 0) params += layer_params(-1);
    const int blocks = std::min(b, model.layers - 1) - std::max(a, 0) + 1;
    if (blocks > 0) params += blocks * static_cast<double>(model.params_per_layer());
    // A tied output layer on the embedding's own GPU is the same tensor.
    if (b >= model.layers && !(a < 0 && model.tied_embeddings)) {
      params += layer_params(model.layers);
    }
    const double width =
        other ? overlap(h.tp_lo, h.tp_hi, other->tp_lo, other->tp_hi) : h.tp_hi - h.tp_lo;
    auto opt_lo = [](const Holding& x) { return x.tp_lo + (x.tp_hi - x.tp_lo) * x.opt_lo; };
    auto opt_hi = [](const Holding& x) { return x.tp_lo + (x.tp_hi - x.tp_lo) * x.opt_hi; };
    const double opt_width = other ? overlap(opt_lo(h), opt_hi(h), opt_lo(*other), opt_hi(*other))
                                   : opt_hi(h) - opt_lo(h);
    return params * (width * (weight_bytes + grad_bytes) + opt_width * optimizer_bytes);
  };
  Migration m;
  double slowest = 0;
  for (int g = 0; g < gpus; ++g) {
    double need = 0;
    for (int i = after.first[g]; i < after.first[g + 1]; ++i) {
      const Holding& h = after.items[static_cast<size_t>(i)];
      need += bytes_of(h, nullptr);
      for (int j = before.first[g]; j < before.first[g + 1]; ++j)
        need -= bytes_of(h, &before.items[static_cast<size_t>(j)]);
    }
    need = std::max(0.0, need);
    if (need <= 0) continue;
    m.total_bytes += need;
    m.max_bytes = std::max(m.max_bytes, need);
    const int node = topo.node_of_gpu[g];
    const double bw = topo.nodes[node].inter_GBps * c.inter(node) * 1e9 * topo.inter_efficiency;
    slowest = std::max(slowest, need / bw);
  }
  if (m.total_bytes > 0 || !(from == to)) m.time_s = slowest + kSwitchPauseS;
  return m;
}

}  // namespace

PlanResult Planner::plan(const PlanRequest& request) const {
  PlanRequest resolved = request;
  SearchSpace& space = resolved.space;
  if (space.global_batch == 0 && space.global_batch_max == 0) {
    space.global_batch =
        request.current ? request.current->global_batch : default_global_batch(cluster_.num_gpus());
  }
  Search search(model_, cost_, probes_, *block_cache_, resolved);
  PlanResult result = search.run();
  if (request.current) {
    thread_local Holdings current;
    holdings_of(*request.current, model_, cost_.topology().num_gpus(), current);
    for (auto& cand : result.candidates) {
      const Migration m = migration_from(current, *request.current, cand.strategy,
                                         request.conditions, model_, cost_.topology());
      cand.migration_bytes = m.max_bytes;
      cand.migration_s = m.time_s;
    }
  }
  return result;
}

Migration Planner::migration(const Strategy& from, const Strategy& to, const Conditions& c) const {
  thread_local Holdings before;
  holdings_of(from, model_, cost_.topology().num_gpus(), before);
  return migration_from(before, from, to, c, model_, cost_.topology());
}

}  // namespace parapilot
