#include "strategy/partitioner.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>

namespace parapilot {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kBisectionSteps = 200;

// The rows of one call, reduced per rank to the lines that can be the slowest: row j's line
// (fixed_s, per_block_s) at rank p is dropped when another row's line is at least as large in
// both (then it is never above it for any block count >= 0, in floating point too, since
// rounding is monotone). Rank p's lines are line[first[p]..first[p + 1]); limit[p] is the
// smallest max_blocks over all rows. With one row per replica that differs only by noise,
// this leaves a handful of lines per rank instead of one per replica. line only grows: past
// first[pp] it is room, so build writes through a pointer and never reallocates mid-call.
struct Envelope {
  std::vector<RankCost> line;
  std::vector<int> first;
  std::vector<int> limit;
  double min_step = kInf;  // smallest positive per-block time over every row and rank

  // Reads each rank's rows straight from costs, keeping only the lines not dominated so far,
  // so rows that duplicate or fall below a kept line are never copied. The minima run in
  // locals: stores into limit[] could alias the rows' ints and force reloads.
  void build(const RankCost* costs, int rows, int pp) {
    constexpr int kIncrementalMax = 32;
    const size_t room = static_cast<size_t>(rows) * pp;
    if (line.size() < room) line.resize(room);
    first.resize(pp + 1);
    limit.resize(pp);
    RankCost* const kept = line.data();
    const auto dominates = [](const RankCost& a, const RankCost& b) {
      return a.fixed_s >= b.fixed_s && a.per_block_s >= b.per_block_s;
    };
    double step = kInf;
    int end = 0;  // kept[0..end) are the lines so far
    for (int p = 0; p < pp; ++p) {
      const int from = end;
      first[p] = from;
      int lim = INT_MAX;
      bool many = false;  // more than kIncrementalMax lines kept: sort and sweep at the end
      const RankCost* c = costs + p;
      for (int j = 0; j < rows; ++j, c += pp) {
        lim = std::min(lim, c->max_blocks);
        if (c->per_block_s > 0) step = std::min(step, c->per_block_s);
        if (rows == 1 || many) {
          kept[end++] = *c;
          continue;
        }
        // kept[from..end) are mutually non-dominated. Newest first: a row tends to be
        // dominated by the row just before it (e.g. the same costs for fewer microbatches).
        bool dominated = false;
        for (int k = end - 1; k >= from && !dominated; --k) dominated = dominates(kept[k], *c);
        if (dominated) continue;
        int w = from;
        for (int k = from; k < end; ++k) {
          if (!dominates(*c, kept[k])) kept[w++] = kept[k];
        }
        kept[w] = *c;
        end = w + 1;
        // Many lines survive: take the rest unfiltered and sort and sweep below.
        if (end - from > kIncrementalMax) many = true;
      }
      limit[p] = lim;
      if (many) end = sweep(from, end);
    }
    first[pp] = end;
    min_step = step;
  }

  // Drops the dominated lines among line[from..end) and returns the new end: sorted by
  // per-block time (largest first, ties: largest fixed first), a line is kept only when its
  // fixed time exceeds every kept line's.
  int sweep(int from, int end) {
    const auto begin = line.begin() + from;
    const auto stop = line.begin() + end;
    std::sort(begin, stop, [](const RankCost& a, const RankCost& b) {
      if (a.per_block_s != b.per_block_s) return a.per_block_s > b.per_block_s;
      return a.fixed_s > b.fixed_s;
    });
    auto out = begin;
    double max_fixed = -kInf;
    for (auto it = begin; it != stop; ++it) {
      if (it->fixed_s > max_fixed) {
        max_fixed = it->fixed_s;
        *out++ = *it;
      }
    }
    return static_cast<int>(out - line.begin());
  }

  // Most blocks rank p can hold with its time <= t (over every row), capped at `most`.
  int capacity(int p, double t, int most) const {
    int cap = std::min(most, limit[p]);
    for (int i = first[p]; i < first[p + 1]; ++i) {
      const RankCost& c = line[i];
      if (c.per_block_s <= 0) {
        if (c.fixed_s > t) return -1;
        continue;
      }
      const double room = (t - c.fixed_s) / c.per_block_s;
      if (room < 0) return -1;
      // room >= 0 here, so truncation is the floor (and cheaper than std::floor).
      int n = room >= most ? most : static_cast<int>(room);
      // Floating-point guard: accept n + 1 when its time is exactly representable as <= t.
      if (n < most && c.fixed_s + c.per_block_s * (n + 1) <= t) ++n;
      while (n >= 0 && c.fixed_s + c.per_block_s * n > t) --n;
      cap = std::min(cap, n);
    }
    return cap;
  }

  double rank_time(int p, int blocks) const {
    double t = 0;
    for (int i = first[p]; i < first[p + 1]; ++i) {
      t = std::max(t, line[i].fixed_s + line[i].per_block_s * blocks);
    }
    return t;
  }

  bool feasible(int pp, int blocks, int min_blocks, double t) const {
    long total = 0;
    for (int p = 0; p < pp; ++p) {
      const int cap = capacity(p, t, blocks);
      if (cap < min_blocks) return false;
      total += cap;
    }
    return total >= blocks;
  }
};

}  // namespace

bool partition_blocks(const RankCost* costs, int rows, int pp, int blocks, int min_blocks, int* out,
                      double* bottleneck_s) {
  assert(rows >= 1 && pp >= 1 && min_blocks >= 1);
  if (static_cast<long>(pp) * min_blocks > blocks) return false;
  thread_local Envelope env;
  env.build(costs, rows, pp);
  // Memory limits alone: every rank needs min_blocks and together they must hold all blocks.
  long room = 0;
  double lo = 0, hi = 0;
  for (int p = 0; p < pp; ++p) {
    const int limit = std::min(blocks - (pp - 1) * min_blocks, env.limit[p]);
    if (limit < min_blocks) return false;
    room += limit;
    lo = std::max(lo, env.rank_time(p, min_blocks));
    hi = std::max(hi, env.rank_time(p, limit));
  }
  if (room < blocks) return false;
  const double min_step = env.min_step;  // smallest time of one block anywhere

  // The continuous relaxation brackets the optimum tightly. Rank p never holds more than
  // (t - fixed) / per blocks of any one of its lines, so giving every rank that many blocks
  // of its steepest line and solving for t gives a lower bound t*. With one row, at
  // t* + max per-block time every rank can hold one more block than its floor, which is
  // feasible whenever the memory caps do not bind; with more rows the other lines may bind,
  // and the feasibility test decides. Bisection then needs a few steps, not ~60. Where it
  // stops does not change the counts (see the trim below).
  if (min_step < kInf) {
    double inverse_sum = 0, weighted_fixed = 0, max_step = 0;
    bool all_positive = true;
    for (int p = 0; p < pp; ++p) {
      const RankCost* steepest = &env.line[env.first[p]];
      for (int i = env.first[p] + 1; i < env.first[p + 1]; ++i) {
        if (env.line[i].per_block_s > steepest->per_block_s) steepest = &env.line[i];
      }
      if (steepest->per_block_s <= 0) all_positive = false;
      else {
        inverse_sum += 1.0 / steepest->per_block_s;
        weighted_fixed += steepest->fixed_s / steepest->per_block_s;
        max_step = std::max(max_step, steepest->per_block_s);
      }
    }
    if (all_positive) {
      const double relaxed = (blocks + weighted_fixed) / inverse_sum;
      lo = std::max(lo, std::min(relaxed, hi));
      const double upper = relaxed + max_step;
      if (upper < hi && env.feasible(pp, blocks, min_blocks, upper)) hi = upper;
    }
  }

  if (!env.feasible(pp, blocks, min_blocks, lo)) {
    // Invariant: lo infeasible, hi feasible. The trim below gives the same counts from any
    // feasible hi (it keeps the smallest blocks in its order), so bisection only shrinks the
    // surplus it gives back: stopping within two of the smallest blocks of the optimum
    // balances the steps' feasibility tests against the trim's heap operations.
    for (int step = 0;
         step < kBisectionSteps && hi - lo > 1e-15 * hi && !(hi - lo < 2 * min_step); ++step) {
      const double mid = lo + (hi - lo) / 2;
      if (mid <= lo || mid >= hi) break;
      if (env.feasible(pp, blocks, min_blocks, mid))
        hi = mid;
      else
        lo = mid;
    }
  } else {
    hi = lo;
  }

  // Counts at hi, then give back the surplus from the slowest ranks first.
  long total = 0;
  for (int p = 0; p < pp; ++p) {
    out[p] = env.capacity(p, hi, blocks);
    total += out[p];
  }
  // Removing a block from the slowest rank that can spare one keeps the result optimal: the
  // counts always dominate some optimal allocation (exchange argument, docs/planner.md).
  if (total > blocks) {
    thread_local std::vector<std::pair<double, int>> heap;
    heap.clear();
    for (int p = 0; p < pp; ++p) {
      if (out[p] > min_blocks) heap.emplace_back(env.rank_time(p, out[p]), -p);
    }
    std::make_heap(heap.begin(), heap.end());
    for (long surplus = total - blocks; surplus > 0; --surplus) {
      assert(!heap.empty());
      std::pop_heap(heap.begin(), heap.end());
      const int p = -heap.back().second;
      heap.pop_back();
      --out[p];
      if (out[p] > min_blocks) {
        heap.emplace_back(env.rank_time(p, out[p]), -p);
        std::push_heap(heap.begin(), heap.end());
      }
    }
  }
  double bottleneck = 0;
  for (int p = 0; p < pp; ++p) {
    bottleneck = std::max(bottleneck, env.rank_time(p, out[p]));
  }
  *bottleneck_s = bottleneck;
  return true;
}

std::vector<int> chunk_layers(const std::vector<int>& blocks_per_rank, int virtual_stages) {
  const int pp = static_cast<int>(blocks_per_rank.size());
  std::vector<int> out(static_cast<size_t>(pp) * virtual_stages);
  for (int p = 0; p < pp; ++p) {
    const int base = blocks_per_rank[p] / virtual_stages;
    const int extra = blocks_per_rank[p] % virtual_stages;
    for (int k = 0; k < virtual_stages; ++k) out[k * pp + p] = base + (k < extra ? 1 : 0);
  }
  return out;
}

namespace {

// Reachable prefix ends after each stage when every stage's time must be <= t. reach is
// (stages + 1) x (layers + 1); returns whether `layers` is reachable after the last stage.
bool chain_reach(const std::vector<double>& prefix, const std::vector<double>& factor,
                 const std::vector<double>& fixed, const std::vector<int>& max_layers, double t,
                 std::vector<char>& reach, std::vector<int>& diff) {
  const int layers = static_cast<int>(prefix.size()) - 1;
  const int stages = static_cast<int>(factor.size());
  const int width = layers + 1;
  std::fill(reach.begin(), reach.end(), 0);
  reach[0] = 1;  // before stage 0, prefix 0
  for (int s = 0; s < stages; ++s) {
    std::fill(diff.begin(), diff.end(), 0);
    const char* prev = &reach[static_cast<size_t>(s) * width];
    int end = 0;  // furthest end reachable from start a (non-decreasing in a)
    for (int a = 0; a < layers; ++a) {
      if (!prev[a]) continue;
      end = std::max(end, a);
      while (end < layers && end + 1 - a <= max_layers[s] &&
             fixed[s] + factor[s] * (prefix[end + 1] - prefix[a]) <= t) {
        ++end;
      }
      if (end > a) {
        diff[a + 1] += 1;
        diff[end + 1] -= 1;
      }
    }
    char* next = &reach[static_cast<size_t>(s + 1) * width];
    int running = 0;
    for (int e = 0; e <= layers; ++e) {
      running += diff[e];
      next[e] = running > 0;
    }
  }
  return reach[static_cast<size_t>(stages) * width + layers] != 0;
}

}  // namespace

std::optional<ChainPartition> partition_chain(const std::vector<double>& layer_cost_s,
                                              const std::vector<double>& stage_factor,
                                              const std::vector<double>& stage_fixed_s,
                                              const std::vector<int>& max_layers) {
  const int layers = static_cast<int>(layer_cost_s.size());
  const int stages = static_cast<int>(stage_factor.size());
  assert(stage_fixed_s.size() == stage_factor.size() && max_layers.size() == stage_factor.size());
  if (stages < 1 || stages > layers) return std::nullopt;
  std::vector<double> prefix(layers + 1, 0.0);
  for (int l = 0; l < layers; ++l) prefix[l + 1] = prefix[l] + layer_cost_s[l];
  std::vector<char> reach(static_cast<size_t>(stages + 1) * (layers + 1));
  std::vector<int> diff(layers + 2);

  double lo = 0, hi = 0;
  for (int s = 0; s < stages; ++s) {
    hi = std::max(hi, stage_fixed_s[s] + stage_factor[s] * prefix[layers]);
  }
  if (!chain_reach(prefix, stage_factor, stage_fixed_s, max_layers, hi, reach, diff))
    return std::nullopt;
  for (int step = 0; step < kBisectionSteps && hi - lo > 1e-15 * hi; ++step) {
    const double mid = lo + (hi - lo) / 2;
    if (mid <= lo || mid >= hi) break;
    if (chain_reach(prefix, stage_factor, stage_fixed_s, max_layers, mid, reach, diff))
      hi = mid;
    else
      lo = mid;
  }
  chain_reach(prefix, stage_factor, stage_fixed_s, max_layers, hi, reach, diff);

  // Walk back from the last stage, choosing any reachable start that keeps the stage <= hi.
  ChainPartition result;
  std::vector<int>& layers_per_stage = result.layers_per_stage;
  layers_per_stage.assign(stages, 0);
  const int width = layers + 1;
  int end = layers;
  double bottleneck = 0;
  for (int s = stages - 1; s >= 0; --s) {
    const char* prev = &reach[static_cast<size_t>(s) * width];
    int start = -1;
    for (int a = end - 1; a >= 0 && end - a <= max_layers[s]; --a) {
      const double t = stage_fixed_s[s] + stage_factor[s] * (prefix[end] - prefix[a]);
      if (t > hi) break;
      if (prev[a]) {
        start = a;
        break;
      }
    }
    assert(start >= 0);
    layers_per_stage[s] = end - start;
    bottleneck =
        std::max(bottleneck, stage_fixed_s[s] + stage_factor[s] * (prefix[end] - prefix[start]));
    end = start;
  }
  result.bottleneck_s = bottleneck;
  return result;
}

namespace {

// Elastic shares without bisection. The allocation partition_blocks returns for one row does not
// depend on where its bisection stops: the counts at any feasible bound, trimmed by taking
// blocks off the slowest rank first (ties: the lowest rank first), keep exactly the smallest
// candidate blocks in the order (time, then highest rank first), each replica's first unit
// always kept. So this picks those blocks directly: every replica's blocks up to the
// continuous relaxation's bottleneck, then the few still missing from the replicas' next
// blocks. The times are the same expressions as partition_blocks', so the counts are
// bit-identical. The relaxation keeps every replica's first block: replicas it would give
// less than one hold exactly one and the rest share what is left; when the few still missing
// go beyond some replica's next block, they are taken one at a time, smallest first. Returns
// false (out possibly written) when a case falls outside what this handles (non-positive or
// odd costs, counts past the blocks); the caller then runs partition_blocks.
bool allocate_direct(const double* per_microbatch_s, const double* fixed_s, int replicas,
                     int blocks, int unit, int* out) {
  struct Next {
    double time_s;
    int replica;
  };
  thread_local std::vector<double> per, fixed, inverse;
  thread_local std::vector<Next> next;
  per.resize(replicas);
  fixed.resize(replicas);
  inverse.resize(replicas);
  double inverse_sum = 0, weighted_fixed = 0;
  for (int r = 0; r < replicas; ++r) {
    const double a = per_microbatch_s[r] * unit;
    const double f = fixed_s ? fixed_s[r] : 0.0;
    if (!(std::isnormal(a) && a > 0 && std::isfinite(f) && f >= 0)) return false;
    per[r] = a;
    fixed[r] = f;
    inverse[r] = 1.0 / a;
    inverse_sum += inverse[r];
    weighted_fixed += f * inverse[r];
  }
  double relaxed = (blocks + weighted_fixed) / inverse_sum;
  // Every replica keeps its first block: one whose first block already ends after the
  // bottleneck holds exactly that one, and the others share the rest (a few rounds, as each
  // lowers the bottleneck; if they do not settle, the counts overshoot and the caller bisects).
  thread_local std::vector<uint8_t> single;
  single.assign(replicas, 0);
  for (int round = 0; round < 8 && std::isfinite(relaxed); ++round) {
    int singles = 0;
    bool changed = false;
    inverse_sum = weighted_fixed = 0;
    for (int r = 0; r < replicas; ++r) {
      if (!single[r] && fixed[r] + per[r] > relaxed) {
        single[r] = 1;
        changed = true;
      }
      if (single[r]) {
        ++singles;
      } else {
        inverse_sum += inverse[r];
        weighted_fixed += fixed[r] * inverse[r];
      }
    }
    if (!changed) break;
    if (singles == replicas) return false;
    relaxed = (blocks - singles + weighted_fixed) / inverse_sum;
  }
  if (!std::isfinite(relaxed)) return false;

  // Blocks per replica with time <= relaxed (at least one), and the time of each one's next.
  next.resize(replicas);
  long kept = 0;
  for (int r = 0; r < replicas; ++r) {
    const double a = per[r], f = fixed[r];
    int n = -1;  // largest count with f + a * n <= relaxed, capped at blocks
    if (f <= relaxed) {
      const double room = (relaxed - f) * inverse[r];  // >= 0: truncation is the floor
      n = room >= blocks ? blocks : static_cast<int>(room);
      while (n < blocks && f + a * (n + 1) <= relaxed) ++n;
      while (n >= 0 && f + a * n > relaxed) --n;
    }
    n = std::max(n, 1);
    out[r] = n;
    kept += n;
    next[r] = {n < blocks ? f + a * (n + 1) : kInf, r};
  }
  if (kept > blocks) return false;
  const long missing = blocks - kept;
  if (missing == 0) return true;

  // The `missing` smallest next blocks, provided no replica's block after its next one comes
  // before the last of them.
  const auto smaller = [](const Next& x, const Next& y) {
    return x.time_s < y.time_s || (x.time_s == y.time_s && x.replica > y.replica);
  };
  std::nth_element(next.begin(), next.begin() + (missing - 1), next.end(), smaller);
  const Next last = next[missing - 1];
  if (!(last.time_s < kInf)) return false;
  bool next_only = true;
  for (int r = 0; r < replicas && next_only; ++r) {
    if (out[r] + 2 > blocks) continue;
    const Next after{fixed[r] + per[r] * (out[r] + 2), r};
    next_only = smaller(last, after);
  }
  if (next_only) {
    for (long i = 0; i < missing; ++i) ++out[next[i].replica];
    return true;
  }
  // Some replica takes more than its next block: the smallest blocks one at a time (a heap of
  // each replica's next block, smallest on top).
  const auto larger = [&](const Next& x, const Next& y) { return smaller(y, x); };
  std::make_heap(next.begin(), next.end(), larger);
  for (long i = 0; i < missing; ++i) {
    std::pop_heap(next.begin(), next.end(), larger);
    Next& taken = next.back();
    if (!(taken.time_s < kInf)) return false;
    const int r = taken.replica;
    ++out[r];
    taken.time_s = out[r] < blocks ? fixed[r] + per[r] * (out[r] + 1) : kInf;
    std::push_heap(next.begin(), next.end(), larger);
  }
  return true;
}

// A run of consecutive replicas with equal costs: `count` replicas from `begin`, each with
// blocks of `per` seconds (a unit of microbatches) after `fixed` seconds.
struct Run {
  int begin, count;
  double per, fixed, inverse;  // inverse = 1 / per
  int n;          // blocks every member holds up to the relaxation's bottleneck
  double next_s;  // the time of a member's next block
  int take;       // members (the highest ones) that also take their next block
};

// Appends a run of `count` replicas from `begin` with per-microbatch time per_microbatch_s and
// fixed time fixed_s. False for costs allocate_runs does not handle (the checks of
// allocate_direct).
bool add_run(std::vector<Run>& runs, int begin, int count, double per_microbatch_s,
             double fixed_s, int unit) {
  const double a = per_microbatch_s * unit;
  if (!(std::isnormal(a) && a > 0 && std::isfinite(fixed_s) && fixed_s >= 0)) return false;
  runs.push_back(Run{begin, count, a, fixed_s, 1.0 / a, 0, 0, 0});
  return true;
}

// The same allocation for replicas that come in runs of equal costs (consecutive replicas
// with the same per-microbatch and fixed times, listed in `runs` as add_run made them),
// worked out once per run. The allocation does not depend on the relaxation's bottleneck (see
// allocate_direct): every replica's first block, then the blocks that come first in the order
// (time, then highest replica first). A run's members have the same blocks, and its higher
// members come first among them; a run after another holds only higher replicas. The blocks
// up to the relaxation's bottleneck are a prefix of that order, and a replica's blocks come in
// it one after another, so the rest are taken smallest first from the runs' next blocks.
// Writes the microbatch counts (blocks times unit) to out; returns false (out unwritten) for
// cases it leaves to allocate_direct (a run's steps too small to tell two blocks apart, or
// counts past the blocks).
bool allocate_runs(std::vector<Run>& runs, int replicas, int blocks, int unit, int* out) {
  double inverse_sum = 0, weighted_fixed = 0;
  for (const Run& run : runs) {
    inverse_sum += run.count * run.inverse;
    weighted_fixed += run.count * run.fixed * run.inverse;
  }
  double relaxed = (blocks + weighted_fixed) / inverse_sum;
  thread_local std::vector<uint8_t> single;
  single.assign(runs.size(), 0);
  for (int round = 0; round < 8 && std::isfinite(relaxed); ++round) {
    long singles = 0;
    bool changed = false;
    inverse_sum = weighted_fixed = 0;
    for (size_t k = 0; k < runs.size(); ++k) {
      const Run& run = runs[k];
      if (!single[k] && run.fixed + run.per > relaxed) {
        single[k] = 1;
        changed = true;
      }
      if (single[k]) {
        singles += run.count;
      } else {
        inverse_sum += run.count * run.inverse;
        weighted_fixed += run.count * run.fixed * run.inverse;
      }
    }
    if (!changed) break;
    if (singles == replicas) return false;
    relaxed = (static_cast<double>(blocks - singles) + weighted_fixed) / inverse_sum;
  }
  if (!std::isfinite(relaxed)) return false;

  long kept = 0;
  for (Run& run : runs) {
    const double a = run.per, f = run.fixed;
    int n = -1;  // largest count with f + a * n <= relaxed, capped at blocks
    if (f <= relaxed) {
      const double room = (relaxed - f) * run.inverse;  // >= 0: truncation is the floor
      n = room >= blocks ? blocks : static_cast<int>(room);
      while (n < blocks && f + a * (n + 1) <= relaxed) ++n;
      while (n >= 0 && f + a * n > relaxed) --n;
    }
    run.n = std::max(n, 1);
    run.next_s = run.n < blocks ? f + a * (run.n + 1) : kInf;
    run.take = 0;
    kept += static_cast<long>(run.n) * run.count;
  }
  if (kept > blocks) return false;
  // The missing blocks, smallest first, from a heap of the runs keyed by their members' next
  // block (smallest time on top, the later run first on a tie), each run's highest members
  // first. A run whose members all take their next block moves up a block and goes back on
  // the heap.
  long missing = blocks - kept;
  if (missing > 0) {
    // The heap holds each run's key next to its index, so comparisons read no run.
    struct Entry {
      double next_s;  // runs[run].next_s
      int run;
    };
    thread_local std::vector<Entry> heap;
    heap.resize(runs.size());
    for (size_t k = 0; k < runs.size(); ++k) heap[k] = {runs[k].next_s, static_cast<int>(k)};
    const auto later = [](const Entry& x, const Entry& y) {
      return x.next_s > y.next_s || (x.next_s == y.next_s && x.run < y.run);
    };
    std::make_heap(heap.begin(), heap.end(), later);
    while (missing > 0) {
      std::pop_heap(heap.begin(), heap.end(), later);
      Run& run = runs[heap.back().run];
      if (!(run.next_s < kInf)) return false;
      // A member's block after its next one that ties with the next (a step too small to
      // show) would come before the lower members' next blocks: the caller handles that.
      if (missing > 1 && run.n + 2 <= blocks && !(run.next_s < run.fixed + run.per * (run.n + 2)))
        return false;
      const long take = std::min<long>(missing, run.count);
      missing -= take;
      if (take < run.count) {
        run.take = static_cast<int>(take);
        break;
      }
      ++run.n;
      run.next_s = run.n < blocks ? run.fixed + run.per * (run.n + 1) : kInf;
      heap.back().next_s = run.next_s;
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  for (const Run& run : runs) {
    const int rest = run.count - run.take;
    std::fill_n(out + run.begin, rest, run.n * unit);
    std::fill_n(out + run.begin + rest, run.take, (run.n + 1) * unit);
  }
  return true;
}

// Replica by replica: allocate_direct, or partition_blocks with one row where it declines.
void allocate_each(const double* per_microbatch_s, const double* fixed_s, int replicas, int total,
                   int unit, int* out) {
  if (!allocate_direct(per_microbatch_s, fixed_s, replicas, total / unit, unit, out)) {
    thread_local std::vector<RankCost> costs;
    costs.resize(replicas);
    for (int r = 0; r < replicas; ++r) {
      costs[r].fixed_s = fixed_s ? fixed_s[r] : 0.0;
      costs[r].per_block_s = per_microbatch_s[r] * unit;
      costs[r].max_blocks = INT_MAX;
    }
    double bottleneck = 0;
    const bool ok = partition_blocks(costs.data(), 1, replicas, total / unit, 1, out, &bottleneck);
    assert(ok);
    (void)ok;
  }
  for (int r = 0; r < replicas; ++r) out[r] *= unit;
}

}  // namespace

void allocate_microbatches(const double* per_microbatch_s, const double* fixed_s, int replicas,
                           int total, int unit, int* out) {
  assert(unit >= 1 && total % unit == 0 && total >= replicas * unit);
  if (total == replicas * unit) {  // one unit each: the only allocation
    std::fill_n(out, replicas, unit);
    return;
  }
  // Replicas in runs of equal costs (like replicas of a placement): once per run.
  thread_local std::vector<Run> runs;
  runs.clear();
  bool by_runs = true;
  for (int r = 0; r < replicas && by_runs; ++r) {
    const double f = fixed_s ? fixed_s[r] : 0.0;
    if (r > 0 && per_microbatch_s[r] == per_microbatch_s[r - 1] && f == runs.back().fixed) {
      ++runs.back().count;
    } else {
      by_runs = add_run(runs, r, 1, per_microbatch_s[r], f, unit);
    }
  }
  if (by_runs && allocate_runs(runs, replicas, total / unit, unit, out)) return;
  allocate_each(per_microbatch_s, fixed_s, replicas, total, unit, out);
}

void allocate_microbatches(const double* per_microbatch_s, const double* fixed_s,
                           const int* run_begin, int runs, int total, int unit, int* out) {
  const int replicas = run_begin[runs];
  assert(runs >= 1 && run_begin[0] == 0);
  assert(unit >= 1 && total % unit == 0 && total >= replicas * unit);
  if (total == replicas * unit) {
    std::fill_n(out, replicas, unit);
    return;
  }
  // Adjacent runs with equal times are one run to allocate_runs.
  thread_local std::vector<Run> joined;
  joined.clear();
  bool by_runs = true;
  for (int k = 0; k < runs && by_runs; ++k) {
    const int count = run_begin[k + 1] - run_begin[k];
    assert(count >= 1);
    if (k > 0 && per_microbatch_s[k] == per_microbatch_s[k - 1] &&
        fixed_s[k] == fixed_s[k - 1]) {
      joined.back().count += count;
    } else {
      by_runs = add_run(joined, run_begin[k], count, per_microbatch_s[k], fixed_s[k], unit);
    }
  }
  if (by_runs && allocate_runs(joined, replicas, total / unit, unit, out)) return;
  thread_local std::vector<double> per, fixed;
  per.resize(replicas);
  fixed.resize(replicas);
  for (int k = 0; k < runs; ++k) {
    std::fill(per.begin() + run_begin[k], per.begin() + run_begin[k + 1], per_microbatch_s[k]);
    std::fill(fixed.begin() + run_begin[k], fixed.begin() + run_begin[k + 1], fixed_s[k]);
  }
  allocate_each(per.data(), fixed.data(), replicas, total, unit, out);
}

}  // namespace parapilot
