// Search: the layout shapes of the space, their throughput bounds, evaluation through the cost
// model and the ranking of families (docs/planner.md).
#include "strategy/planner_search.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>
#include <string>

#include "strategy/cost_formulas.h"
#include "core/error.h"
#include "strategy/partitioner.h"

namespace parapilot {
namespace planner_internal {

bool tp_legal(int tp, const ModelSpec& model) {
  return model.heads % tp == 0 && (model.kv_heads % tp == 0 || tp % model.kv_heads == 0);
}

const BlockCosts& Search::block_costs(int type, int tp, int cp, int mb, bool sp, Recompute rc) {
  const BlockKey key{
      type, tp, cp, mb, sp, rc, kernels_.attention, kernels_.fp8, kernels_.tp_comm_overlap};
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
  Strategy s = kernels_;
  s.dp = 1;
  s.tp = tp;
  s.cp = cp;
  s.pp = 1;
  s.sp = sp;
  s.microbatch_size = mb;
  s.global_batch = mb;
  s.recompute = rc;
  s.zero = 0;
  for (int g = 0; g < tp * cp; ++g) s.gpus.push_back(g);
  const CostBreakdown whole = probe.evaluate(s);
  const double all_compute = whole.compute_s + whole.recompute_s;  // 3 blocks + ends
  const double tpc = (whole.tp_comm_s + whole.cp_comm_s) / 3.0;
  s.pp = 2;
  for (int g = tp * cp; g < 2 * tp * cp; ++g) s.gpus.push_back(g);
  s.stage_layers = {1, 2};
  const PipelineTimings one = probe.pipeline_timings(s);
  s.stage_layers = {2, 1};
  const PipelineTimings two = probe.pipeline_timings(s);
  const double first1 = one.forward_s[0] + one.backward_s[0];  // block + embedding + tp
  const double first2 = two.forward_s[0] + two.backward_s[0];  // 2 blocks + embedding + 2 tp
  BlockCosts out;
  out.ring = probe.ring_attention(0, s);
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
double Search::tp_comm_per_block_s(int node, int tp, int cp, int mb, Recompute rc) const {
  if (tp <= 1) return 0;
  const double bytes = static_cast<double>(mb) * model_.seq_len / cp * model_.hidden * 2.0;
  const double bw = topo_.nodes[node].intra_GBps * 1e9 * topo_.intra_efficiency * c_.intra(node);
  const int collectives = 4 + (rc == Recompute::kFull ? 2 : 0);
  // With tp_comm_overlap the GEMM a collective pairs with is not known here: the first
  // chunk, which never hides, keeps the figure a lower bound (the bound stays a bound).
  return collectives *
         exposed_tp_collective_s(ring_allreduce_s(tp, bytes, bw, topo_.intra_latency_s), tp,
                                 kernels_.tp_comm_overlap, kInf);
}

double Search::cp_ring_per_block_s(const Group& g, const BlockCosts& bc, int cp, double slow,
                                   Recompute rc) {
  if (cp <= 1) return 0;
  const double fwd_step_s = g.ring_latency_s + bc.ring.kv_block_bytes * g.ring_s_per_byte;
  const double bwd_step_s = g.ring_latency_s + 2.0 * bc.ring.kv_block_bytes * g.ring_s_per_byte;
  return exposed_cp_ring_s(cp, fwd_step_s, bwd_step_s, bc.ring.attention_fwd_s,
                           bc.ring.attention_bwd_s, slow, rc == Recompute::kFull);
}

// Every layout of (tp, cp) runs M microbatches through L blocks per iteration, each block on
// some group g in at least beta_g (its per-block time at that microbatch, recompute and sp), so
// no layout beats mb * seq * sum_g (1 / beta_g) / L tokens per second, whatever its pipeline
// depth, replicas, placement or shares; the maximum over every microbatch, recompute and sp
// the space allows bounds them all. make_groups(tp, cp) has run.
double Search::pair_bound(int tp, int cp) {
  const std::vector<Group>& groups = scratch_.groups[tp * cp];
  std::vector<int> mbs = space_.microbatch_size;
  if (mbs.empty()) {
    const int b = space_.global_batch > 0 ? space_.global_batch : space_.global_batch_max;
    for (int mb = 1; mb <= b; ++mb) {
      if (space_.global_batch_max > 0 || b % mb == 0) mbs.push_back(mb);
      if (space_.global_batch_max > 0 && mb >= 64) break;
    }
  }
  std::vector<bool> sps = space_.sp;
  if (sps.empty() || tp == 1) sps = {false, true};
  std::vector<Recompute> rcs = space_.recompute;
  if (rcs.empty()) rcs = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  const int seq = model_.seq_len / cp;
  double best = 0;
  for (int mb : mbs)
    for (bool sp : sps) {
      if (sp && (tp == 1 || seq % tp != 0)) continue;
      for (Recompute rc : rcs) {
        const BlockCosts* type_costs[8] = {};
        double rate = 0;  // blocks per second over every group
        for (const Group& g : groups) {
          if (g.type >= 8) return kInf;  // more GPU types than the search tracks: no bound
          if (!type_costs[g.type]) type_costs[g.type] = &block_costs(g.type, tp, cp, mb, sp, rc);
          const BlockCosts& bc = *type_costs[g.type];
          const double beta = bc.block_s * g.slow + tp_comm_per_block_s(g.node, tp, cp, mb, rc) +
                              cp_ring_per_block_s(g, bc, cp, g.slow, rc);
          rate += 1.0 / beta;
        }
        best = std::max(best, static_cast<double>(mb) * model_.seq_len * rate / model_.layers);
      }
    }
  return best;
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

// The values of each shape axis the space allows (sequence parallelism, recompute, ZeRO stage,
// schedule) for tensor-parallel degree tp: the listed ones, else all. Per thread; valid until
// the calling thread's next call.
const Search::ShapeAxes& Search::shape_axes(int tp) const {
  thread_local ShapeAxes axes;
  std::vector<bool>& sps = axes.sps;
  sps = space_.sp;
  if (sps.empty()) sps = {false, true};
  // Sequence parallelism splits inside a tensor-parallel group: without one (tp = 1) it does
  // not exist, so a space asking only for sp = true still allows tp = 1 layouts.
  if (tp == 1) sps = {false};
  std::vector<Recompute>& rcs = axes.rcs;
  rcs = space_.recompute;
  if (rcs.empty()) rcs = {Recompute::kNone, Recompute::kSelective, Recompute::kFull};
  std::vector<int>& zeros = axes.zeros;
  zeros = space_.zero;
  if (zeros.empty()) zeros = {0, 1, 2, 3};
  std::vector<Schedule>& schedules = axes.schedules;
  schedules = space_.schedule;
  if (schedules.empty()) schedules = {Schedule::k1F1B, Schedule::kInterleaved};
  return axes;
}

// Per (recompute, microbatch) of one sp on placement pl: each run of like replicas' sum of
// 1 / beta and fastest beta (run i is replicas like_begin[i] .. like_begin[i + 1] - 1), and the
// sum over replicas of the former, which every schedule and v share; looked up in `cache` first.
const Search::RateCache::Rates& Search::rates_of(const Placement& pl,
                                                 const std::vector<int>& like_begin,
                                                 RateCache& cache, bool sp, Recompute rc,
                                                 int mb) {
  using Rates = RateCache::Rates;
  const int pp = pl.pp, tp = pl.tp, cp = pl.cp;
  const int like_runs = static_cast<int>(like_begin.size()) - 1;
  bool type_used[8];
  for (int k = 0; k < 8; ++k) type_used[k] = (pl.types_used >> k & 1u) != 0;
  const std::vector<int>& slot_link = pl.slot_link;
  const std::vector<int>& link_node = pl.link_node;
  thread_local std::vector<double> link_tp_s;
  link_tp_s.resize(link_node.size());
  for (const Rates& e : cache.rates) {
    if (e.rc == rc && e.mb == mb) return e;
  }
  if (pp == 1) {  // one v only: nothing to share
    cache.rates.clear();
    cache.store.clear();
  }
  const BlockCosts* type_costs[8] = {};
  for (size_t t = 0; t < topo_.types.size() && t < 8; ++t) {
    if (type_used[t]) type_costs[t] = &block_costs(static_cast<int>(t), tp, cp, mb, sp, rc);
  }
  const std::vector<Group>& groups = scratch_.groups[tp * cp];
  for (size_t n = 0; n < link_node.size(); ++n) {
    link_tp_s[n] = tp_comm_per_block_s(link_node[n], tp, cp, mb, rc);
  }
  const size_t at = cache.store.size();
  cache.store.resize(at + 2 * static_cast<size_t>(like_runs));
  double sum_rate = 0;
  for (int i = 0; i < like_runs; ++i) {
    const int r = like_begin[i];
    double rate = 0, beta_min = kInf;
    for (int p = 0; p < pp; ++p) {
      const int slot = r * pp + p;
      const BlockCosts& bc = *type_costs[pl.type[slot]];
      const double beta = bc.block_s * pl.slow[slot] + link_tp_s[slot_link[slot]] +
                          cp_ring_per_block_s(groups[pl.group[slot]], bc, cp, pl.slow[slot], rc);
      rate += 1.0 / beta;
      beta_min = std::min(beta_min, beta);
    }
    cache.store[at + 2 * i] = rate;
    cache.store[at + 2 * i + 1] = beta_min;
    for (int member = r; member < like_begin[i + 1]; ++member) sum_rate += rate;
  }
  cache.rates.push_back(Rates{rc, mb, sum_rate, at});
  return cache.rates.back();
}

// The (microbatch, global batch) pairs of dp replicas taking microbatches in multiples of unit:
// microbatch sizes listed, or every divisor of the largest batch in play. Per thread; valid
// until the calling thread's next call.
const std::vector<std::pair<int, int>>& Search::batches_of(int dp, int unit) const {
  thread_local std::vector<std::pair<int, int>> batches;
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
  return batches;
}

void Search::add_shapes(int placement_index) {
  const Placement& pl = scratch_.placements[placement_index];
  const int dp = pl.dp, pp = pl.pp, tp = pl.tp, cp = pl.cp;
  const int seq = model_.seq_len / cp;  // the tokens of a sequence one context rank holds
  const int layers = model_.layers;

  const ShapeAxes& axes = shape_axes(tp);
  const std::vector<bool>& sps = axes.sps;
  const std::vector<Recompute>& rcs = axes.rcs;
  const std::vector<int>& zeros = axes.zeros;
  const std::vector<Schedule>& schedules = axes.schedules;
  // GPipe runs as fast as 1F1B in the cost model and never needs less memory.
  const bool has_1f1b =
      std::find(schedules.begin(), schedules.end(), Schedule::k1F1B) != schedules.end();

  thread_local std::vector<int> vs;
  // Bounds of one v, per (recompute, pair): the same for every ZeRO stage.
  thread_local std::vector<double> bounds;
  // The placement's runs of like replicas (Placement::like_replica): run i is replicas
  // like_begin[i] .. like_begin[i + 1] - 1, which time alike: their terms below are worked out
  // once per run, and sums over replicas add a run's term once per member, in replica order.
  thread_local std::vector<int> like_begin;
  like_begin.clear();
  for (int r = 0; r < dp; ++r) {
    if (pl.like_replica[r] == r) like_begin.push_back(r);
  }
  const int like_runs = static_cast<int>(like_begin.size());
  like_begin.push_back(dp);
  thread_local RateCache cache;
  using Rates = RateCache::Rates;
  for (bool sp : sps) {
    if (sp && (tp == 1 || seq % tp != 0)) continue;
    if (!sp && tp > 1 && space_.sp.empty() && seq % tp == 0) {
      continue;  // sequence parallelism: less memory and less element-wise time, same traffic
    }
    cache.rates.clear();
    cache.store.clear();
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
        const std::vector<std::pair<int, int>>& batches = batches_of(dp, unit);
        bounds.clear();
        bool have_bounds = false;
        for (int zero : zeros) {
          if (zero >= 2 && pp > 1) continue;
          if (zero > 0 && dp == 1 && space_.zero.empty()) continue;  // nothing to shard
          size_t k = 0;
          for (Recompute rc : rcs) {
            bool have_rates = false;
            int last_mb = 0;
            double sum_rate = 0, weighted = 0, slowest_unit_s = 0;
            for (const auto& [mb, batch] : batches) {
              double upper_tokens_per_s;
              if (have_bounds) {
                upper_tokens_per_s = bounds[k];
              } else {
                // Bound: no stage can beat L / sum(1/beta) per microbatch and replica; the
                // pipeline adds at least (sum - max) / v; no replica runs fewer than one unit
                // of microbatches (see docs/planner.md).
                // The rates depend on the microbatch, not the batch.
                if (!have_rates || mb != last_mb) {
                  const Rates& e = rates_of(pl, like_begin, cache, sp, rc, mb);
                  const double* rate_beta = cache.store.data() + e.at;
                  sum_rate = e.sum_rate;
                  weighted = 0;
                  slowest_unit_s = 0;
                  for (int i = 0; i < like_runs; ++i) {
                    const double term = layers * rate_beta[2 * i + 1] / v * rate_beta[2 * i];
                    for (int r = like_begin[i]; r < like_begin[i + 1]; ++r) weighted += term;
                    // Every replica runs at least one unit of microbatches.
                    slowest_unit_s = std::max(slowest_unit_s,
                                              layers * (unit - 1.0 / v) / rate_beta[2 * i] +
                                                  layers * rate_beta[2 * i + 1] / v);
                  }
                  have_rates = true;
                  last_mb = mb;
                }
                const int total = batch / mb;
                const double bound_s = std::max(
                    (layers * (total - static_cast<double>(dp) / v) + weighted) / sum_rate,
                    slowest_unit_s);
                upper_tokens_per_s = static_cast<double>(batch) * model_.seq_len / bound_s;
                bounds.push_back(upper_tokens_per_s);
              }
              ++k;
              Shape shape;
              shape.upper_tokens_per_s = upper_tokens_per_s;
              shape.placement = placement_index;
              shape.tp = tp;
              shape.cp = cp;
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

void Search::record(Track& track, const Shape& shape, Outcome& outcome, bool last_taker) {
  if (outcome.kind == Outcome::Kind::kNone || outcome.kind == Outcome::Kind::kBelow) return;
  const CostBreakdown& b = outcome.cost;
  if (outcome.kind == Outcome::Kind::kNoFit || (b.feasible && !b.fits_in_memory)) {
    auto [it, inserted] = track.no_fit_mb.emplace(fit_key(shape), shape.mb);
    if (!inserted) it->second = std::min(it->second, shape.mb);
  }
  if (outcome.kind != Outcome::Kind::kEvaluated || !b.feasible || !b.fits_in_memory) return;
  Strategy& s = outcome.strategy;
  const Family f = family_of(s);
  // The strategy kept: no other track reads it after the last taker.
  auto kept = [&]() { return Candidate{last_taker ? std::move(s) : s, b, 0, 0}; };
  auto it = track.best.find(f);
  if (it == track.best.end()) {
    track.best.emplace(f, kept());
  } else if (b.tokens_per_s > it->second.cost.tokens_per_s) {
    it->second = kept();
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
  if (static_cast<int>(track.top.size()) >= track.keep) {
    std::nth_element(track.top.begin(), track.top.begin() + (track.keep - 1), track.top.end(),
                     std::greater<double>());
    track.keep_kth = track.top[track.keep - 1];
  }
}

// split_pipeline's replica runs: each rank's cost per microbatch (fixed + per block) for every
// run of replicas whose costs are equal rank by rank, under pipeline_.max_blocks.
const Search::ReplicaRuns& Search::replica_runs(const Shape& shape, const Placement& pl) {
  const int pp = pl.pp, tp = shape.tp, v = shape.v, mb = shape.mb;
  const std::vector<int>& max_blocks = pipeline_.max_blocks;
  // Per (replica, rank): time = fixed + per_block * blocks, for one microbatch.
  const double p2p_bytes =
      static_cast<double>(mb) * model_.seq_len / shape.cp * model_.hidden * 2.0 / tp;
  const BlockCosts* type_costs[8] = {};
  for (int t = 0; t < 8; ++t) {
    if (pl.types_used >> t & 1u) {
      type_costs[t] = &block_costs(t, tp, shape.cp, mb, shape.sp, shape.recompute);
    }
  }
  thread_local std::vector<double> link_tp_s;
  link_tp_s.resize(pl.link_node.size());
  for (size_t n = 0; n < pl.link_node.size(); ++n) {
    link_tp_s[n] = tp_comm_per_block_s(pl.link_node[n], tp, shape.cp, mb, shape.recompute);
  }
  const std::vector<Group>& groups = scratch_.groups[tp * shape.cp];
  // Replicas come in runs whose costs are equal rank by rank: run k is replicas
  // run_begin[k] .. run_begin[k + 1] - 1 and its costs are costs[k * pp .. (k + 1) * pp).
  // A replica costs the same term by term as the previous one unless it is one of the
  // placement's cost leaders, so only those are costed; a run whose costs equal the previous
  // run's joins it. Within a run, replicas with the same microbatch count have the same row,
  // which partition_blocks would drop as dominated, and their shares come out alike.
  // costs only grows: the rows in use, costs[0 .. at), are written before they are read, and
  // growing it leader by leader would value-initialise each new row first.
  thread_local ReplicaRuns replica_runs;
  std::vector<RankCost>& costs = replica_runs.costs;
  std::vector<int>& run_begin = replica_runs.run_begin;
  const size_t leader_rows = pl.cost_leaders.size() * static_cast<size_t>(pp);
  if (costs.size() < leader_rows) costs.resize(leader_rows);
  run_begin.clear();
  size_t at = 0;  // the rows of the runs found so far
  for (const int r : pl.cost_leaders) {
    for (int p = 0; p < pp; ++p) {
      const int slot = r * pp + p;
      const double slow = pl.slow[slot];
      const BlockCosts& bc = *type_costs[pl.type[slot]];
      RankCost& rc = costs[at + p];
      rc.per_block_s = bc.block_s * slow + link_tp_s[pl.slot_link[slot]] +
                       cp_ring_per_block_s(groups[pl.group[slot]], bc, shape.cp, slow,
                                           shape.recompute);
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
    bool same = at > 0;
    for (int p = 0; p < pp && same; ++p) {
      const RankCost& a = costs[at + p];
      const RankCost& b = costs[at - pp + p];
      same = a.fixed_s == b.fixed_s && a.per_block_s == b.per_block_s &&
             a.max_blocks == b.max_blocks;
    }
    if (!same) {
      run_begin.push_back(r);
      at += pp;
    }
  }
  replica_runs.runs = static_cast<int>(run_begin.size());
  run_begin.push_back(pl.dp);
  return replica_runs;
}

bool Search::split_pipeline(const Shape& shape, const Placement& pl, int total, int unit) {
  const int dp = pl.dp, pp = pl.pp, v = shape.v;
  const int layers = model_.layers;
  std::vector<int>& counts = pipeline_.counts;
  counts.assign(pp, 0);
  const ReplicaRuns& replica_costs = replica_runs(shape, pl);
  const std::vector<RankCost>& costs = replica_costs.costs;
  const std::vector<int>& run_begin = replica_costs.run_begin;
  const int runs = replica_costs.runs;

  // Stretches of consecutive replicas of one run (`run`) that hold the same microbatch count
  // (`micro`), in replica order.
  struct Stretch {
    int run, micro;
  };
  thread_local std::vector<Stretch> stretches;
  std::vector<int>& micro = pipeline_.micro;
  micro.assign(dp, total / dp);
  stretches.clear();
  for (int k = 0; k < runs; ++k) stretches.push_back({k, total / dp});
  auto find_stretches = [&]() {
    stretches.clear();
    for (int k = 0; k < runs; ++k) {
      const int* r = micro.data() + run_begin[k];
      const int* const end = micro.data() + run_begin[k + 1];
      while (r < end) {  // a stretch from r
        const int m = *r;
        stretches.push_back({k, m});
        r = std::find_if(r + 1, end, [m](int x) { return x != m; });
      }
    }
  };
  // One row per stretch, weighted by its microbatch count; a single row when every replica is
  // identical. partition_blocks drops rows that can never be the slowest, so rows that differ
  // (e.g. by measured speed noise) cost little. The rows go in reverse stretch order: a
  // run's highest replicas, which take the extra microbatches, come first, so the row of its
  // replicas with fewer meets the line that drops it at once (partition_blocks checks the
  // newest line first). The order of the rows does not change partition_blocks' answer.
  thread_local std::vector<RankCost> rows;
  auto build_rows = [&]() {
    rows.resize(stretches.size() * pp);
    // Through raw pointers: stores through the vectors would reload their data pointers.
    RankCost* row = rows.data();
    const RankCost* cost = costs.data();
    for (auto it = stretches.rbegin(); it != stretches.rend(); ++it) {
      const Stretch& s = *it;
      for (int p = 0; p < pp; ++p, ++row) {
        *row = cost[s.run * pp + p];
        row->fixed_s *= s.micro;
        row->per_block_s *= s.micro;
      }
    }
    return static_cast<int>(stretches.size());
  };
  // Each run's replicas under the current counts: one microbatch on its slowest rank, and the
  // fill and drain its other ranks add once, (sum - max) / v.
  thread_local std::vector<double> per_mb, fill;
  per_mb.resize(runs);
  fill.resize(runs);
  auto run_times = [&]() {
    for (int k = 0; k < runs; ++k) {
      double max = 0, sum = 0;
      for (int p = 0; p < pp; ++p) {
        const RankCost& c = costs[k * pp + p];
        const double t = c.fixed_s + c.per_block_s * counts[p];
        max = std::max(max, t);
        sum += t;
      }
      per_mb[k] = max;
      fill[k] = (sum - max) / v;
    }
  };

  double bottleneck = 0;
  thread_local std::vector<int> counts_before, before;
  for (int round = 0; round < 2; ++round) {
    const int row_count = build_rows();
    if (!partition_blocks(rows.data(), row_count, pp, layers, v, counts.data(), &bottleneck)) {
      return false;
    }
    // The shares depend only on the counts: the same counts as the previous round give the
    // same shares again.
    if (round > 0 && counts == counts_before) break;
    counts_before = counts;
    before = micro;
    run_times();
    allocate_microbatches(per_mb.data(), fill.data(), run_begin.data(), runs, total, unit,
                          micro.data());
    find_stretches();
    if (micro == before) break;
  }

  // The pipeline time the cost model will find (the same rank costs, counts and shares): the
  // DP reduction and optimizer step only add to it. A layout it already puts below the floor
  // is not costed (a relative margin covers the two computations' rounding). The run times
  // are those of the final counts: the last shares were worked out from them.
  double pipeline_s = 0;
  for (const Stretch& s : stretches) {
    pipeline_s = std::max(pipeline_s, s.micro * per_mb[s.run] + fill[s.run]);
  }
  pipeline_.pipeline_s = pipeline_s;
  return true;
}

Outcome Search::evaluate_shape(const Shape& shape, double floor_tokens_per_s) {
  const Placement& pl = detailed(shape.placement);
  const int dp = pl.dp, pp = pl.pp, tp = shape.tp, v = shape.v, mb = shape.mb;
  const int layers = model_.layers;
  Outcome no_fit;
  no_fit.kind = Outcome::Kind::kNoFit;

  Strategy s = kernels_;
  s.dp = dp;
  s.tp = tp;
  s.cp = shape.cp;
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
    // Provisional shares, largest first (the memory bound below uses the largest): the units
    // as evenly as they go.
    const int units = total / unit;
    const int rest = units % dp;
    s.dp_shares.assign(dp, units / dp * unit * mb);
    for (int r = 0; r < rest; ++r) s.dp_shares[r] += unit * mb;
  }

  // Memory: per-GPU footprint is affine in the blocks a rank holds; find each rank's limit.
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
      const double capacity = pl.capacity_gib[p];
      const double per_block = (m2[p] - m1[p]) / v;
      const double base = m1[p] - per_block * v;
      const double room = per_block > 0 ? (capacity - base) / per_block : layers;
      max_blocks[p] = room >= layers ? layers : static_cast<int>(std::floor(room + 1e-9));
      if (max_blocks[p] < v) return no_fit;
    }
  }

  // ZeRO stages change the memory (the block limits) and the DP terms, not the pipeline: a
  // shape's ZeRO variants, bounded alike and so evaluated one after another, share their
  // boundaries and shares when their block limits agree.
  const PipelineKey key{shape.placement, tp, shape.cp, shape.sp, shape.schedule, v,
                        shape.recompute, mb, shape.global_batch};
  if (!(pipeline_.key == key && pipeline_.max_blocks == max_blocks)) {
    pipeline_.key = key;
    pipeline_.max_blocks = max_blocks;
    pipeline_.fits = split_pipeline(shape, pl, total, unit);
  }
  if (!pipeline_.fits) return no_fit;
  const std::vector<int>& counts = pipeline_.counts;
  const std::vector<int>& micro = pipeline_.micro;
  const double pipeline_s = pipeline_.pipeline_s;
  const double upper_tokens_per_s =
      static_cast<double>(shape.global_batch) * model_.seq_len / pipeline_s;
  if (upper_tokens_per_s * (1 + 1e-9) < floor_tokens_per_s) {
    ++pruned_;
    Outcome below;
    below.kind = Outcome::Kind::kBelow;
    return below;
  }

  std::vector<int> per_rank(counts.begin(), counts.end());
  s.dp_shares.clear();
  std::vector<int> chosen = chunk_layers(per_rank, v);
  s.stage_layers.clear();
  if (chosen != s.layers_per_chunk(layers)) s.stage_layers = std::move(chosen);
  const bool uniform =
      std::all_of(micro.begin(), micro.end(), [&](int m) { return m == micro[0]; });
  if (!uniform) {
    s.dp_shares.resize(dp);
    for (int r = 0; r < dp; ++r) s.dp_shares[r] = micro[r] * mb;
  }
  if (uniform && !even) return {};  // cannot happen: an uneven total has no uniform split
  ++evaluated_;
  Outcome out;
  out.kind = Outcome::Kind::kEvaluated;
  out.cost = cost_.evaluate(s, c_, off_nominal_);
  out.strategy = std::move(s);
  return out;
}

// A track's top K families, the leaders compressed where it pays, best first.
std::vector<Candidate> Search::finish(const Track& track) {
  auto by_throughput = [](const Candidate& a, const Candidate& b) {
    return a.cost.tokens_per_s > b.cost.tokens_per_s;
  };
  // The families' best, best first (stable: ties keep the families' order), sorted through
  // pointers so that only the leaders kept are copied. Compression can reorder the leaders:
  // apply it to twice as many as returned.
  std::vector<const Candidate*> order;
  order.reserve(track.best.size());
  for (const auto& [family, cand] : track.best) order.push_back(&cand);
  std::stable_sort(order.begin(), order.end(),
                   [&](const Candidate* a, const Candidate* b) { return by_throughput(*a, *b); });
  const int k = track.top_k;
  const size_t keep = std::min(order.size(), static_cast<size_t>(2 * k));
  std::vector<Candidate> ranked;
  ranked.reserve(keep);
  for (size_t i = 0; i < keep; ++i) ranked.push_back(*order[i]);
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
      Strategy plain = cand.strategy;
      choose_compression(cand);
      compressed_.emplace_back(std::move(plain), cand);
    }
    final_tps.push_back(cand.cost.tokens_per_s);
  }
  std::stable_sort(ranked.begin(), ranked.end(), by_throughput);
  if (static_cast<int>(ranked.size()) > k) ranked.resize(k);
  return ranked;
}

// Every placement of one (tp, cp) and its shapes; make_groups(tp, cp) has run. max_node: the
// most GPUs of a node; max_pp: the deepest pipeline searched.
void Search::add_pair(int tp, int cp, int max_node, int max_pp) {
  const int unit = tp * cp;
  const int groups = static_cast<int>(scratch_.groups[unit].size());
  if (groups == 0) return;
  // Healthy group count: pipeline depths that divide it are the defaults.
  int healthy = 0;
  if (unit <= max_node) {
    for (const auto& n : topo_.nodes) healthy += n.gpus / unit;
  } else {
    for (const auto& n : topo_.nodes) healthy += n.gpus / max_node;
    healthy /= unit / max_node;
  }
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
      add_placements(tp, cp, pp, dp);
      for (size_t i = first; i < placement_count_; ++i) add_shapes(static_cast<int>(i));
    }
  }
}

// Branch and bound over shapes_[from, end): best bound first; a track stops once no remaining
// shape can enter its top K. A shape is evaluated once, whichever tracks take it. Most shapes
// are pruned unread: a heap yields them in bound order (ties in the order they were added, as
// a stable sort would) without sorting them all.
void Search::branch_and_bound(size_t from) {
  thread_local std::vector<std::pair<double, int>> order;  // (bound, index)
  const size_t n = shapes_.size() - from;
  order.resize(n);
  for (size_t i = 0; i < n; ++i) {
    order[i] = {shapes_[from + i].upper_tokens_per_s, static_cast<int>(from + i)};
  }
  auto later = [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  };
  std::make_heap(order.begin(), order.end(), later);
  for (Track& track : tracks_) track.done = false;
  for (size_t i = 0; i < n; ++i) {
    std::pop_heap(order.begin(), order.end() - static_cast<long>(i), later);
    const Shape& shape = shapes_[order[n - 1 - i].second];
    bool taken = false, all_done = true;
    // The tracks that take the shape, and the lowest throughput that could matter to one.
    Track* takers[2];  // tracks_ holds one or two
    assert(tracks_.size() <= 2);
    int taker_count = 0;
    double floor = kInf;
    for (Track& track : tracks_) {
      if (!track.done && shape.upper_tokens_per_s <= track.kth) track.done = true;
      all_done = all_done && track.done;
      if (track.done || !track.covers(shape)) continue;
      taken = true;
      if (auto it = track.no_fit_mb.find(fit_key(shape));
          it != track.no_fit_mb.end() && shape.mb >= it->second) {
        continue;
      }
      takers[taker_count++] = &track;
      floor = std::min(floor, track.keep_kth);
    }
    if (taker_count > 0) {
      Outcome outcome = evaluate_shape(shape, floor);
      for (int t = 0; t < taker_count; ++t) {
        record(*takers[t], shape, outcome, t == taker_count - 1);
      }
    }
    if (all_done) {
      pruned_ += static_cast<long>(n - i);
      break;
    }
    if (!taken) ++pruned_;
  }
}

// The candidates of the first track, or with the ZeRO-0 track the faster of each family's
// variants, best first (the first track's on a tie), at most top_k.
std::vector<Candidate> Search::rank_candidates(bool with_zero0) {
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
  return ranked;
}

PlanResult Search::run() {
  const auto start = std::chrono::steady_clock::now();
  const int gpus = topo_.num_gpus();
  // Preconditions (planner.h): the callers size and check conditions for this cluster.
  assert(req_.top_k >= 1);
  auto sized = [](size_t size, int expected) {
    return size == 0 || static_cast<int>(size) == expected;
  };
  assert(sized(c_.gpu_speed.size(), gpus) && sized(c_.gpu_failed.size(), gpus) &&
         sized(c_.node_inter_bw.size(), topo_.num_nodes()) &&
         sized(c_.node_intra_bw.size(), topo_.num_nodes()));
  assert(std::all_of(c_.gpu_speed.begin(), c_.gpu_speed.end(), [](double s) { return s > 0; }));
  (void)sized;

  PlanResult result;
  if (req_.current) {
    Candidate cur{*req_.current, cost_.evaluate(*req_.current, c_, off_nominal_), 0, 0};
    ++evaluated_;
    result.current = cur;
  }

  int usable = 0;
  for (int g = 0; g < gpus; ++g) usable += c_.failed(g) ? 0 : 1;
  if (usable == 0) {  // nothing can run: no candidates
    result.evaluated = evaluated_;
    result.search_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count();
    return result;
  }

  int max_node = 1;
  for (const auto& n : topo_.nodes) max_node = std::max(max_node, n.gpus);
  std::vector<int> tps = space_.tp;
  if (tps.empty()) {
    for (int t = 1; t <= max_node; ++t) tps.push_back(t);
  }
  const int max_pp = space_.max_pp > 0 ? std::min(space_.max_pp, model_.layers) : model_.layers;

  // Context-parallel degrees: listed, or every power of two whose 2 * cp chunks divide the
  // sequence; ring attention needs the fused attention kernel. A stage's tp x cp GPUs fill part
  // of a node or whole nodes (make_groups).
  std::vector<int> cps = space_.cp;
  if (cps.empty()) {
    for (int c = 1; c <= gpus; c *= 2) cps.push_back(c);
  }
  // The (tp, cp) pairs to search: stages inside a node, then stages of whole nodes.
  std::vector<std::pair<int, int>> in_node, across_nodes;
  for (int tp : tps)
    for (int cp : cps) {
      if (!tp_legal(tp, model_)) continue;
      if (cp > 1 && (kernels_.attention != Attention::kFlash || model_.seq_len % (2 * cp) != 0))
        continue;
      const int unit = tp * cp;
      if (unit <= max_node) {
        in_node.emplace_back(tp, cp);
      } else if (unit <= gpus && unit % max_node == 0 && max_node % tp == 0) {
        across_nodes.emplace_back(tp, cp);  // whole nodes, each holding whole tp groups
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
  // finish() compresses its 2K leaders when compression may apply (choose_compression).
  const bool compressing = space_.compression && !req_.gradients.empty();
  for (Track& track : tracks_) track.keep = compressing ? 2 * track.top_k : track.top_k;


  for (const auto& [tp, cp] : in_node) {
    make_groups(tp, cp);
    add_pair(tp, cp, max_node, max_pp);
  }
  branch_and_bound(0);
  // Stages of whole nodes, after the search inside nodes has set every track's K-th best: a
  // pair whose every layout is bounded below that cannot enter any top K (pair_bound), and
  // its shapes are never made.
  const size_t across_from = shapes_.size();
  double floor = kInf;
  for (const Track& track : tracks_) floor = std::min(floor, track.kth);
  for (const auto& [tp, cp] : across_nodes) {
    make_groups(tp, cp);
    if (pair_bound(tp, cp) <= floor) continue;
    add_pair(tp, cp, max_node, max_pp);
  }
  branch_and_bound(across_from);

  result.candidates = rank_candidates(with_zero0);

  result.evaluated = evaluated_;
  result.pruned = pruned_;
  result.search_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace planner_internal
}  // namespace parapilot
