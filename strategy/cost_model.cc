#include "strategy/cost_model.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>

#include "strategy/cost_formulas.h"

namespace parapilot {

namespace {

// Physical constants shared by every GPU type (docs/cost-model.md gives their sources).
constexpr double kHbmEfficiency = 0.85;      // achievable fraction of HBM bandwidth (STREAM-like)
constexpr double kKernelOverheadS = 2e-6;    // fixed cost per kernel: launch, tail, sync
constexpr double kReservedGiB = 1.0;         // CUDA context, allocator slack, NCCL buffers
constexpr double kBucketParams = 40e6;       // gradient bucket (Megatron's default size)
constexpr double kAdamBytesPerParam = 30.0;  // fp32 master, m, v read+write; grad read; param write
constexpr double kFp8CastBytesPerParam = 4.0;  // read bf16 weight, write FP8 copy and transpose
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr size_t kMaxTypes = 8;  // GPU types in one cluster

}  // namespace

struct CostModel::BlockTimes {
  double fwd = 0;                       // one block, one microbatch, forward
  double bwd = 0;                       // backward, without recompute
  double recompute = 0;                 // extra forward work recomputed during backward
  double first_fwd = 0, first_bwd = 0;  // embedding (first chunk only)
  double last_fwd = 0, last_bwd = 0;    // final norm, logits and loss (last chunk only)
  // Flash attention kernel of one block (context parallelism hides its ring under them).
  double attention_fwd = 0, attention_bwd = 0;
  double kv_block_bytes = 0;    // keys and values one context-parallel rank holds (ring step)
  double linear_gemms_fwd = 0;  // the four linear-layer GEMMs of one block, forward
  double hbm_Bps = 0;
};

CostModel::CostModel(ModelSpec model, ClusterSpec cluster)
    : model_(std::move(model)), cluster_(std::move(cluster)), topo_(cluster_) {
  static std::atomic<unsigned long long> next_id{0};
  id_ = ++next_id;
  struct Key {
    int type;
    double intra_GBps, inter_GBps;
    bool operator==(const Key&) const = default;
  };
  std::vector<Key> keys;
  for (const ClusterTopology::Node& node : topo_.nodes) {
    const Key key{node.type, node.intra_GBps, node.inter_GBps};
    const auto it = std::find(keys.begin(), keys.end(), key);
    node_class_.push_back(static_cast<int>(it - keys.begin()));
    if (it == keys.end()) {
      keys.push_back(key);
      class_first_node_.push_back(static_cast<int>(node_class_.size()) - 1);
    }
  }
}

CostModel::RingAttention CostModel::ring_attention(int type, const Strategy& s) const {
  const BlockTimes bt = block_times(type, s);
  return {bt.attention_fwd, bt.attention_bwd, bt.kv_block_bytes};
}

CostModel::BlockTimes CostModel::block_times(int type, const Strategy& s) const {
  const GpuType& gpu = topo_.types[type];
  const double flops_Bps = gpu.peak_tflops * 1e12 * gpu.gemm_efficiency;
  const double hbm_Bps = gpu.hbm_GBps * 1e9 * kHbmEfficiency;
  // Roofline per GEMM: compute-bound at the achievable peak, memory-bound on its operands
  // (2 bytes each in bf16/fp16, 1 in FP8 at the FP8 peak).
  auto gemm_at = [&](double m, double n, double k, double batch, double rate, double bytes) {
    const double compute = 2.0 * m * n * k / rate;
    const double memory = bytes * (m * k + k * n + m * n) / hbm_Bps;
    return batch * std::max(compute, memory) + kKernelOverheadS;
  };
  auto gemm = [&](double m, double n, double k, double batch = 1) {
    return gemm_at(m, n, k, batch, flops_Bps, 2.0);
  };
  auto streaming = [&](double bytes) { return bytes / hbm_Bps + kKernelOverheadS; };
  // A linear layer's forward GEMM (M tokens x N outputs x K inputs) and the extra work of its
  // backward beyond two GEMMs of the same shape. In FP8 (Transformer-Engine style) the GEMMs
  // run at the FP8 peak on 1-byte operands; the forward casts its bf16 input to FP8 (read 2,
  // write 1 byte per element), the backward casts the output gradient to FP8 with its transpose
  // (read 2, write 1 + 1) and transposes the saved FP8 input for the weight gradient (1 + 1).
  const double fp8_Bps = gpu.fp8_tflops * 1e12 * gpu.gemm_efficiency;
  double gemms = 0, casts_fwd = 0, casts_bwd = 0;
  auto linear = [&](double m, double n, double k) {
    if (!s.fp8) {
      gemms += gemm(m, n, k);
      return;
    }
    gemms += gemm_at(m, n, k, 1, fp8_Bps, 1.0);
    casts_fwd += streaming(3.0 * m * k);
    casts_bwd += streaming(4.0 * m * n) + streaming(2.0 * m * k);
  };

  const double t = s.tp;
  const double b = s.microbatch_size;
  const double full_seq = model_.seq_len;
  const double seq = full_seq / s.cp;  // the part of the sequence this context rank holds
  const double h = model_.hidden;
  const double f = model_.ffn_hidden;
  const double d = model_.head_dim();
  const double tokens = b * seq;
  const double norm_tokens = s.sp ? tokens / t : tokens;  // sequence-parallel regions
  const double heads_per_rank = model_.heads / t;
  const double kv_per_rank =
      model_.kv_heads >= s.tp ? static_cast<double>(model_.kv_width()) / t : 2.0 * d;
  const bool gated = model_.activation == Activation::kSwiGLU;

  linear(tokens, h / t + kv_per_rank, h);  // QKV
  linear(tokens, h, h / t);                // output projection
  linear(tokens, (gated ? 2 : 1) * f / t, h);
  linear(tokens, h, f / t);
  // Element-wise kernels (2-byte elements): two norms (read + write), two fused
  // bias-dropout-residual adds (2 reads, 1 write, 1-byte mask) and the MLP activation.
  const double elementwise = streaming(8.0 * norm_tokens * h) + streaming(14.0 * norm_tokens * h) +
                             streaming((gated ? 6.0 : 4.0) * tokens * f / t);

  BlockTimes out;
  out.hbm_Bps = hbm_Bps;
  out.linear_gemms_fwd = gemms;
  double core_recompute = 0;  // the attention core, which selective recompute runs again
  if (s.attention == Attention::kUnfused) {
    // Scores and values as batched GEMMs with d = head_dim, and a fused scale-mask-softmax
    // with attention dropout reading and writing the s x s scores (9 bytes per score).
    const double scores = gemm(seq, seq, d, b * heads_per_rank);
    const double context = gemm(seq, d, seq, b * heads_per_rank);
    const double softmax = streaming(9.0 * b * heads_per_rank * seq * seq);
    core_recompute = scores + context + softmax;
    out.fwd = gemms + casts_fwd + elementwise + core_recompute;
    // Data and weight gradients: two GEMMs per forward GEMM.
    out.bwd = 2.0 * (gemms + elementwise + core_recompute) + casts_bwd;
  } else {
    // One fused kernel: the scores stay on chip, so its HBM traffic is Q, K, V and the output.
    // A causal mask skips half the blocks (2 b s^2 d FLOPs per head instead of 4); a context
    // rank computes 1/cp of them (2 cp chunks per rank balance the causal work). The backward
    // recomputes the scores in the kernel: 2.5 times the forward FLOPs (5 GEMMs to 2).
    const double attention_Bps = gpu.peak_tflops * 1e12 * gpu.attention_efficiency;
    const double flops = 2.0 * b * heads_per_rank * full_seq * full_seq * d / s.cp;
    const double io_bytes = 2.0 * tokens * (2.0 * h / t) + 2.0 * b * full_seq * kv_per_rank;
    out.attention_fwd = std::max(flops / attention_Bps, io_bytes / hbm_Bps) + kKernelOverheadS;
    out.attention_bwd =
        std::max(2.5 * flops / attention_Bps, 2.0 * io_bytes / hbm_Bps) + kKernelOverheadS;
    out.kv_block_bytes = 2.0 * tokens * kv_per_rank;
    core_recompute = out.attention_fwd;
    out.fwd = gemms + casts_fwd + elementwise + out.attention_fwd;
    out.bwd = 2.0 * (gemms + elementwise) + casts_bwd + out.attention_bwd;
  }
  switch (s.recompute) {
    case Recompute::kNone:
      break;
    case Recompute::kSelective:
      out.recompute = core_recompute;
      break;
    case Recompute::kFull:
      out.recompute = out.fwd;
      break;
  }

  // The embedding and output layer stay in 16 bits (as Transformer Engine keeps them).
  const double vocab_per_rank = model_.vocab / t;
  out.first_fwd = streaming(2.0 * norm_tokens * h);
  out.first_bwd = streaming(4.0 * norm_tokens * h);
  const double logits = gemm(tokens, vocab_per_rank, h);
  // Loss: read bf16 logits, write fp32 softmax, read it back (10 bytes per logit).
  out.last_fwd =
      streaming(4.0 * norm_tokens * h) + logits + streaming(10.0 * tokens * vocab_per_rank);
  out.last_bwd =
      streaming(8.0 * norm_tokens * h) + 2.0 * logits + streaming(6.0 * tokens * vocab_per_rank);
  return out;
}

// Scratch and results of one evaluation.
struct CostModel::Work {
  CostBreakdown result;
  const OffNominal* where = nullptr;   // of the conditions evaluated under
  PipelineTimings* timings = nullptr;  // filled when non-null
  bool exhaustive = false;             // time every replica, sharing nothing between them
};

namespace {

struct ChunkLayout {
  // Balanced or explicit layer counts, without allocating for the balanced case.
  const std::vector<int>* explicit_counts;
  int layers;
  int chunks;
  int count(int chunk) const {
    if (explicit_counts) return (*explicit_counts)[chunk];
    const int base = layers / chunks;
    const int remainder = layers % chunks;
    const int first_extra = (chunks - remainder) / 2;
    return base + (chunk >= first_extra && chunk < first_extra + remainder ? 1 : 0);
  }
  int first_layer(int chunk) const {
    int sum = 0;
    for (int c = 0; c < chunk; ++c) sum += count(c);
    return sum;
  }
};

}  // namespace

// What a layout (dp x pp x tp ranks on given GPUs) fixes regardless of conditions.
struct CostModel::Placement {
  unsigned long long model_id = 0;
  int dp = 0, tp = 0, pp = 0, cp = 0;
  PlacementOrder placement = PlacementOrder::kTpPpDp;
  std::vector<int> gpus;  // the explicit placement, if any
  unsigned long long gpus_hash = 0;  // gpus_hash(gpus): most entries differ in it
  // Per replica: the first replica with the same link pattern, rank by rank (the node class
  // of the rank's first GPU, whether its pipeline neighbours sit on the same node or else
  // their node classes, and whether its context-parallel ring leaves the node or else the
  // classes of its slowest network end and slowest NVLink: cp_ring_class). Replicas of one
  // class time alike under nominal conditions.
  std::vector<int> replica_class;
  bool one_class = false;  // every replica is of replica 0's class
  // The first replica of each run of consecutive replicas of one class, then dp.
  std::vector<int> class_runs;
  std::vector<int> rank_of_gpu;  // per cluster GPU: the rank (r, p) using it, r * pp + p, or -1
  // Per (pipeline rank p, replica r, context rank c), at (p * dp + r) * cp + c: the node of
  // the context rank's first GPU (a pipeline rank's gradient-reduction group is contiguous).
  std::vector<int> rank_nodes;
  // Per pipeline rank: how its gradient-reduction group (dp x cp members) spreads over nodes.
  struct DpGroup {
    int nodes_spanned = 0;
    int min_members = 0;                    // fewest members on one node
    double inter_GBps = 0, intra_GBps = 0;  // slowest nominal node links among those spanned
    int first_node = 0, end_node = 0;       // the nodes spanned: spanned_nodes[first, end)
  };
  std::vector<DpGroup> dp_groups;
  std::vector<int> spanned_nodes;
  // Per (pipeline rank p, node class k), at p * node classes + k: the nodes of class k its
  // gradient-reduction group spans.
  std::vector<int> spanned_classes;
  double peak_flops = 0;  // sum of the peaks of the GPUs used
};

unsigned long long CostModel::cp_ring_class(const int* nodes, int cp) const {
  const int first = nodes[0];
  int slowest_network = first, slowest_nvlink = first;
  bool spans = false;
  for (int c = 1; c < cp; ++c) {
    const int node = nodes[c];
    spans = spans || node != first;
    if (topo_.nodes[node].inter_GBps < topo_.nodes[slowest_network].inter_GBps)
      slowest_network = node;
    if (topo_.nodes[node].intra_GBps < topo_.nodes[slowest_nvlink].intra_GBps)
      slowest_nvlink = node;
  }
  if (!spans) return 0;
  return (1 + static_cast<unsigned long long>(node_class_[slowest_network])) << 21 |
         (1 + static_cast<unsigned long long>(node_class_[slowest_nvlink]));
}

namespace {

// A cheap fingerprint of an explicit placement's GPU list (0 for none): entries that differ
// in it need no full comparison.
unsigned long long gpus_hash(const std::vector<int>& gpus) {
  if (gpus.empty()) return 0;
  const auto at = [&](size_t i) { return static_cast<unsigned long long>(gpus[i]) & 0xFFFFF; };
  return (static_cast<unsigned long long>(gpus.size()) << 60) ^ at(0) << 40 ^
         at(gpus.size() / 3) << 20 ^ at(2 * gpus.size() / 3) ^ at(gpus.size() - 1) << 10;
}

}  // namespace

// The GPU and node of every rank of l's layout (strategy s): rank_of_gpu, rank_nodes and the
// sum of the peaks of the GPUs used.
void CostModel::place_ranks(Placement& l, const Strategy& s) const {
  // Loop bounds in locals: the stores below cannot then alias them.
  const int dp = s.dp, pp = s.pp, tp = s.tp, cp = s.cp;
  const int stage_gpus = tp * cp;
  const int replica_gpus = pp * stage_gpus;
  // The GPU of every rank in rank order, ((r * pp + p) * cp + c) * tp + t: the explicit list,
  // else the placement order's (stage (r, p) holds the stage_gpus GPUs from first_rank on).
  const int* gpus = s.gpus.data();
  if (s.gpus.empty()) {
    thread_local std::vector<int> ordered;
    ordered.resize(static_cast<size_t>(dp) * replica_gpus);
    for (int r = 0; r < dp; ++r) {
      for (int p = 0; p < pp; ++p) {
        int* const stage = ordered.data() + (static_cast<size_t>(r) * pp + p) * stage_gpus;
        std::iota(stage, stage + stage_gpus, s.first_rank(r, p));
      }
    }
    gpus = ordered.data();
  }

  // The rank of each GPU (the stages' GPUs come rank after rank).
  l.rank_of_gpu.assign(topo_.num_gpus(), -1);
  int* const rank_of_gpu = l.rank_of_gpu.data();
  const int used = dp * pp * stage_gpus;
  for (int i = 0, rank = 0, left = stage_gpus; i < used; ++i) {
    rank_of_gpu[gpus[i]] = rank;
    if (--left == 0) {
      left = stage_gpus;
      ++rank;
    }
  }
  // The node of each context rank's first GPU, and the sum of the peaks of the GPUs used
  // (added rank by rank in rank order, as run() adds them without a layout).
  const int* const node_of_gpu = topo_.node_of_gpu.data();
  const int* const type_of_gpu = topo_.type_of_gpu.data();
  const bool mixed_types = topo_.types.size() > 1;
  assert(topo_.types.size() <= kMaxTypes);
  double group_peak[kMaxTypes];  // a tensor-parallel group on GPUs of type i
  for (size_t i = 0; i < topo_.types.size(); ++i)
    group_peak[i] = tp * topo_.types[i].peak_tflops * 1e12;
  double peak_flops = mixed_types ? 0.0 : s.num_gpus() * topo_.types[0].peak_tflops * 1e12;
  l.rank_nodes.resize(static_cast<size_t>(dp) * pp * cp);
  int* const rank_nodes = l.rank_nodes.data();
  for (int p = 0; p < pp; ++p) {
    int* nodes = rank_nodes + static_cast<size_t>(p) * dp * cp;
    for (int r = 0; r < dp; ++r) {
      const int* const first = gpus + (static_cast<size_t>(r) * pp + p) * stage_gpus;
      for (int c = 0; c < cp; ++c) *nodes++ = node_of_gpu[first[c * tp]];
    }
  }
  if (mixed_types) {
    for (int i = 0; i < dp * pp * cp; ++i) peak_flops += group_peak[type_of_gpu[gpus[i * tp]]];
  }
  l.peak_flops = peak_flops;

}

// The layout class of each replica of l (replica_class), their runs (class_runs) and whether
// there is one (one_class): see Placement.
void CostModel::classify_replicas(Placement& l) const {
  const int dp = l.dp, pp = l.pp, cp = l.cp;
  const int* const rank_nodes = l.rank_nodes.data();
  const int* const node_class = node_class_.data();
  const size_t stage_stride = static_cast<size_t>(dp) * cp;  // from stage p to p + 1 in rank_nodes
  // Link pattern of each rank, replica r's ranks at keys[r * key_words], filled stage by stage
  // (rank_nodes holds a stage's replicas together). With context parallelism each rank has a
  // second word: its ring's link class.
  const int words = cp > 1 ? 2 : 1;
  const int key_words = pp * words;
  thread_local std::vector<unsigned long long> keys;
  keys.resize(static_cast<size_t>(dp) * key_words);
  for (int p = 0; p < pp; ++p) {
    const int* const here = rank_nodes + p * stage_stride;
    const int* const next = rank_nodes + (p + 1 < pp ? p + 1 : 0) * stage_stride;
    const int* const prev = rank_nodes + (p > 0 ? p - 1 : pp - 1) * stage_stride;
    unsigned long long* key = &keys[static_cast<size_t>(p) * words];
    for (size_t i = 0; i < stage_stride; i += cp, key += key_words) {
      const int node = here[i];
      key[0] = static_cast<unsigned long long>(node_class[node]) << 42 |
               static_cast<unsigned long long>(next[i] == node ? 0 : 1 + node_class[next[i]])
                   << 21 |
               static_cast<unsigned long long>(prev[i] == node ? 0 : 1 + node_class[prev[i]]);
      if (words == 2) key[1] = cp_ring_class(here + i, cp);
    }
  }
  // Replicas are compared with the first replica of each class found so far (few: a replica
  // beyond kMaxClasses classes stands alone).
  constexpr int kMaxClasses = 16;
  int firsts[kMaxClasses];
  int class_count = 0;
  int last_class = -1;  // the index in firsts of the previous replica's class; -1: it stood alone
  l.replica_class.resize(dp);
  int* const replica_class = l.replica_class.data();
  const unsigned long long* const all_keys = keys.data();
  for (int r = 0; r < dp; ++r) {
    const unsigned long long* const key = all_keys + static_cast<size_t>(r) * key_words;
    // The firsts' keys differ, so at most one matches: the previous replica's class is tried
    // first (like replicas come in runs). Keys are a few words: a plain loop beats memcmp.
    auto matches = [&](int k) {
      const unsigned long long* const other = all_keys + static_cast<size_t>(firsts[k]) * key_words;
      for (int i = 0; i < key_words; ++i) {
        if (key[i] != other[i]) return false;
      }
      return true;
    };
    int found = last_class >= 0 && matches(last_class) ? last_class : -1;
    for (int k = 0; k < class_count && found < 0; ++k) {
      if (k != last_class && matches(k)) found = k;
    }
    replica_class[r] = found >= 0 ? firsts[found] : r;
    if (found < 0 && class_count < kMaxClasses) {
      found = class_count;
      firsts[class_count++] = r;
    }
    last_class = found;
  }
  l.class_runs.clear();
  for (int r = 0; r < dp; ++r) {
    if (r == 0 || replica_class[r] != replica_class[r - 1]) l.class_runs.push_back(r);
  }
  l.one_class = l.class_runs.size() == 1;  // one run, of replica 0's class
  l.class_runs.push_back(dp);

}

// How each pipeline rank's gradient-reduction group spreads over nodes (dp_groups,
// spanned_nodes, spanned_classes).
void CostModel::find_dp_groups(Placement& l) const {
  const int dp = l.dp, pp = l.pp, cp = l.cp;
  const int* const rank_nodes = l.rank_nodes.data();
  const int* const node_class = node_class_.data();
  const size_t stage_stride = static_cast<size_t>(dp) * cp;  // from stage p to p + 1 in rank_nodes
  // Each member adds at most one node to spanned_nodes: it is sized for all of them, written
  // through a pointer and trimmed after. A group's counts and slowest links are kept in locals
  // (stores through the vectors would be reloaded at every member).
  l.dp_groups.resize(pp);
  l.spanned_nodes.resize(static_cast<size_t>(pp) * stage_stride);
  int* const spanned_nodes = l.spanned_nodes.data();
  int spanned_count = 0;
  const size_t node_classes = class_first_node_.size();
  l.spanned_classes.assign(pp * node_classes, 0);
  thread_local std::vector<int> per_node_store;
  per_node_store.assign(topo_.nodes.size(), 0);
  int* const per_node = per_node_store.data();
  int* const spanned_classes = l.spanned_classes.data();
  const ClusterTopology::Node* const topo_nodes = topo_.nodes.data();
  for (int p = 0; p < pp; ++p) {
    const int first_node = spanned_count;
    double inter_GBps = kInf, intra_GBps = kInf;
    int* const classes = spanned_classes + p * node_classes;
    // Members (r, c) of the group in that order: the first GPU of context rank c of stage p
    // of replica r.
    const int* const members = rank_nodes + p * stage_stride;
    for (size_t i = 0; i < stage_stride; ++i) {
      const int node = members[i];
      if (per_node[node]++ == 0) {
        spanned_nodes[spanned_count++] = node;
        ++classes[node_class[node]];
        inter_GBps = std::min(inter_GBps, topo_nodes[node].inter_GBps);
        intra_GBps = std::min(intra_GBps, topo_nodes[node].intra_GBps);
      }
    }
    int min_members = dp * cp;
    for (int i = first_node; i < spanned_count; ++i) {
      int& count = per_node[spanned_nodes[i]];
      min_members = std::min(min_members, count);
      count = 0;
    }
    Placement::DpGroup& group = l.dp_groups[p];
    group.nodes_spanned = spanned_count - first_node;
    group.min_members = min_members;
    group.inter_GBps = inter_GBps;
    group.intra_GBps = intra_GBps;
    group.first_node = first_node;
    group.end_node = spanned_count;
  }
  l.spanned_nodes.resize(spanned_count);
}

const CostModel::Placement& CostModel::placement(const Strategy& s) const {
  // A planner search costs layouts of a few dozen placements in turn: enough entries for all.
  constexpr int kEntries = 64;
  thread_local Placement cache[kEntries];
  thread_local int next_entry = 0;
  thread_local int last_found = 0;  // the entry returned last
  const unsigned long long hash = gpus_hash(s.gpus);
  auto is_of_s = [&](const Placement& entry) {
    return entry.gpus_hash == hash && entry.model_id == id_ && entry.dp == s.dp &&
           entry.tp == s.tp && entry.pp == s.pp && entry.cp == s.cp &&
           entry.placement == s.placement && entry.gpus == s.gpus;
  };
  // The planner evaluates a layout several times in a row (its ZeRO and compression
  // variants): the entry returned last is tried before the scan.
  if (is_of_s(cache[last_found])) return cache[last_found];
  for (int i = 0; i < kEntries; ++i) {
    if (i != last_found && is_of_s(cache[i])) {
      last_found = i;
      return cache[i];
    }
  }
  last_found = next_entry;
  Placement& l = cache[next_entry];
  next_entry = (next_entry + 1) % kEntries;
  l.model_id = id_;
  l.dp = s.dp;
  l.tp = s.tp;
  l.pp = s.pp;
  l.cp = s.cp;
  l.placement = s.placement;
  l.gpus = s.gpus;
  l.gpus_hash = hash;

  place_ranks(l, s);
  classify_replicas(l);
  find_dp_groups(l);
  return l;
}

// The memory of one pipeline rank's GPUs but for the activations its replica's microbatches
// keep in flight: what memory() computes once per rank for every share.
struct CostModel::RankMemory {
  MemoryBreakdown fixed;  // all but activations_gib
  int pp_rank = 0, layers = 0;
  double per_block = 0;      // stored activations of one block and microbatch
  double recomputed = 0;     // full recompute: the block being recomputed, else 0
  double embedding_sbh = 0;  // first rank: the embedding output's s * b * h (0 elsewhere)
  double embedding_div = 1;  // and its divisor (t with sequence parallelism)
  double logits = 0;         // last rank: logits and fp32 softmax (0 elsewhere)
};

MemoryBreakdown CostModel::memory(const Strategy& s, int replica, int pp_rank) const {
  const int share = s.dp_shares.empty() ? s.global_batch / s.dp : s.dp_shares[replica];
  return memory(s, rank_memory(s, pp_rank), share / s.microbatch_size);
}

CostModel::RankMemory CostModel::rank_memory(const Strategy& s, int pp_rank) const {
  const ChunkLayout chunks{s.stage_layers.empty() ? nullptr : &s.stage_layers, model_.layers,
                           s.num_chunks()};
  const int v = s.virtual_stages;
  int layers = 0;
  for (int c = 0; c < v; ++c) layers += chunks.count(c * s.pp + pp_rank);
  const bool first = pp_rank == 0;
  const bool last = pp_rank == s.pp - 1;
  const double t = s.tp;

  double params = layers * static_cast<double>(model_.params_per_layer()) / t;
  if (first) params += static_cast<double>(model_.embedding_params()) / t;
  if (last) {
    // Untied models own an output layer; tied ones keep a copy of the embedding when pp > 1.
    if (!model_.tied_embeddings)
      params += static_cast<double>(model_.output_params()) / t;
    else if (!first)
      params += static_cast<double>(model_.vocab) * model_.hidden / t;
  }

  RankMemory out;
  out.pp_rank = pp_rank;
  out.layers = layers;
  MemoryBreakdown& m = out.fixed;
  // ZeRO shards over the gradient-reduction group: the dp replicas times the cp ranks that
  // hold the same parameters (Megatron's distributed optimizer shards over dp x cp).
  const double dp = static_cast<double>(s.dp) * s.cp;
  m.weights_gib = params * kWeightBytesPerParam / (s.zero >= 3 ? dp : 1.0) / kGiB;
  // FP8 keeps an FP8 copy of every block weight and its transpose (1 + 1 bytes per parameter).
  if (s.fp8)
    m.weights_gib += layers * static_cast<double>(model_.params_per_layer()) / t * 2.0 / kGiB;
  m.gradients_gib = params * grad_bytes_per_param(model_) / (s.zero >= 2 ? dp : 1.0) / kGiB;
  m.optimizer_gib = params * kOptimizerBytesPerParam / (s.zero >= 1 ? dp : 1.0) / kGiB;
  m.reserved_gib = kReservedGiB;

  // Activations per block per microbatch (Korthikanti et al. 2022, generalised to GQA and
  // gated MLPs): bytes = sbh * (replicated + split / t) + attention scores.
  const double b = s.microbatch_size;
  const double seq = static_cast<double>(model_.seq_len) / s.cp;  // this context rank's part
  const double h = model_.hidden;
  const double f = model_.ffn_hidden;
  const double sbh = seq * b * h;
  const double kv_fraction = static_cast<double>(model_.kv_width()) / (2.0 * h);
  const bool gated = model_.activation == Activation::kSwiGLU;
  // Kept whole on every tp rank unless sequence parallel: norm inputs (4), QKV input (2),
  // two dropout masks (2), MLP input (2).
  const double replicated = 10.0 * sbh;
  // Split across tp ranks: Q (2), K and V (4 * kv_fraction), projection input (2), MLP
  // activation input and fc2 input (4 * f/h, 6 * f/h when gated).
  const double split = sbh * (2.0 + 4.0 * kv_fraction + 2.0 + (gated ? 6.0 : 4.0) * f / h);
  // Unfused attention stores the scores: softmax output, dropout mask and output (5 bytes per
  // score). Flash attention stores none, only the softmax statistics (fp32, one per row).
  const double scores = s.attention == Attention::kUnfused ? 5.0 * model_.heads * seq * seq * b
                                                           : 4.0 * model_.heads * seq * b;
  double per_block = 0;
  const double rep = s.sp ? replicated / t : replicated;
  switch (s.recompute) {
    case Recompute::kNone:
      per_block = rep + split / t + scores / t;
      break;
    case Recompute::kSelective:
      per_block = rep + split / t;
      break;
    case Recompute::kFull:
      per_block = 2.0 * sbh / (s.sp ? t : 1.0);
      break;
  }

  out.per_block = per_block;
  // The block being recomputed holds its full activations during its backward.
  if (s.recompute == Recompute::kFull) out.recomputed = rep + split / t + scores / t;
  if (first) {
    out.embedding_sbh = sbh;
    out.embedding_div = s.sp ? t : 1.0;
  }
  if (last) out.logits = 6.0 * seq * b * model_.vocab / t;  // logits + fp32 softmax
  return out;
}

MemoryBreakdown CostModel::memory(const Strategy& s, const RankMemory& rank,
                                  int microbatches) const {
  // Microbatches in flight on this pipeline rank (the schedule decides).
  const int v = s.virtual_stages;
  const int pp_rank = rank.pp_rank;
  const int layers = rank.layers;
  const double layers_per_chunk = static_cast<double>(layers) / v;
  double stored_layer_passes = 0;
  switch (s.schedule) {
    case Schedule::kGPipe:
      stored_layer_passes = layers * static_cast<double>(microbatches);
      break;
    case Schedule::k1F1B:
      stored_layer_passes = layers * static_cast<double>(std::min(s.pp - pp_rank, microbatches));
      break;
    case Schedule::kInterleaved: {
      const int warmup = (s.pp - pp_rank - 1) * 2 + (v - 1) * s.pp + 1;
      stored_layer_passes = layers_per_chunk * std::min(warmup, microbatches * v);
      break;
    }
  }
  double activations = stored_layer_passes * rank.per_block;
  if (s.recompute == Recompute::kFull) activations += rank.recomputed;
  const double in_flight =
      std::min(static_cast<double>(microbatches),
               static_cast<double>(s.schedule == Schedule::kGPipe ? microbatches : s.pp - pp_rank));
  if (pp_rank == 0) {  // embedding out + mask
    activations += in_flight * 3.0 * rank.embedding_sbh / rank.embedding_div;
  }
  if (pp_rank == s.pp - 1) activations += rank.logits;
  MemoryBreakdown m = rank.fixed;
  m.activations_gib = activations / kGiB;
  return m;
}

namespace {

// Per (replica, pipeline rank): one microbatch's forward, backward (with recompute), TP
// collectives, exposed ring-attention transfers and p2p on the slowest GPU of its
// tensor-parallel and context-parallel groups.
struct RankTime {
  double fwd, bwd, recompute, tp, cp, p2p, slow;
  int type;
  bool failed;
  double total() const { return fwd + bwd + tp + cp + p2p; }
};

// What run()'s timing pass finds: the replicas it timed, the critical one (the first of the
// slowest) with its pipeline time and rank times, or the first rank found on a failed GPU.
struct Timing {
  std::vector<int> visits;  // the replicas timed, ascending
  double worst_pipeline = -1;
  int critical = 0;
  std::vector<RankTime> critical_times;  // per pipeline rank
  int failed_visit = -1;                 // index in visits of the replica on a failed GPU
  int failed_stage = 0;
};

// The strategy fields the timing pass does not read: they shape only the data-parallel
// reduction, the optimizer step and memory. A kept timing's strategy takes them from the
// strategy looked up before the comparison, so that every other field (any added later too)
// takes part in it.
void copy_untimed_fields(const Strategy& from, Strategy& to) {
  to.zero = from.zero;
  to.overlap_grad_reduce = from.overlap_grad_reduce;
  to.overlap_param_gather = from.overlap_param_gather;
  to.compression = from.compression;
  to.compression_overrides = from.compression_overrides;
}

// Everything evaluate() reads of conditions `c` whose off-nominal GPUs and nodes are `where`
// (every other entry is nominal): the vectors' sizes and the listed entries, as bit patterns
// so that equal signatures mean identical conditions.
void conditions_signature(const Conditions& c, const OffNominal& where,
                          std::vector<uint64_t>& out) {
  auto bits = [](double x) { return std::bit_cast<uint64_t>(x); };
  // Sized once and written through a pointer: this runs on every evaluation, and appending
  // word by word costs a capacity check per word.
  out.resize(6 + 3 * (where.gpus.size() + where.nodes.size()));
  uint64_t* word = out.data();
  *word++ = c.gpu_speed.size();
  *word++ = c.gpu_failed.size();
  *word++ = c.node_inter_bw.size();
  *word++ = c.node_intra_bw.size();
  *word++ = where.gpus.size();
  *word++ = where.nodes.size();
  for (const int g : where.gpus) {
    const size_t i = static_cast<size_t>(g);
    *word++ = i;
    *word++ = i < c.gpu_speed.size() ? bits(c.gpu_speed[i]) : 0;
    *word++ = i < c.gpu_failed.size() && c.gpu_failed[i];
  }
  for (const int n : where.nodes) {
    const size_t i = static_cast<size_t>(n);
    *word++ = i;
    *word++ = i < c.node_inter_bw.size() ? bits(c.node_inter_bw[i]) : 0;
    *word++ = i < c.node_intra_bw.size() ? bits(c.node_intra_bw[i]) : 0;
  }
}

// A few (layout class, share) pairs, without allocating. insert() says whether a pair is new;
// a pair past the first kMax is never remembered, so it reads as new every time (its replicas
// are then handled again: slower, never wrong).
class ClassShareSet {
 public:
  bool insert(int layout_class, int share) {
    for (int i = 0; i < size_; ++i) {
      if (pairs_[i].layout_class == layout_class && pairs_[i].share == share) return false;
    }
    if (size_ < kMax) pairs_[size_++] = {layout_class, share};
    return true;
  }

 private:
  static constexpr int kMax = 16;
  struct Pair {
    int layout_class;
    int share;
  };
  Pair pairs_[kMax];
  int size_ = 0;
};

// A timing kept for reuse by the next evaluations on this thread (Evaluation::find_kept_timing).
struct KeptTiming {
  unsigned long long model_id = 0;
  Strategy strategy;
  std::vector<uint64_t> conditions;
  Timing timing;
};

// Per node, once per evaluation: p2p time to a GPU of the same node, the node's share of a
// network transfer (its seconds per byte), and one tensor-parallel collective.
struct NodeLinks {
  double intra_p2p_s;
  double intra_s_per_byte;
  double inter_s_per_byte;
  double tp_collective_s;
};

// Gradient traffic and parameters of one pipeline rank (Evaluation::rank_traffic).
struct RankTraffic {
  int layers = 0;
  double ar_bytes = 0, topk_bytes = 0, powersgd_flops = 0;
  double params = 0;
};

// How one pipeline rank's gradient-reduction group spreads over nodes (Evaluation::dp_group).
struct DpGroupLinks {
  int nodes_spanned = 0, min_members = 0;
  double inter_bw = kInf, intra_bw = kInf;
};

}  // namespace

// One run() of the model: the strategy, conditions and scratch its phases share. The phases are
// its member functions, called by run() in order; the members named like CostModel's refer to
// the model's own.
struct CostModel::Evaluation {
  // The per-thread buffers of the phases, reused from one evaluation to the next.
  struct Scratch {
    std::vector<NodeLinks> node_links;
    std::vector<int> link_slot;
    std::vector<int> rank_layers;
    std::vector<int> slowed;   // ranks (r, p) as r * pp + p, ascending, each once
    std::vector<int> unclean;  // replicas, ascending, each once
    std::vector<RankTime> times;
    std::vector<double> memory_totals;   // per distinct share, per pipeline rank
    std::vector<RankMemory> rank_memories;  // per pipeline rank
    std::vector<int> per_node;
    std::vector<int> class_left;  // per node class: nominal nodes a group spans
  };

  Evaluation(const CostModel& model, const Strategy& strategy, const Conditions& conditions,
             Work& w);

  void find_kept_timing();
  void find_node_links();
  void list_unclean();
  void list_visits();
  void time_visits();
  double worst_memory_ratio();
  void reduce_gradients();
  void assemble_breakdown(double memory_ratio);
  void fill_pipeline_timings();

  int rank_node(int r, int p, int k) const {
    return rank_nodes ? rank_nodes[(static_cast<size_t>(p) * dp + r) * cp + k]
                      : topo_.node_of_gpu[s.gpu_of_rank(r, p, 0, k)];
  }
  NodeLinks links_of(int n, double intra_factor, double inter_factor) const;
  const NodeLinks& links(int n) const { return scratch.node_links[scratch.link_slot[n]]; }
  double link_s(int na, int nb) const;
  double cp_ring_s(int r, int p, const BlockTimes& bt, double slow) const;
  RankTime rank_time(int r, int p, bool read_speeds) const;
  RankTraffic rank_traffic(int p) const;
  DpGroupLinks dp_group(int p);
  double dp_exposed_s(const RankTime& rt, const RankTraffic& traffic, const DpGroupLinks& group,
                      int microbatches) const;

  const CostModel& cm;
  const ModelSpec& model_;
  const ClusterTopology& topo_;
  const std::vector<int>& node_class_;
  const std::vector<int>& class_first_node_;
  const unsigned long long id_;
  const Strategy& s;
  const Conditions& c;
  Work& work;
  CostBreakdown& out;
  Scratch& scratch;
  const int pp;
  const int v;
  const ChunkLayout chunks;
  BlockTimes blocks[kMaxTypes];
  double tp_bytes = 0;
  int tp_collectives = 0;
  double p2p_bytes = 0;
  const Placement* layout_info = nullptr;
  const std::vector<int>* explicit_shares = nullptr;
  bool symmetric = false;
  Timing* timing = nullptr;
  bool timed = false;
  KeptTiming* filling = nullptr;  // the entry the timing pass fills, keyed once it is complete
  // rank_node()'s table (the layout's, or null to compute the node) and its dimensions.
  const int* rank_nodes = nullptr;
  int dp = 0, cp = 0;
  bool nominal_nodes = false;
  bool by_class = false;
  int uniform_share = 0;
  // Of the gradient reduction: the critical replica's microbatches and bottleneck rank, the
  // exposed data-parallel time and the optimizer step.
  int m = 0;
  RankTime bottleneck{};
  double dp_exposed = 0;
  double optimizer = 0;
  // One block's weights on one tp rank, for the gradient traffic (reduce_gradients).
  double block_params = 0, grad_reduce = 0, matrix_params = 0;
  double mat_rows[4] = {}, mat_cols[4] = {};
};

CostModel::Evaluation::Evaluation(const CostModel& model, const Strategy& strategy,
                                  const Conditions& conditions, Work& w)
    : cm(model),
      model_(model.model_),
      topo_(model.topo_),
      node_class_(model.node_class_),
      class_first_node_(model.class_first_node_),
      id_(model.id_),
      s(strategy),
      c(conditions),
      work(w),
      out(w.result),
      scratch([]() -> Scratch& {
        thread_local Scratch per_thread;
        return per_thread;
      }()),
      pp(strategy.pp),
      v(strategy.virtual_stages),
      chunks{strategy.stage_layers.empty() ? nullptr : &strategy.stage_layers,
             model.model_.layers, strategy.num_chunks()} {
  // Block timings per GPU type present (few types; computed once per evaluation).
  assert(topo_.types.size() <= kMaxTypes);
  for (size_t i = 0; i < topo_.types.size(); ++i)
    blocks[i] = cm.block_times(static_cast<int>(i), s);

  // Tokens of one microbatch on one context-parallel rank.
  const double tokens = static_cast<double>(s.microbatch_size) * model_.seq_len / s.cp;
  tp_bytes = tokens * model_.hidden * 2.0;  // one TP collective's buffer
  tp_collectives =
      s.tp > 1 ? 4 + (s.recompute == Recompute::kFull ? 2 : 0) : 0;  // per block per microbatch
  p2p_bytes = tp_bytes / s.tp;  // scatter-gather: each tp rank sends its slice

  // Replicas are interchangeable when nothing distinguishes them: one layout class (every
  // replica's ranks on the same node classes with the same neighbours), nominal conditions and
  // uniform shares. Then replica 0 stands for all of them. The reference path times them all.
  layout_info = work.exhaustive ? nullptr : &cm.placement(s);
  explicit_shares = s.dp_shares.empty() ? nullptr : &s.dp_shares;
  symmetric = layout_info && layout_info->one_class && work.where->gpus.empty() &&
              work.where->nodes.empty() && !explicit_shares;

  // The node of the first GPU of context rank k of (replica r, pipeline rank p): the layout's
  // table, else computed.
  rank_nodes = layout_info ? layout_info->rank_nodes.data() : nullptr;
  dp = s.dp;
  cp = s.cp;

  nominal_nodes = work.where->nodes.empty();
  by_class = !symmetric && layout_info;
  uniform_share = s.global_batch / s.dp;
}

// The timing pass reads the strategy's layout, batch split and per-rank work, and the
// conditions, but none of the untimed fields: the planner evaluates one strategy several times
// over in a row with only those changed (ZeRO stages, gradient compression), so the last two
// timings are kept per thread, keyed on the model, the strategy and the conditions' signature
// (more entries cost more in lookups than they find). The reference path times afresh. Sets
// `timing` to the kept timing found (`timed`), else to the entry the pass is to fill.
void CostModel::Evaluation::find_kept_timing() {
  constexpr int kKeptTimings = 2;
  thread_local KeptTiming kept[kKeptTimings];
  thread_local int next_kept = 0;
  thread_local std::vector<uint64_t> signature;
  thread_local Timing fresh;
  timing = &fresh;
  timed = false;
  filling = nullptr;
  if (!work.exhaustive) {
    conditions_signature(c, *work.where, signature);
    for (KeptTiming& entry : kept) {
      if (entry.model_id != id_ || entry.conditions != signature) continue;
      copy_untimed_fields(s, entry.strategy);
      if (entry.strategy == s) {
        timing = &entry.timing;
        timed = true;
        break;
      }
    }
    if (!timed) {
      filling = &kept[next_kept];
      next_kept = (next_kept + 1) % kKeptTimings;
      filling->model_id = 0;  // no model's until filled
      filling->strategy = s;
      filling->conditions = signature;
      timing = &filling->timing;
    }
  }
}

NodeLinks CostModel::Evaluation::links_of(int n, double intra_factor, double inter_factor) const {
  NodeLinks result;
  const double intra_Bps = topo_.nodes[n].intra_GBps * 1e9 * topo_.intra_efficiency * intra_factor;
  result.intra_p2p_s = topo_.intra_latency_s + p2p_bytes / intra_Bps;
  result.intra_s_per_byte = 1.0 / intra_Bps;
  result.inter_s_per_byte =
      1.0 / (topo_.nodes[n].inter_GBps * inter_factor * 1e9 * topo_.inter_efficiency);
  result.tp_collective_s = ring_allreduce_s(s.tp, tp_bytes, intra_Bps, topo_.intra_latency_s);
  return result;
}

// Node n's links are node_links[link_slot[n]]. Nodes at nominal bandwidth share their class's
// entry (computed once per class: links_of depends on the node only through its class's
// bandwidths), each off-nominal node has its own; the reference path gives every node its own.
// Also counts the transformer blocks each pipeline rank holds (all its chunks).
void CostModel::Evaluation::find_node_links() {
  std::vector<NodeLinks>& node_links = scratch.node_links;
  std::vector<int>& link_slot = scratch.link_slot;
  node_links.clear();
  if (work.exhaustive) {
    link_slot.resize(topo_.nodes.size());
    for (int n = 0; n < topo_.num_nodes(); ++n) {
      link_slot[n] = n;
      node_links.push_back(links_of(n, c.intra(n), c.inter(n)));
    }
  } else {
    for (int n : class_first_node_) node_links.push_back(links_of(n, 1.0, 1.0));
    link_slot.assign(node_class_.begin(), node_class_.end());
    for (int n : work.where->nodes) {
      if (n >= topo_.num_nodes()) continue;
      link_slot[n] = static_cast<int>(node_links.size());
      node_links.push_back(links_of(n, c.intra(n), c.inter(n)));
    }
  }

  scratch.rank_layers.assign(pp, 0);
  for (int chunk = 0; chunk < s.num_chunks(); ++chunk)
    scratch.rank_layers[chunk % pp] += chunks.count(chunk);
}

// One p2p message between GPUs on nodes na and nb: NVLink inside a node, else the slower
// network end.
double CostModel::Evaluation::link_s(int na, int nb) const {
  if (na == nb) return links(na).intra_p2p_s;
  return topo_.inter_latency_s +
         p2p_bytes * std::max(links(na).inter_s_per_byte, links(nb).inter_s_per_byte);
}

// Ring attention: per block, every context rank passes the keys and values it holds cp - 1
// times forward, and keys, values and their gradients (twice the bytes) backward. Each step
// runs under the attention of the block that arrived before it; what the attention cannot
// hide is exposed. Inside a node the ring runs over NVLink, else at its slowest network end.
double CostModel::Evaluation::cp_ring_s(int r, int p, const BlockTimes& bt, double slow) const {
  const int first = rank_node(r, p, 0);
  bool spans = false;
  double inter_s_per_byte = links(first).inter_s_per_byte;
  for (int k = 1; k < s.cp; ++k) {
    const int node = rank_node(r, p, k);
    spans = spans || node != first;
    inter_s_per_byte = std::max(inter_s_per_byte, links(node).inter_s_per_byte);
  }
  auto step_s = [&](double bytes) {
    return spans ? topo_.inter_latency_s + bytes * inter_s_per_byte
                 : topo_.intra_latency_s + bytes * links(first).intra_s_per_byte;
  };
  return exposed_cp_ring_s(s.cp, step_s(bt.kv_block_bytes), step_s(2.0 * bt.kv_block_bytes),
                           bt.attention_fwd, bt.attention_bwd, slow,
                           s.recompute == Recompute::kFull);
}

// One microbatch on rank (r, p). `read_speeds` false: no GPU of the rank is slowed or failed
// (it runs at speed 1).
RankTime CostModel::Evaluation::rank_time(int r, int p, bool read_speeds) const {
  RankTime rt{};
  const int node0 = rank_node(r, p, 0);
  rt.type = topo_.nodes[node0].type;
  double slow = 1.0;
  if ((!c.gpu_speed.empty() || !c.gpu_failed.empty()) && read_speeds) {
    // The stage's tp x cp GPUs are gpu0 .. gpu0 + tp * cp - 1 under the placement orders,
    // or listed one by one under an explicit placement.
    const int gpu0 = s.gpu_of_rank(r, p, 0);
    const bool contiguous = s.gpus.empty();
    double speed = kInf;
    for (int k = 0; k < s.cp; ++k) {
      for (int i = 0; i < s.tp; ++i) {
        const int g = contiguous ? gpu0 + k * s.tp + i : s.gpu_of_rank(r, p, i, k);
        if (!c.gpu_failed.empty() && c.gpu_failed[g]) rt.failed = true;
        if (!c.gpu_speed.empty()) speed = std::min(speed, c.gpu_speed[g]);
      }
    }
    slow = speed == kInf ? 1.0 : 1.0 / speed;
  }
  rt.slow = slow;
  const BlockTimes& bt = blocks[rt.type];
  // Each collective pairs with half of a pass's linear GEMMs (QKV and projection, or the MLP).
  // Every tensor-parallel group sits in one node; when the context ranks span nodes, the
  // slowest node's collectives set the pace.
  double tp_collective_s = links(node0).tp_collective_s;
  for (int k = 1; k < s.cp; ++k) {
    const int node = rank_node(r, p, k);
    tp_collective_s = std::max(tp_collective_s, links(node).tp_collective_s);
  }
  const double one_collective = exposed_tp_collective_s(tp_collective_s, s.tp, s.tp_comm_overlap,
                                                        0.5 * bt.linear_gemms_fwd * slow);
  const int layers = scratch.rank_layers[p];
  if (pp > 1) {
    // Activations go to the next chunk, input gradients back to the previous one: every
    // chunk but the last sends forward, every chunk but the first sends backward.
    const double to_next = link_s(node0, rank_node(r, (p + 1) % pp, 0));
    const double to_prev = link_s(node0, rank_node(r, (p + pp - 1) % pp, 0));
    rt.p2p = (v - (p == pp - 1 ? 1 : 0)) * to_next + (v - (p == 0 ? 1 : 0)) * to_prev;
  }
  rt.fwd = layers * bt.fwd;
  rt.bwd = layers * bt.bwd;
  rt.recompute = layers * bt.recompute;
  if (p == 0) {
    rt.fwd += bt.first_fwd;
    rt.bwd += bt.first_bwd;
  }
  if (p == pp - 1) {
    rt.fwd += bt.last_fwd;
    rt.bwd += bt.last_bwd;
  }
  rt.fwd *= slow;
  rt.recompute *= slow;
  rt.bwd = rt.bwd * slow + rt.recompute;
  rt.tp = layers * tp_collectives * one_collective;
  if (s.cp > 1) rt.cp = layers * cp_ring_s(r, p, bt, slow);
  return rt;
}

// Otherwise replicas still come in classes. A replica none of whose GPUs is slowed or failed
// and none of whose nodes has a bandwidth factor other than 1 ("clean") times exactly like an
// earlier clean replica with the same share and the same layout class (same node classes and
// same node boundaries between pipeline neighbours, rank by rank): it cannot raise the worst
// pipeline, memory or capacity found so far and is skipped. Conditions are sparse, so listing
// the unclean replicas costs little; the layout's classes are cached. The ranks holding a
// slowed or failed GPU are listed too: the others run at speed 1.
void CostModel::Evaluation::list_unclean() {
  std::vector<int>& slowed = scratch.slowed;
  std::vector<int>& unclean = scratch.unclean;
  if (!by_class) return;
  slowed.clear();
  unclean.clear();
  for (int g : work.where->gpus) {
    const int rank = g < topo_.num_gpus() ? layout_info->rank_of_gpu[g] : -1;
    if (rank >= 0) slowed.push_back(rank);
  }
  std::sort(slowed.begin(), slowed.end());
  slowed.erase(std::unique(slowed.begin(), slowed.end()), slowed.end());
  for (int rank : slowed) unclean.push_back(rank / pp);
  for (int n : work.where->nodes) {
    if (n >= topo_.num_nodes()) continue;
    const ClusterTopology::Node& node = topo_.nodes[n];
    for (int g = node.first_gpu; g < node.first_gpu + node.gpus; ++g) {
      const int rank = layout_info->rank_of_gpu[g];
      if (rank >= 0) unclean.push_back(rank / pp);
    }
  }
  std::sort(unclean.begin(), unclean.end());
  unclean.erase(std::unique(unclean.begin(), unclean.end()), unclean.end());
}

// The replicas to time, in replica order: all of them on the reference path, replica 0 for
// interchangeable ones, else each unclean replica and the first clean one of each layout class
// and share. Like replicas come in runs (the layout's runs of one class, split where the share
// changes), so the walk goes stretch by stretch, not replica by replica.
void CostModel::Evaluation::list_visits() {
  const std::vector<int>& unclean = scratch.unclean;
  std::vector<int>& visits = timing->visits;
  visits.clear();
  if (symmetric) {
    visits.push_back(0);
  } else if (!by_class) {
    for (int r = 0; r < s.dp; ++r) visits.push_back(r);
  } else {
    // (layout class, share) of the clean replicas timed so far.
    ClassShareSet timed_classes;
    const int* const shares = explicit_shares ? explicit_shares->data() : nullptr;
    const std::vector<int>& runs = layout_info->class_runs;
    size_t next_unclean = 0;  // unclean[next_unclean] is the first unclean replica not visited
    for (size_t k = 0; k + 1 < runs.size(); ++k) {
      const int run_end = runs[k + 1];
      const int layout_class = layout_info->replica_class[runs[k]];
      for (int begin = runs[k], end; begin < run_end; begin = end) {
        // A stretch [begin, end) of one layout class and one share.
        const int share = shares ? shares[begin] : uniform_share;
        end = shares ? static_cast<int>(std::find_if(shares + begin + 1, shares + run_end,
                                                     [&](int x) { return x != share; }) -
                                        shares)
                     : run_end;
        bool clean_met = false;
        for (int r = begin; r < end;) {
          if (next_unclean < unclean.size() && unclean[next_unclean] == r) {
            visits.push_back(r);
            ++next_unclean;
            ++r;
            continue;
          }
          if (!clean_met) {
            // The stretch's first clean replica stands for its other clean ones.
            clean_met = true;
            if (timed_classes.insert(layout_class, share)) visits.push_back(r);
          }
          // Clean replicas up to the next unclean one are skipped.
          r = next_unclean < unclean.size() ? std::min(unclean[next_unclean], end) : end;
        }
      }
    }
  }
}

// Pass over the replicas to time: the pipeline time of each, the critical replica and its rank
// times, or the first rank on a failed GPU.
void CostModel::Evaluation::time_visits() {
  const std::vector<int>& slowed = scratch.slowed;
  const std::vector<int>& visits = timing->visits;
  std::vector<RankTime>& times = scratch.times;  // per pipeline rank
  times.resize(pp);
  timing->critical_times.resize(pp);
  timing->worst_pipeline = -1;
  timing->critical = 0;
  timing->failed_visit = -1;
  size_t next_slowed = 0;  // visits ascend: slowed[next_slowed] is the next slowed rank to meet
  for (size_t i = 0; i < visits.size() && timing->failed_visit < 0; ++i) {
    const int r = visits[i];
    const int share = explicit_shares ? (*explicit_shares)[r] : uniform_share;
    const int microbatches = share / s.microbatch_size;
    double sum = 0, max = 0;
    for (int p = 0; p < pp; ++p) {
      // Without classes every rank reads its GPUs' speeds.
      bool read_speeds = !by_class;
      if (by_class) {
        const int rank = r * pp + p;
        while (next_slowed < slowed.size() && slowed[next_slowed] < rank) ++next_slowed;
        read_speeds = next_slowed < slowed.size() && slowed[next_slowed] == rank;
      }
      RankTime& rt = times[p];
      rt = rank_time(r, p, read_speeds);
      if (rt.failed) {
        timing->failed_visit = static_cast<int>(i);
        timing->failed_stage = p;
        break;
      }
      sum += rt.total();
      max = std::max(max, rt.total());
    }
    if (timing->failed_visit >= 0) break;
    const double pipeline = microbatches * max + (sum - max) / v;
    if (pipeline > timing->worst_pipeline) {
      timing->worst_pipeline = pipeline;
      timing->critical = r;
      times.swap(timing->critical_times);
    }
  }
  if (filling) filling->model_id = id_;
}

// Memory of each rank of the replicas timed, up to a failed one's first failed rank: the GPU
// with the least headroom (its footprint and capacity go to the breakdown). Returns its
// footprint over its capacity, or -1 when no rank was checked.
double CostModel::Evaluation::worst_memory_ratio() {
  double worst_ratio = -1;
  constexpr int kMaxMemoryShares = 8;
  int memory_shares[kMaxMemoryShares];
  int memory_shares_count = 0;
  std::vector<double>& memory_totals = scratch.memory_totals;
  std::vector<RankMemory>& rank_memories = scratch.rank_memories;
  rank_memories.clear();
  for (int p = 0; p < pp; ++p) rank_memories.push_back(cm.rank_memory(s, p));
  const std::vector<int>& visits = timing->visits;
  const size_t visits_read =
      timing->failed_visit >= 0 ? static_cast<size_t>(timing->failed_visit) + 1 : visits.size();
  // Replicas of one layout class hold the same GPU types rank by rank (the class fixes their
  // nodes' classes): of those with one share, only the first can raise the worst ratio.
  ClassShareSet checked;
  for (size_t i = 0; i < visits_read; ++i) {
    const int r = visits[i];
    // Memory differs between replicas only through microbatch counts and GPU types; the
    // uniform case needs replica 0 only.
    if (!(r == 0 || explicit_shares || topo_.types.size() > 1)) continue;
    const int share = explicit_shares ? (*explicit_shares)[r] : uniform_share;
    if (layout_info && !checked.insert(layout_info->replica_class[r], share)) continue;
    // Memory depends on the replica only through its share: once per distinct share.
    int memory_slot = -1;
    if (!work.exhaustive) {
      for (int k = 0; k < memory_shares_count && memory_slot < 0; ++k) {
        if (memory_shares[k] == share) memory_slot = k;
      }
      if (memory_slot < 0 && memory_shares_count < kMaxMemoryShares) {
        memory_slot = memory_shares_count++;
        memory_shares[memory_slot] = share;
        memory_totals.resize(static_cast<size_t>(memory_shares_count) * pp);
        for (int p = 0; p < pp; ++p) {
          memory_totals[memory_slot * pp + p] =
              cm.memory(s, rank_memories[p], share / s.microbatch_size).total_gib();
        }
      }
    }
    const int ranks = static_cast<int>(i) == timing->failed_visit ? timing->failed_stage : pp;
    for (int p = 0; p < ranks; ++p) {
      const double total =
          memory_slot >= 0 ? memory_totals[memory_slot * pp + p]
                           : cm.memory(s, rank_memories[p], share / s.microbatch_size).total_gib();
      const double capacity = topo_.types[topo_.nodes[rank_node(r, p, 0)].type].memory_gib;
      const double ratio = total / capacity;
      // The footprint and capacity of one GPU, the one with the least headroom: on GPUs of
      // different memory sizes the largest footprint may sit on the largest GPU.
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        out.memory_gib = total;
        out.memory_capacity_gib = capacity;
      }
    }
  }
  return worst_ratio;
}

// Parameters and gradient traffic of pipeline rank p (all its chunks).
RankTraffic CostModel::Evaluation::rank_traffic(int p) const {
  const double h = model_.hidden;
  const double t = s.tp;
  RankTraffic traffic;
  double& ar_bytes = traffic.ar_bytes;
  // Traffic of n blocks whose gradients travel with compression `comp`.
  auto add_traffic = [&](int n, const Compression& comp) {
    switch (comp.kind) {
      case Compression::Kind::kNone:
        ar_bytes += n * block_params * grad_reduce;
        break;
      case Compression::Kind::kFP16:
        ar_bytes += n * block_params * 2.0;
        break;
      case Compression::Kind::kTopK:
        traffic.topk_bytes += n * block_params * comp.topk_ratio * 6.0;
        break;
      case Compression::Kind::kPowerSGD: {
        double low_rank = 0;
        for (int i = 0; i < 4; ++i) low_rank += (mat_rows[i] + mat_cols[i]) * comp.powersgd_rank;
        ar_bytes += n * (low_rank + block_params - matrix_params) * grad_reduce;
        traffic.powersgd_flops += n * 6.0 * matrix_params * comp.powersgd_rank;
        break;
      }
    }
  };
  for (int k = 0; k < v; ++k) {
    const int chunk = k * pp + p;
    const int n = chunks.count(chunk);
    traffic.layers += n;
    if (s.compression_overrides.empty()) {
      add_traffic(n, s.compression);
    } else {
      const int first_layer = chunks.first_layer(chunk);
      for (int l = first_layer; l < first_layer + n; ++l)
        add_traffic(1, s.compression_of_layer(l));
    }
  }
  double params = traffic.layers * block_params;
  double extra = 0;
  if (p == 0) extra += static_cast<double>(model_.embedding_params()) / t;
  if (p == pp - 1) {
    if (!model_.tied_embeddings)
      extra += static_cast<double>(model_.output_params()) / t;
    else if (p != 0)
      extra += static_cast<double>(model_.vocab) * h / t;
  }
  params += extra;
  ar_bytes += extra * grad_reduce;
  traffic.params = params;
  return traffic;
}

// The data-parallel group of pipeline rank p: how it spreads over nodes sets its bandwidth.
DpGroupLinks CostModel::Evaluation::dp_group(int p) {
  const int reducers = s.dp * s.cp;  // ranks holding the same parameters
  int nodes_spanned = 0, min_members = reducers;
  double inter_bw = kInf, intra_bw = kInf;
  if (layout_info) {
    const Placement::DpGroup& group = layout_info->dp_groups[p];
    nodes_spanned = group.nodes_spanned;
    min_members = group.min_members;
    inter_bw = group.inter_GBps;
    intra_bw = group.intra_GBps;
    if (!nominal_nodes) {
      // The slowest links over the spanned nodes: each off-nominal one's own, and its class's
      // for every class with a spanned node at nominal bandwidth (a minimum, so the order it is
      // taken in does not matter). The group spans a node when a context rank of stage p
      // starts on it.
      std::vector<int>& class_left = scratch.class_left;
      inter_bw = intra_bw = kInf;
      const size_t node_classes = class_first_node_.size();
      const int* const spanned = layout_info->spanned_classes.data() + p * node_classes;
      class_left.assign(spanned, spanned + node_classes);
      for (int n : work.where->nodes) {
        if (n >= topo_.num_nodes()) continue;
        const ClusterTopology::Node& node = topo_.nodes[n];
        bool spans = false;
        for (int g = node.first_gpu; g < node.first_gpu + node.gpus && !spans; ++g) {
          const int rank = layout_info->rank_of_gpu[g];
          if (rank < 0 || rank % pp != p) continue;
          for (int k = 0; k < s.cp && !spans; ++k) spans = rank_node(rank / pp, p, k) == n;
        }
        if (!spans) continue;
        --class_left[node_class_[n]];
        inter_bw = std::min(inter_bw, node.inter_GBps * c.inter(n));
        intra_bw = std::min(intra_bw, node.intra_GBps * c.intra(n));
      }
      for (size_t k = 0; k < node_classes; ++k) {
        if (class_left[k] == 0) continue;
        const ClusterTopology::Node& node = topo_.nodes[class_first_node_[k]];
        inter_bw = std::min(inter_bw, node.inter_GBps);
        intra_bw = std::min(intra_bw, node.intra_GBps);
      }
    }
  } else {
    std::vector<int>& per_node = scratch.per_node;
    for (int member = 0; member < reducers; ++member) {
      const int node = topo_.node_of_gpu[s.gpu_of_rank(member / s.cp, p, 0, member % s.cp)];
      if (per_node[node]++ == 0) {
        ++nodes_spanned;
        inter_bw = std::min(inter_bw, topo_.nodes[node].inter_GBps * c.inter(node));
        intra_bw = std::min(intra_bw, topo_.nodes[node].intra_GBps * c.intra(node));
      }
    }
    for (int member = 0; member < reducers; ++member) {
      int& count = per_node[topo_.node_of_gpu[s.gpu_of_rank(member / s.cp, p, 0, member % s.cp)]];
      if (count > 0) min_members = std::min(min_members, count);
      count = 0;
    }
  }
  return {nodes_spanned, min_members, inter_bw, intra_bw};
}

// The gradient reduction of one pipeline rank (its timing `rt`, its traffic, its group's
// links; m microbatches), exposed beyond what overlaps with the backward pass, plus ZeRO's
// parameter gathers.
double CostModel::Evaluation::dp_exposed_s(const RankTime& rt, const RankTraffic& traffic,
                                           const DpGroupLinks& group,
                                           int microbatches) const {
  const int reducers = s.dp * s.cp;
  const double params = traffic.params;
  double bw, latency;
  if (group.nodes_spanned == 1) {
    bw = group.intra_bw * 1e9 * topo_.intra_efficiency;
    latency = topo_.intra_latency_s;
  } else {
    // Each member drives its own NIC; members sharing a node pool their NICs over NVLink.
    bw = group.min_members * group.inter_bw * 1e9 * topo_.inter_efficiency;
    if (group.min_members > 1) bw = std::min(bw, group.intra_bw * 1e9 * topo_.intra_efficiency);
    latency = topo_.inter_latency_s;
  }
  const int n = reducers;
  double grads;
  double after_backward = 0;  // ZeRO's parameter all-gather after the step
  if (s.zero >= 1) {
    grads = ring_gather_s(n, traffic.ar_bytes, bw, latency);  // reduce-scatter
    after_backward = ring_gather_s(n, params * kWeightBytesPerParam, bw, latency);
    if (s.overlap_param_gather) {
      // Megatron's overlap_param_gather: bucket by bucket under the next forward pass, each
      // bucket needed only by its own layers; the first bucket waits.
      const double first_bucket =
          after_backward * std::min(1.0, kBucketParams / std::max(params, 1.0));
      after_backward = std::max(after_backward - rt.fwd, first_bucket);
    }
  } else {
    grads = ring_allreduce_s(n, traffic.ar_bytes, bw, latency);
  }
  grads += ring_gather_s(n, traffic.topk_bytes * n, bw, latency);  // sparse top-k: all-gather
  const double flops_Bps =
      topo_.types[rt.type].peak_tflops * 1e12 * topo_.types[rt.type].gemm_efficiency;
  grads += traffic.powersgd_flops / flops_Bps * rt.slow;
  double exposed = grads;
  if (s.overlap_grad_reduce) {
    const double last_bucket = grads * std::min(1.0, kBucketParams / std::max(params, 1.0));
    exposed = std::max(grads - rt.bwd / v, last_bucket);
  }
  exposed += after_backward;
  if (s.zero >= 3) {
    // Parameters gathered before each forward and backward, prefetched under compute.
    const double gather = ring_gather_s(n, params * kWeightBytesPerParam, bw, latency);
    exposed += microbatches * std::max(0.0, 2.0 * gather - (rt.fwd + rt.bwd));
  }
  return exposed;
}

// Over the critical replica's pipeline ranks: its bottleneck rank, the data-parallel reduction
// exposed beyond the backward it can hide under, and the optimizer step.
void CostModel::Evaluation::reduce_gradients() {
  const std::vector<RankTime>& critical_times = timing->critical_times;
  const int critical_share =
      explicit_shares ? (*explicit_shares)[timing->critical] : uniform_share;
  m = critical_share / s.microbatch_size;
  bottleneck = RankTime{};
  double bwd_before = 0;  // backward time of the ranks before p (slack for the DP reduction)
  dp_exposed = 0;
  optimizer = 0;

  const double h = model_.hidden;
  const double f = model_.ffn_hidden;
  const double t = s.tp;
  const double kv_per_rank = model_.kv_heads >= s.tp ? static_cast<double>(model_.kv_width()) / t
                                                     : 2.0 * model_.head_dim();
  const bool gated = model_.activation == Activation::kSwiGLU;
  block_params = static_cast<double>(model_.params_per_layer()) / t;
  grad_reduce = grad_bytes_per_param(model_);
  // Weight matrices of one block on one tp rank (rows x cols), for PowerSGD.
  const double rows[4] = {h, h / t, h, f / t};
  const double cols[4] = {h / t + kv_per_rank, h, (gated ? 2.0 : 1.0) * f / t, h};
  std::copy(rows, rows + 4, mat_rows);
  std::copy(cols, cols + 4, mat_cols);
  matrix_params = 0;
  for (int i = 0; i < 4; ++i) matrix_params += mat_rows[i] * mat_cols[i];

  if (!layout_info) scratch.per_node.assign(topo_.nodes.size(), 0);
  for (int p = 0; p < pp; ++p) {
    const RankTime& rt = critical_times[p];
    if (rt.total() > bottleneck.total()) bottleneck = rt;

    const RankTraffic traffic = rank_traffic(p);

    // Optimizer step on the parameters this rank owns; with FP8, then the cast of every block
    // weight it holds to FP8 and its transpose (read 2, write 1 + 1 bytes per parameter).
    const int reducers = s.dp * s.cp;  // ranks holding the same parameters
    const double owned = s.zero >= 1 ? traffic.params / reducers : traffic.params;
    const double fp8_casts = s.fp8 ? traffic.layers * block_params * kFp8CastBytesPerParam : 0.0;
    optimizer = std::max(
        optimizer, (owned * kAdamBytesPerParam + fp8_casts) / blocks[rt.type].hbm_Bps * rt.slow);

    if (reducers > 1) {
      const double exposed = dp_exposed_s(rt, traffic, dp_group(p), m);
      if (work.timings) work.timings->dp_exposed_s.push_back(exposed);
      dp_exposed = std::max(dp_exposed, exposed - bwd_before);
    } else if (work.timings) {
      work.timings->dp_exposed_s.push_back(0);
    }
    bwd_before += rt.bwd / v + rt.p2p / (2.0 * v);
  }
}

// The breakdown from the critical replica, with throughput and utilisation.
void CostModel::Evaluation::assemble_breakdown(double memory_ratio) {
  const double worst_pipeline = timing->worst_pipeline;
  out.feasible = true;
  out.compute_s = m * (bottleneck.fwd + bottleneck.bwd - bottleneck.recompute);
  out.recompute_s = m * bottleneck.recompute;
  out.tp_comm_s = m * bottleneck.tp;
  out.cp_comm_s = m * bottleneck.cp;
  out.pp_comm_s = m * bottleneck.p2p;
  out.bubble_s = std::max(0.0, worst_pipeline - m * bottleneck.total());
  out.dp_comm_s = dp_exposed;
  out.optimizer_s = optimizer;
  out.iteration_time_s = worst_pipeline + dp_exposed + optimizer;
  out.fits_in_memory = memory_ratio <= 1.0;
  if (!out.fits_in_memory) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "needs %.1f GiB per GPU, more than the %.0f GiB available",
                  out.memory_gib, out.memory_capacity_gib);
    out.reason = buf;
  }

  const int gpus = s.num_gpus();
  double peak_sum = gpus * topo_.types[0].peak_tflops * 1e12;
  if (layout_info) {
    peak_sum = layout_info->peak_flops;
  } else if (topo_.types.size() > 1) {
    peak_sum = 0;
    for (int r = 0; r < s.dp; ++r) {
      for (int p = 0; p < pp; ++p) {
        for (int k = 0; k < s.cp; ++k) {
          peak_sum +=
              s.tp * topo_.types[topo_.type_of_gpu[s.gpu_of_rank(r, p, 0, k)]].peak_tflops * 1e12;
        }
      }
    }
  }
  out.model_flops = iteration_model_flops(model_, s.global_batch, s.recompute == Recompute::kFull);
  out.tflops_per_gpu = out.model_flops / (gpus * out.iteration_time_s) / 1e12;
  out.mfu =
      iteration_model_flops(model_, s.global_batch, false) / (peak_sum * out.iteration_time_s);
  out.tokens_per_s = static_cast<double>(s.global_batch) * model_.seq_len / out.iteration_time_s;
}

// The critical replica's timeline, chunk by chunk, for the Chrome-trace export.
void CostModel::Evaluation::fill_pipeline_timings() {
  const int critical = timing->critical;
  const std::vector<RankTime>& critical_times = timing->critical_times;
  PipelineTimings& tl = *work.timings;
  tl.replica = critical;
  tl.microbatches = m;
  tl.optimizer_s = optimizer;
  const int chunk_count = s.num_chunks();
  tl.forward_s.assign(chunk_count, 0);
  tl.backward_s.assign(chunk_count, 0);
  tl.p2p_s.assign(chunk_count, 0);
  for (int p = 0; p < pp; ++p) {
    const RankTime& rt = critical_times[p];
    int layers = 0;
    for (int k = 0; k < v; ++k) layers += chunks.count(k * pp + p);
    for (int k = 0; k < v; ++k) {
      const int chunk = k * pp + p;
      const double share = layers ? static_cast<double>(chunks.count(chunk)) / layers : 1.0;
      // TP collectives and ring-attention transfers run inside each pass, in proportion to its
      // work.
      const double collectives = rt.tp + rt.cp;
      const double tp_fwd = collectives * (rt.fwd / std::max(rt.fwd + rt.bwd, 1e-30));
      tl.forward_s[chunk] = (rt.fwd + tp_fwd) * share;
      tl.backward_s[chunk] = (rt.bwd + collectives - tp_fwd) * share;
      if (chunk + 1 < chunk_count)
        tl.p2p_s[chunk] = link_s(rank_node(critical, p, 0), rank_node(critical, (p + 1) % pp, 0));
    }
  }
}

void CostModel::run(const Strategy& s, const Conditions& c, Work& work) const {
  Evaluation e(*this, s, c, work);
  e.find_kept_timing();
  e.find_node_links();
  if (!e.timed) {
    e.list_unclean();
    e.list_visits();
    e.time_visits();
  }
  const double worst_memory_ratio = e.worst_memory_ratio();
  if (e.timing->failed_visit >= 0) {
    CostBreakdown& out = work.result;
    out.feasible = false;
    out.reason = "uses failed GPU(s) in replica " +
                 std::to_string(e.timing->visits[e.timing->failed_visit]) + ", stage " +
                 std::to_string(e.timing->failed_stage);
    out.iteration_time_s = kInf;
    return;
  }
  e.reduce_gradients();
  e.assemble_breakdown(worst_memory_ratio);
  if (work.timings) e.fill_pipeline_timings();
}

void find_off_nominal(const Conditions& c, OffNominal& out) {
  out.gpus.clear();
  out.nodes.clear();
  const size_t speeds = c.gpu_speed.size(), failures = c.gpu_failed.size();
  const size_t gpus = std::max(speeds, failures);
  const double* const speed = c.gpu_speed.data();
  // The failure flags are walked with an iterator: indexing a vector<bool> works out the word
  // and the bit afresh for every GPU.
  std::vector<bool>::const_iterator failed = c.gpu_failed.begin();
  for (size_t g = 0; g < gpus; ++g) {
    const bool slowed = g < speeds && speed[g] != 1.0;
    const bool lost = g < failures && *failed++;
    if (slowed || lost) out.gpus.push_back(static_cast<int>(g));
  }
  const size_t nodes = std::max(c.node_inter_bw.size(), c.node_intra_bw.size());
  for (size_t n = 0; n < nodes; ++n) {
    const int i = static_cast<int>(n);
    if ((n < c.node_inter_bw.size() && c.node_inter_bw[n] != 1.0) ||
        (n < c.node_intra_bw.size() && c.node_intra_bw[n] != 1.0)) {
      out.nodes.push_back(i);
    }
  }
}

namespace {

// The off-nominal GPUs and nodes of `c`, found into a per-thread buffer.
const OffNominal& off_nominal_of(const Conditions& c) {
  thread_local OffNominal where;
  find_off_nominal(c, where);
  return where;
}

}  // namespace

CostBreakdown CostModel::evaluate(const Strategy& s, const Conditions& c) const {
  return evaluate(s, c, off_nominal_of(c));
}

CostBreakdown CostModel::evaluate(const Strategy& s, const Conditions& c,
                                  const OffNominal& where) const {
  Work work;
  work.where = &where;
  run(s, c, work);
  return std::move(work.result);
}

CostBreakdown CostModel::evaluate_exhaustive(const Strategy& s, const Conditions& c) const {
  Work work;
  work.where = &off_nominal_of(c);
  work.exhaustive = true;
  run(s, c, work);
  return std::move(work.result);
}

PipelineTimings CostModel::pipeline_timings(const Strategy& s, const Conditions& c) const {
  PipelineTimings timings;
  Work work;
  work.where = &off_nominal_of(c);
  work.timings = &timings;
  run(s, c, work);
  return timings;
}

}  // namespace parapilot
