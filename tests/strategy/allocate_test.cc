// Elastic data-parallel shares: allocate_microbatches against the bisection it replaced (a copy
// of the previous implementation below, kept as the reference), on randomised instances up to
// 1,024 replicas with ties, zero fixed times, stragglers and identical replica classes. The
// outputs must be identical, not merely as good.
#include <doctest/doctest.h>

#include <algorithm>
#include <cassert>
#include <climits>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "strategy/partitioner.h"

using parapilot::RankCost;

namespace reference {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kBisectionSteps = 200;

// The rows of one call, reduced per rank to the lines that can be the slowest: row j's line
// (fixed_s, per_block_s) at rank p is dropped when another row's line is at least as large in
// both (then it is never above it for any block count >= 0, in floating point too, since
// rounding is monotone). Rank p's lines are line[first[p]..first[p + 1]); limit[p] is the
// smallest max_blocks over all rows. With one row per replica that differs only by noise,
// this leaves a handful of lines per rank instead of one per replica.
struct Envelope {
  std::vector<RankCost> line;
  std::vector<int> first;
  std::vector<int> limit;

  void build(const RankCost* costs, int rows, int pp) {
    line.clear();
    first.assign(pp + 1, 0);
    limit.assign(pp, INT_MAX);
    for (int p = 0; p < pp; ++p) {
      first[p] = static_cast<int>(line.size());
      for (int j = 0; j < rows; ++j) {
        const RankCost& c = costs[j * pp + p];
        limit[p] = std::min(limit[p], c.max_blocks);
        line.push_back(c);
      }
      if (rows > 1) prune(first[p]);
    }
    first[pp] = static_cast<int>(line.size());
  }

  // Drops the dominated lines among line[from..end). Incremental (each line is compared with
  // the few kept so far) while few are kept; a sort and sweep otherwise.
  void prune(int from) {
    constexpr int kIncrementalMax = 32;
    const auto dominates = [](const RankCost& a, const RankCost& b) {
      return a.fixed_s >= b.fixed_s && a.per_block_s >= b.per_block_s;
    };
    int kept = from;  // line[from..kept) are mutually non-dominated
    for (int i = from; i < static_cast<int>(line.size()); ++i) {
      const RankCost c = line[i];
      bool dominated = false;
      for (int k = from; k < kept && !dominated; ++k) dominated = dominates(line[k], c);
      if (dominated) continue;
      int w = from;
      for (int k = from; k < kept; ++k) {
        if (!dominates(c, line[k])) line[w++] = line[k];
      }
      line[w++] = c;
      kept = w;
      if (kept - from > kIncrementalMax) {
        // Many lines survive: sort by per-block time (largest first, ties: largest fixed
        // first) and keep a line only when its fixed time exceeds every kept line's.
        line.erase(line.begin() + kept, line.begin() + i + 1);
        const auto begin = line.begin() + from;
        std::sort(begin, line.end(), [](const RankCost& a, const RankCost& b) {
          if (a.per_block_s != b.per_block_s) return a.per_block_s > b.per_block_s;
          return a.fixed_s > b.fixed_s;
        });
        auto out = begin;
        double max_fixed = -kInf;
        for (auto it = begin; it != line.end(); ++it) {
          if (it->fixed_s > max_fixed) {
            max_fixed = it->fixed_s;
            *out++ = *it;
          }
        }
        line.erase(out, line.end());
        return;
      }
    }
    line.resize(kept);
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
      int n = room >= most ? most : static_cast<int>(std::floor(room));
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
  double min_step = kInf;  // smallest time of one block anywhere
  for (int i = 0; i < rows * pp; ++i) {
    if (costs[i].per_block_s > 0) min_step = std::min(min_step, costs[i].per_block_s);
  }

  // With one row the continuous relaxation brackets the optimum tightly: giving rank p
  // (t - fixed_p) / per_p blocks for all p and solving for t gives a lower bound t*, and at
  // t* + max per-block time every rank can hold one more block than its floor, which is
  // feasible whenever the memory caps do not bind. Bisection then needs a few steps, not ~60.
  if (rows == 1 && min_step < kInf) {
    double inverse_sum = 0, weighted_fixed = 0, max_step = 0;
    bool all_positive = true;
    for (int p = 0; p < pp; ++p) {
      if (costs[p].per_block_s <= 0)
        all_positive = false;
      else {
        inverse_sum += 1.0 / costs[p].per_block_s;
        weighted_fixed += costs[p].fixed_s / costs[p].per_block_s;
        max_step = std::max(max_step, costs[p].per_block_s);
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
    // Invariant: lo infeasible, hi feasible. Once hi is within half a block of the optimum,
    // each rank holds at most one block more than at the optimum and the trim below is exact.
    for (int step = 0;
         step < kBisectionSteps && hi - lo > 1e-15 * hi && !(hi - lo < 0.5 * min_step); ++step) {
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

// allocate_microbatches as it was: one row through the rows == 1 bisection above.
void allocate_microbatches(const double* per_microbatch_s, const double* fixed_s, int replicas,
                           int total, int unit, int* out) {
  if (total == replicas * unit) {
    for (int r = 0; r < replicas; ++r) out[r] = unit;
    return;
  }
  std::vector<RankCost> costs(replicas);
  for (int r = 0; r < replicas; ++r) {
    costs[r].fixed_s = fixed_s ? fixed_s[r] : 0.0;
    costs[r].per_block_s = per_microbatch_s[r] * unit;
    costs[r].max_blocks = INT_MAX;
  }
  double bottleneck = 0;
  const bool ok =
      reference::partition_blocks(costs.data(), 1, replicas, total / unit, 1, out, &bottleneck);
  REQUIRE(ok);
  for (int r = 0; r < replicas; ++r) out[r] *= unit;
}

}  // namespace reference

namespace {

// One instance: per-microbatch and fixed times for `replicas` replicas drawn from one of
// several families.
struct Instance {
  std::vector<double> per, fixed;
  bool null_fixed = false;
  int total = 0, unit = 1;
};

Instance draw(std::mt19937& rng, int replicas, int family) {
  std::uniform_real_distribution<double> u(0.2, 3.0);
  std::lognormal_distribution<double> noise(0.0, 0.03);
  Instance in;
  in.per.resize(replicas);
  in.fixed.resize(replicas);
  in.unit = 1 + static_cast<int>(rng() % 4);
  const int per_replica = static_cast<int>(rng() % 3) == 0 ? 1 + static_cast<int>(rng() % 3)
                                                           : 1 + static_cast<int>(rng() % 40);
  in.total = in.unit * (replicas + static_cast<int>(rng() % (replicas * per_replica + 1)));
  const double base_per = u(rng), base_fixed = u(rng);
  for (int r = 0; r < replicas; ++r) {
    double& p = in.per[r];
    double& f = in.fixed[r];
    switch (family) {
      case 0:  // independent
        p = u(rng);
        f = rng() % 2 ? u(rng) : 0.0;
        break;
      case 1:  // identical replicas and a few stragglers, as the straggler scenario plans
        p = base_per;
        f = base_fixed;
        if (rng() % 16 == 0) {
          const double slow = 1.0 + 4.0 * static_cast<double>(rng() % 1000) / 1000.0;
          p *= slow;
          f *= slow;
        }
        break;
      case 2:  // small integers: many exactly equal times across replicas
        p = 1.0 + static_cast<double>(rng() % 3);
        f = static_cast<double>(rng() % 3);
        break;
      case 3:  // noisy copies of one replica, zero fixed times
        p = base_per * noise(rng);
        f = 0.0;
        break;
      case 4:  // a few classes, large fixed times (a slow replica may get a single unit)
        p = base_per * (1.0 + static_cast<double>(rng() % 4));
        f = base_fixed * 40.0 * static_cast<double>(rng() % 3);
        break;
      case 6:  // one or two units each and stragglers: the slow replicas hold a single unit
        p = base_per * (rng() % 8 == 0 ? 1.2 + 2.8 * static_cast<double>(rng() % 1000) / 1000.0
                                       : noise(rng));
        f = rng() % 2 ? base_fixed * 0.1 : 0.0;
        break;
      default:  // extreme spread: a replica far slower than the rest
        p = rng() % 32 == 0 ? base_per * 1000.0 : base_per * noise(rng);
        f = rng() % 2 ? base_fixed * noise(rng) : 0.0;
        break;
    }
  }
  if (family == 6) {
    in.total = in.unit * (replicas + static_cast<int>(rng() % (replicas + 1)));
  }
  in.null_fixed = family == 3 && rng() % 2 == 0;
  return in;
}

}  // namespace

TEST_CASE("partitioner: allocate_microbatches equals the previous bisection, bit for bit") {
  std::mt19937 rng(2024);
  const int sizes[] = {1, 2, 3, 5, 8, 17, 64, 100, 257, 512, 1000, 1024};
  int trial = 0;
  for (int round = 0; round < 40; ++round) {
    for (const int replicas : sizes) {
      for (int family = 0; family < 7; ++family, ++trial) {
        const Instance in = draw(rng, replicas, family);
        const double* fixed = in.null_fixed ? nullptr : in.fixed.data();
        std::vector<int> got(replicas), want(replicas);
        parapilot::allocate_microbatches(in.per.data(), fixed, replicas, in.total, in.unit,
                                         got.data());
        reference::allocate_microbatches(in.per.data(), fixed, replicas, in.total, in.unit,
                                         want.data());
        CAPTURE(trial);
        CAPTURE(replicas);
        CAPTURE(family);
        CAPTURE(in.total);
        CAPTURE(in.unit);
        REQUIRE(got == want);
      }
    }
  }
}

TEST_CASE("partitioner: allocate_microbatches on exact ties and degenerate inputs") {
  // Every replica alike: the surplus goes to the highest replicas, as before.
  for (const int replicas : {2, 7, 64, 1024}) {
    for (const int extra : {1, 3, replicas - 1, replicas + 1, 5 * replicas}) {
      std::vector<double> per(replicas, 0.5), fixed(replicas, 0.25);
      const int total = replicas + extra;
      std::vector<int> got(replicas), want(replicas);
      parapilot::allocate_microbatches(per.data(), fixed.data(), replicas, total, 1, got.data());
      reference::allocate_microbatches(per.data(), fixed.data(), replicas, total, 1, want.data());
      CAPTURE(replicas);
      CAPTURE(extra);
      REQUIRE(got == want);
    }
  }
  // Zero and tiny per-microbatch times fall back to the bisection and still agree.
  std::vector<double> per = {0.0, 1.0, 2.0, 1e-320}, fixed = {1.0, 0.0, 0.5, 0.0};
  std::vector<int> got(4), want(4);
  parapilot::allocate_microbatches(per.data(), fixed.data(), 4, 12, 1, got.data());
  reference::allocate_microbatches(per.data(), fixed.data(), 4, 12, 1, want.data());
  CHECK(got == want);
}

TEST_CASE("partitioner: allocate_microbatches by runs equals it replica by replica") {
  // The overload taking runs against the bisection (replica by replica). Runs as the planner
  // passes them: long runs of like replicas, runs of one or two replicas, neighbouring runs
  // with equal times (joined), times from a small set (exact ties across runs), zero and tiny
  // times (the bisection fallback), steps too small to change a time (1e-17 after 1 s: a
  // replica's blocks tie), and totals from one unit each to many.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.2, 3.0);
  const double pers[] = {0.5, 1.0, 1.5, 2.0, 3.0};
  const double fixeds[] = {0.0, 0.5, 1.0};
  const double flat_pers[] = {1e-17, 2e-17, 0.5};
  for (int trial = 0; trial < 3000; ++trial) {
    const int kind = trial % 5;
    const int runs = 1 + static_cast<int>(rng() % (kind == 3 ? 200 : 24));
    std::vector<double> run_per(runs), run_fixed(runs);
    std::vector<int> run_begin(runs + 1, 0);
    for (int k = 0; k < runs; ++k) {
      if (k > 0 && rng() % 4 == 0) {  // the same times as the run before
        run_per[k] = run_per[k - 1];
        run_fixed[k] = run_fixed[k - 1];
      } else if (kind == 0) {
        run_per[k] = u(rng);
        run_fixed[k] = rng() % 2 ? u(rng) : 0.0;
      } else if (kind == 1 || kind == 3) {
        run_per[k] = pers[rng() % 5];
        run_fixed[k] = fixeds[rng() % 3];
      } else if (kind == 2) {  // degenerate times now and then
        const unsigned pick = rng() % 8;
        run_per[k] = pick == 0 ? 0.0 : pick == 1 ? 1e-320 : u(rng);
        run_fixed[k] = u(rng);
      } else {  // flat steps
        run_per[k] = flat_pers[rng() % 3];
        run_fixed[k] = rng() % 4 == 0 ? 0.0 : 1.0;
      }
      const int length = kind == 3 ? 1 + static_cast<int>(rng() % 2)
                                   : 1 + static_cast<int>(rng() % (rng() % 2 ? 3 : 80));
      run_begin[k + 1] = run_begin[k] + length;
    }
    const int replicas = run_begin[runs];
    const int unit = 1 + static_cast<int>(rng() % 3);
    const int total =
        unit * (replicas + (rng() % 5 == 0 ? 0 : static_cast<int>(rng() % (3 * replicas + 1))));
    std::vector<double> per(replicas), fixed(replicas);
    for (int k = 0; k < runs; ++k) {
      for (int r = run_begin[k]; r < run_begin[k + 1]; ++r) {
        per[r] = run_per[k];
        fixed[r] = run_fixed[k];
      }
    }
    std::vector<int> got(replicas), want(replicas);
    parapilot::allocate_microbatches(run_per.data(), run_fixed.data(), run_begin.data(), runs,
                                     total, unit, got.data());
    // The bisection steps at most one block past its estimate of a replica's capacity, so on
    // flat steps the overload taking replicas one by one is the reference.
    if (kind == 4) {
      parapilot::allocate_microbatches(per.data(), fixed.data(), replicas, total, unit,
                                       want.data());
    } else {
      reference::allocate_microbatches(per.data(), fixed.data(), replicas, total, unit,
                                       want.data());
    }
    CAPTURE(trial);
    CAPTURE(runs);
    CAPTURE(replicas);
    CAPTURE(total);
    CAPTURE(unit);
    REQUIRE(got == want);
  }
}

TEST_CASE("partitioner: partition_blocks equals the previous implementation, bit for bit") {
  // Many replica rows as the planner passes them (duplicates, stragglers, noise, anti-correlated
  // rows that all stay on the envelope), memory caps and zero fixed times; one row with up to
  // 1,024 ranks as the fallback of allocate_microbatches uses it. Every third trial has many
  // blocks per rank, so the relaxation's bracket, not the memory caps, bounds the bisection.
  std::mt19937 rng(99);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  std::lognormal_distribution<double> noise(0.0, 0.05);
  const int row_counts[] = {1, 2, 3, 16, 33, 64, 200, 1024};
  for (int trial = 0; trial < 2400; ++trial) {
    const int rows = row_counts[trial % 8];
    const int pp = rows == 1 ? 1 + static_cast<int>(rng() % 1024) : 1 + static_cast<int>(rng() % 8);
    const int v = 1 + static_cast<int>(rng() % 2);
    const int spread = trial % 3 == 0 ? 64 * pp + 200 : 4 * pp + 20;
    const int blocks = pp * v + static_cast<int>(rng() % spread);
    const int kind = (trial / 8) % 4;
    std::vector<RankCost> base(pp);
    for (auto& c : base) {
      c.fixed_s = rng() % 2 ? u(rng) : 0.0;
      c.per_block_s = u(rng);
    }
    std::vector<RankCost> costs(static_cast<size_t>(rows) * pp);
    for (int j = 0; j < rows; ++j) {
      for (int p = 0; p < pp; ++p) {
        RankCost& c = costs[j * pp + p];
        if (kind == 0) {  // noisy copies
          c.fixed_s = base[p].fixed_s * noise(rng);
          c.per_block_s = base[p].per_block_s * noise(rng);
        } else if (kind == 1) {  // identical rows and a few stragglers
          c = base[p];
          if (j % 37 == 5) c.per_block_s *= 2.5;
        } else if (kind == 2) {  // anti-correlated: every row on the envelope
          const double x = static_cast<double>(j) / rows;
          c.fixed_s = base[p].fixed_s + x;
          c.per_block_s = base[p].per_block_s * (1.5 - x);
        } else {  // small integers: exact ties
          c.fixed_s = static_cast<double>(rng() % 3);
          c.per_block_s = 1.0 + static_cast<double>(rng() % 3);
        }
        c.max_blocks = rng() % 8 == 0 ? v + static_cast<int>(rng() % 5) : INT_MAX;
      }
    }
    std::vector<int> got(pp), want(pp);
    double got_s = -1, want_s = -1;
    const bool got_ok =
        parapilot::partition_blocks(costs.data(), rows, pp, blocks, v, got.data(), &got_s);
    const bool want_ok =
        reference::partition_blocks(costs.data(), rows, pp, blocks, v, want.data(), &want_s);
    CAPTURE(trial);
    CAPTURE(rows);
    CAPTURE(kind);
    REQUIRE(got_ok == want_ok);
    if (!got_ok) continue;
    REQUIRE(got == want);
    REQUIRE(got_s == want_s);
  }
}

TEST_CASE("partitioner: partition_blocks does not depend on the order of the rows") {
  // The planner passes its rows in any order it likes (split_pipeline: reverse replica order);
  // shuffled rows, with exact ties, duplicates and memory caps, give the same counts and
  // bottleneck, bit for bit.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int trial = 0; trial < 600; ++trial) {
    const int rows = 2 + static_cast<int>(rng() % 60);
    const int pp = 1 + static_cast<int>(rng() % 8);
    const int v = 1 + static_cast<int>(rng() % 2);
    const int blocks = pp * v + static_cast<int>(rng() % (16 * pp + 20));
    const bool ties = trial % 2 == 0;
    std::vector<RankCost> costs(static_cast<size_t>(rows) * pp);
    for (RankCost& c : costs) {
      c.fixed_s = ties ? static_cast<double>(rng() % 3) : u(rng);
      c.per_block_s = ties ? 1.0 + static_cast<double>(rng() % 3) : u(rng);
      c.max_blocks = rng() % 8 == 0 ? v + static_cast<int>(rng() % 5) : INT_MAX;
    }
    std::vector<int> order(rows);
    for (int j = 0; j < rows; ++j) order[j] = j;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<RankCost> shuffled(costs.size());
    for (int j = 0; j < rows; ++j) {
      std::copy_n(costs.begin() + order[j] * pp, pp, shuffled.begin() + j * pp);
    }
    std::vector<int> got(pp), want(pp);
    double got_s = -1, want_s = -1;
    const bool got_ok =
        parapilot::partition_blocks(shuffled.data(), rows, pp, blocks, v, got.data(), &got_s);
    const bool want_ok =
        parapilot::partition_blocks(costs.data(), rows, pp, blocks, v, want.data(), &want_s);
    CAPTURE(trial);
    REQUIRE(got_ok == want_ok);
    if (!got_ok) continue;
    REQUIRE(got == want);
    REQUIRE(got_s == want_s);
  }
}
