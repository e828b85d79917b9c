// Planner: the partitioner and elastic shares against brute force, the search against
// exhaustive enumeration through the cost model, mixed clusters, failures, compression,
// migration, and the [space] / [gradients] loaders.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "strategy/partitioner.h"
#include "strategy/planner.h"
#include "tests/test_util.h"

using namespace parapilot;
using parapilot::testing::failure_of;
using parapilot::testing::ok;
using parapilot::testing::TempFile;

namespace {

// Every composition of n into k positive parts, each at most max_part[i].
void compositions(int n, int k, const std::function<void(const std::vector<int>&)>& visit) {
  std::vector<int> parts(k, 1);
  std::function<void(int, int)> rec = [&](int i, int left) {
    if (i == k - 1) {
      parts[i] = left;
      visit(parts);
      return;
    }
    for (int x = 1; x <= left - (k - 1 - i); ++x) {
      parts[i] = x;
      rec(i + 1, left - x);
    }
  };
  if (k >= 1 && n >= k) rec(0, n);
}

ModelSpec small_gpt(int layers) {
  ModelSpec m;
  m.name = "small";
  m.layers = layers;
  m.hidden = 2048;
  m.heads = 16;
  m.kv_heads = 16;
  m.ffn_hidden = 8192;
  m.seq_len = 2048;
  m.vocab = 50257;
  return m;
}

double best_tokens(const PlanResult& r) {
  return r.candidates.empty() ? 0 : r.candidates[0].cost.tokens_per_s;
}

}  // namespace

TEST_CASE("planner: partition_blocks equals brute force on randomised instances") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int pp = 1 + static_cast<int>(rng() % 4);
    const int v = 1 + static_cast<int>(rng() % 2);
    const int rows = 1 + static_cast<int>(rng() % 3);
    const int blocks = pp * v + static_cast<int>(rng() % 10);
    std::vector<RankCost> costs(rows * pp);
    for (auto& c : costs) {
      c.fixed_s = (rng() % 2 ? u(rng) : 0.0);
      c.per_block_s = u(rng);
      c.max_blocks = rng() % 4 == 0 ? v + static_cast<int>(rng() % 4) : INT_MAX;
    }
    // Brute force over every count vector (each >= v).
    double brute = std::numeric_limits<double>::infinity();
    compositions(blocks - pp * (v - 1), pp, [&](const std::vector<int>& parts) {
      double worst = 0;
      for (int p = 0; p < pp; ++p) {
        const int n = parts[p] + v - 1;
        for (int j = 0; j < rows; ++j) {
          const RankCost& c = costs[j * pp + p];
          if (n > c.max_blocks) worst = std::numeric_limits<double>::infinity();
          worst = std::max(worst, c.fixed_s + c.per_block_s * n);
        }
      }
      brute = std::min(brute, worst);
    });
    std::vector<int> out(pp);
    double bottleneck = 0;
    const bool ok = partition_blocks(costs.data(), rows, pp, blocks, v, out.data(), &bottleneck);
    CAPTURE(trial);
    REQUIRE(ok == std::isfinite(brute));
    if (!ok) continue;
    CHECK(bottleneck == doctest::Approx(brute).epsilon(1e-12));
    int sum = 0;
    double worst = 0;
    for (int p = 0; p < pp; ++p) {
      CHECK(out[p] >= v);
      sum += out[p];
      for (int j = 0; j < rows; ++j) {
        CHECK(out[p] <= costs[j * pp + p].max_blocks);
        worst = std::max(worst, costs[j * pp + p].fixed_s + costs[j * pp + p].per_block_s * out[p]);
      }
    }
    CHECK(sum == blocks);
    CHECK(worst == doctest::Approx(bottleneck).epsilon(1e-12));
  }
}

TEST_CASE("planner: partition_blocks with many replica rows equals brute force") {
  // One row per replica, as the planner passes them: many rows differing by noise, exact
  // duplicates, and sets where no row dominates another (fixed cost rising while the
  // per-block cost falls), which exercise both ways of dropping rows that are never slowest.
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  std::lognormal_distribution<double> noise(0.0, 0.05);
  for (int trial = 0; trial < 200; ++trial) {
    const int pp = 1 + static_cast<int>(rng() % 4);
    const int v = 1 + static_cast<int>(rng() % 2);
    const int rows = 2 + static_cast<int>(rng() % 80);
    const int blocks = pp * v + static_cast<int>(rng() % 9);
    const int kind = trial % 3;
    std::vector<RankCost> base(pp);
    for (auto& c : base) {
      c.fixed_s = rng() % 2 ? u(rng) : 0.0;
      c.per_block_s = u(rng);
    }
    std::vector<RankCost> costs(rows * pp);
    for (int j = 0; j < rows; ++j) {
      for (int p = 0; p < pp; ++p) {
        RankCost& c = costs[j * pp + p];
        if (kind == 0) {  // noisy copies of one replica
          c.fixed_s = base[p].fixed_s * noise(rng);
          c.per_block_s = base[p].per_block_s * noise(rng);
        } else if (kind == 1) {  // a few distinct replicas, many duplicates
          c = costs[(static_cast<int>(rng() % 3) % (j + 1)) * pp + p];
          if (j < 3) c = RankCost{base[p].fixed_s * noise(rng), base[p].per_block_s * noise(rng)};
        } else {  // anti-correlated: every row is on the upper envelope somewhere
          const double x = static_cast<double>(j) / rows;
          c.fixed_s = base[p].fixed_s + x;
          c.per_block_s = base[p].per_block_s * (1.5 - x);
        }
        c.max_blocks = rng() % 8 == 0 ? v + static_cast<int>(rng() % 5) : INT_MAX;
      }
    }
    double brute = std::numeric_limits<double>::infinity();
    compositions(blocks - pp * (v - 1), pp, [&](const std::vector<int>& parts) {
      double worst = 0;
      for (int p = 0; p < pp; ++p) {
        const int n = parts[p] + v - 1;
        for (int j = 0; j < rows; ++j) {
          const RankCost& c = costs[j * pp + p];
          if (n > c.max_blocks) worst = std::numeric_limits<double>::infinity();
          worst = std::max(worst, c.fixed_s + c.per_block_s * n);
        }
      }
      brute = std::min(brute, worst);
    });
    std::vector<int> out(pp);
    double bottleneck = 0;
    const bool ok = partition_blocks(costs.data(), rows, pp, blocks, v, out.data(), &bottleneck);
    CAPTURE(trial);
    CAPTURE(kind);
    REQUIRE(ok == std::isfinite(brute));
    if (!ok) continue;
    CHECK(bottleneck == doctest::Approx(brute).epsilon(1e-12));
    int sum = 0;
    for (int p = 0; p < pp; ++p) {
      CHECK(out[p] >= v);
      sum += out[p];
    }
    CHECK(sum == blocks);
    // Appending a copy of every row with half its fixed time (never the slowest) changes
    // nothing.
    std::vector<RankCost> more = costs;
    for (int i = 0; i < rows * pp; ++i) {
      RankCost c = costs[i];
      c.fixed_s *= 0.5;
      c.max_blocks = INT_MAX;
      more.push_back(c);
    }
    std::vector<int> out2(pp);
    double bottleneck2 = 0;
    REQUIRE(partition_blocks(more.data(), 2 * rows, pp, blocks, v, out2.data(), &bottleneck2));
    CHECK(out2 == out);
    CHECK(bottleneck2 == bottleneck);
  }
}

TEST_CASE("planner: partition_chain with per-layer costs equals brute force") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.05, 3.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int layers = 1 + static_cast<int>(rng() % 12);
    const int stages = 1 + static_cast<int>(rng() % std::min(layers, 5));
    std::vector<double> cost(layers), factor(stages), fixed(stages);
    std::vector<int> max_layers(stages);
    for (auto& c : cost) c = u(rng);
    for (int s = 0; s < stages; ++s) {
      factor[s] = rng() % 3 == 0 ? 3.2 : u(rng);              // mixed and slowed stages
      fixed[s] = (s == 0 || s == stages - 1) ? u(rng) : 0.0;  // embedding / logits
      max_layers[s] = rng() % 4 == 0 ? 1 + static_cast<int>(rng() % 4) : layers;
    }
    double brute = std::numeric_limits<double>::infinity();
    compositions(layers, stages, [&](const std::vector<int>& parts) {
      double worst = 0;
      int at = 0;
      for (int s = 0; s < stages; ++s) {
        double sum = 0;
        for (int l = at; l < at + parts[s]; ++l) sum += cost[l];
        at += parts[s];
        if (parts[s] > max_layers[s]) worst = std::numeric_limits<double>::infinity();
        worst = std::max(worst, fixed[s] + factor[s] * sum);
      }
      brute = std::min(brute, worst);
    });
    CAPTURE(trial);
    const std::optional<ChainPartition> partition =
        partition_chain(cost, factor, fixed, max_layers);
    REQUIRE(partition.has_value() == std::isfinite(brute));
    if (!partition) continue;
    const std::vector<int>& out = partition->layers_per_stage;
    CHECK(partition->bottleneck_s == doctest::Approx(brute).epsilon(1e-12));
    int sum = 0;
    for (int s = 0; s < stages; ++s) {
      CHECK(out[s] >= 1);
      CHECK(out[s] <= max_layers[s]);
      sum += out[s];
    }
    CHECK(sum == layers);
  }
}

TEST_CASE("planner: chunk_layers keeps each rank's blocks in the cost model's chunk order") {
  const std::vector<int> chunks = chunk_layers({5, 3}, 2);
  // chunk k of rank p is entry k * pp + p
  CHECK(chunks == std::vector<int>{3, 2, 2, 1});
}

TEST_CASE("planner: elastic microbatch shares equal brute force and follow speed") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0.2, 3.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int replicas = 1 + static_cast<int>(rng() % 4);
    const int unit = 1 + static_cast<int>(rng() % 3);
    const int total = unit * (replicas + static_cast<int>(rng() % 8));
    std::vector<double> per(replicas), fixed(replicas);
    for (int r = 0; r < replicas; ++r) {
      per[r] = u(rng);
      fixed[r] = (rng() % 2 ? u(rng) : 0.0);
    }
    double brute = std::numeric_limits<double>::infinity();
    compositions(total / unit, replicas, [&](const std::vector<int>& parts) {
      double worst = 0;
      for (int r = 0; r < replicas; ++r)
        worst = std::max(worst, parts[r] * unit * per[r] + fixed[r]);
      brute = std::min(brute, worst);
    });
    std::vector<int> out(replicas);
    allocate_microbatches(per.data(), fixed.data(), replicas, total, unit, out.data());
    double worst = 0;
    int sum = 0;
    for (int r = 0; r < replicas; ++r) {
      CHECK(out[r] % unit == 0);
      CHECK(out[r] >= unit);
      sum += out[r];
      worst = std::max(worst, out[r] * per[r] + fixed[r]);
    }
    CAPTURE(trial);
    CHECK(sum == total);
    CHECK(worst == doctest::Approx(brute).epsilon(1e-12));
  }
  // Three times faster replica gets three times the microbatches.
  const double per[2] = {3.0, 1.0};
  int out[2];
  allocate_microbatches(per, nullptr, 2, 64, 1, out);
  CHECK(out[0] == 16);
  CHECK(out[1] == 48);
}

TEST_CASE("planner: elastic shares of replicas in runs of equal costs equal partition_blocks'") {
  // Like replicas come in long runs of equal costs; the shares are worked out once per run and
  // must be exactly the allocation of partition_blocks with one row (ties to higher replicas).
  // Costs from a small set make block times tie across runs.
  std::mt19937 rng(11);
  const double pers[] = {0.5, 1.0, 1.5, 2.0, 3.0};
  const double fixeds[] = {0.0, 0.0, 0.5, 1.0};
  std::uniform_real_distribution<double> u(0.2, 3.0);
  long by_runs_cases = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const bool discrete = trial % 2 == 0;
    std::vector<double> per, fixed;
    const int runs = 1 + static_cast<int>(rng() % 5);
    for (int k = 0; k < runs; ++k) {
      const double a = discrete ? pers[rng() % 5] : u(rng);
      const double f = discrete ? fixeds[rng() % 4] : (rng() % 2 ? u(rng) : 0.0);
      const int length = 1 + static_cast<int>(rng() % 60);
      per.insert(per.end(), length, a);
      fixed.insert(fixed.end(), length, f);
    }
    const int replicas = static_cast<int>(per.size());
    by_runs_cases += 4 * runs <= replicas;
    const int unit = 1 + static_cast<int>(rng() % 3);
    const int total = unit * (replicas + static_cast<int>(rng() % (3 * replicas + 1)));
    std::vector<int> out(replicas);
    allocate_microbatches(per.data(), fixed.data(), replicas, total, unit, out.data());
    std::vector<RankCost> costs(replicas);
    for (int r = 0; r < replicas; ++r) costs[r] = RankCost{fixed[r], per[r] * unit, INT_MAX};
    std::vector<int> reference(replicas);
    double bottleneck = 0;
    REQUIRE(partition_blocks(costs.data(), 1, replicas, total / unit, 1, reference.data(),
                             &bottleneck));
    for (int& n : reference) n *= unit;
    CAPTURE(trial);
    CAPTURE(replicas);
    CHECK(out == reference);
  }
  CHECK(by_runs_cases > 100);
}

TEST_CASE("planner: best layout equals exhaustive enumeration through the cost model") {
  // Exhaustive: every (tp, pp, dp) filling the cluster, sp, schedule and virtual stages,
  // recompute, zero, microbatch size, and every stage partition; uniform shares on a
  // homogeneous cluster (elastic shares cannot help there).
  struct Case {
    int layers;
    const char* cluster;
  };
  for (const Case& k :
       {Case{8, "2x4xa100-40g"}, Case{12, "1x8xa100-40g"}, Case{16, "4x8xa100-80g"}}) {
    const ModelSpec model = small_gpt(k.layers);
    const ClusterSpec cluster = *cluster_preset(k.cluster);
    const CostModel cost(model, cluster);
    const int gpus = cluster.num_gpus();
    SearchSpace space;
    space.global_batch = 64;
    space.microbatch_size = {1, 2, 4};
    space.virtual_stages = {2};
    space.zero = {0, 1};
    const bool big = gpus > 16;
    if (big) space.pp = {1, 2, 4};  // keeps the brute force under a second

    double brute = 0;
    Strategy brute_best;
    long enumerated = 0;
    for (int tp = 1; tp <= 8; tp *= 2) {
      for (int pp = 1; pp <= k.layers; ++pp) {
        if (big && pp != 1 && pp != 2 && pp != 4) continue;
        if (gpus % (tp * pp) != 0) continue;
        for (bool sp : {false, true}) {
          for (Schedule sched : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved}) {
            const int v = sched == Schedule::kInterleaved ? 2 : 1;
            for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
              for (int zero : {0, 1}) {
                for (int mb : {1, 2, 4}) {
                  Strategy s;
                  s.tp = tp;
                  s.pp = pp;
                  s.dp = gpus / (tp * pp);
                  s.sp = sp;
                  s.schedule = sched;
                  s.virtual_stages = v;
                  s.recompute = rc;
                  s.zero = zero;
                  s.microbatch_size = mb;
                  s.global_batch = 64;
                  if (find_problem(s, model, cluster)) continue;
                  compositions(k.layers, pp * v, [&](const std::vector<int>& parts) {
                    s.stage_layers = parts;
                    ++enumerated;
                    const CostBreakdown b = cost.evaluate(s);
                    if (b.feasible && b.fits_in_memory && b.tokens_per_s > brute) {
                      brute = b.tokens_per_s;
                      brute_best = s;
                    }
                  });
                }
              }
            }
          }
        }
      }
    }
    const Planner planner(model, cluster);
    PlanRequest req;
    req.space = space;
    req.top_k = 3;
    const PlanResult r = planner.plan(req);
    CAPTURE(k.cluster);
    CAPTURE(enumerated);
    REQUIRE(!r.candidates.empty());
    MESSAGE(std::string(k.cluster)
            << ": exhaustive " << enumerated << " layouts, planner evaluated " << r.evaluated);
    CHECK(r.evaluated < enumerated);
    CHECK(best_tokens(r) == doctest::Approx(brute).epsilon(1e-9));
    // The reported breakdown is the cost model's verdict on the returned strategy.
    const Strategy& s = r.candidates[0].strategy;
    CHECK_FALSE(find_problem(s, model, cluster).has_value());
    CHECK(cost.evaluate(s).iteration_time_s == r.candidates[0].cost.iteration_time_s);
  }
}

TEST_CASE("planner: with context parallelism inside and across nodes, best equals exhaustive") {
  // A 128k-token sequence on 4 nodes of 4 GPUs at a global batch of 2: at most two replicas, so
  // each takes 8 GPUs by tp, cp and pp; rings of up to 16 context ranks, inside a node or across
  // whole nodes, nominal and with every node's network at a quarter (the ring across nodes then
  // hides less). The bound prices the ring; it must never prune the best layout.
  ModelSpec model = small_gpt(8);
  model.seq_len = 131072;
  const ClusterSpec cluster = *cluster_preset("4x4xa100-80g");
  const CostModel cost(model, cluster);
  const int gpus = cluster.num_gpus();
  Conditions slow_network;
  slow_network.node_inter_bw.assign(cluster.num_nodes(), 0.25);
  for (const Conditions& conditions : {Conditions{}, slow_network}) {
    double brute = 0;
    long enumerated = 0;
    bool cp_across = false;
    std::string best_shape;
    for (int tp = 1; tp <= 4; tp *= 2)
      for (int cp = 1; tp * cp <= gpus; cp *= 2)
        for (int pp : {1, 2, 4}) {
          if (gpus % (tp * cp * pp) != 0) continue;
          for (bool sp : {false, true})
            for (Schedule sched : {Schedule::k1F1B, Schedule::kInterleaved})
              for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull})
                for (int zero : {0, 1})
                  for (int mb : {1, 2}) {
                    Strategy s;
                    s.tp = tp;
                    s.cp = cp;
                    s.pp = pp;
                    s.dp = gpus / (tp * cp * pp);
                    s.sp = sp;
                    s.schedule = sched;
                    s.virtual_stages = sched == Schedule::kInterleaved ? 2 : 1;
                    s.recompute = rc;
                    s.zero = zero;
                    s.microbatch_size = mb;
                    s.global_batch = 2;
                    if (find_problem(s, model, cluster)) continue;
                    compositions(model.layers, pp * s.virtual_stages,
                                 [&](const std::vector<int>& parts) {
                                   s.stage_layers = parts;
                                   ++enumerated;
                                   const CostBreakdown b = cost.evaluate(s, conditions);
                                   if (b.feasible && b.fits_in_memory && b.tokens_per_s > brute) {
                                     brute = b.tokens_per_s;
                                     best_shape = "tp " + std::to_string(tp) + " cp " +
                                                  std::to_string(cp) + " pp " +
                                                  std::to_string(pp);
                                     cp_across = tp * cp > 4;
                                   }
                                 });
                  }
        }
    const Planner planner(model, cluster);
    PlanRequest req;
    req.conditions = conditions;
    req.space.global_batch = 2;
    req.space.microbatch_size = {1, 2};
    req.space.virtual_stages = {2};
    req.space.zero = {0, 1};
    req.space.pp = {1, 2, 4};
    req.top_k = 3;
    const PlanResult r = planner.plan(req);
    CAPTURE(conditions.node_inter_bw.size());
    REQUIRE(!r.candidates.empty());
    MESSAGE("exhaustive " << enumerated << " layouts, best " << best_shape
                          << std::string(cp_across ? " (ring across nodes)" : "")
                          << ", planner evaluated "
                          << r.evaluated);
    CHECK(best_tokens(r) == doctest::Approx(brute).epsilon(1e-9));
  }
}

TEST_CASE("planner: candidates are feasible, ranked and diverse; the current layout is evaluated") {
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("2x8xa100-80g");
  const Planner planner(model, cluster);
  PlanRequest req;
  req.top_k = 6;
  Strategy current;
  current.dp = 8;
  current.tp = 2;
  current.sp = true;
  current.global_batch = 256;
  current.zero = 1;
  current.recompute = Recompute::kFull;
  req.current = current;
  const PlanResult r = planner.plan(req);
  REQUIRE(r.candidates.size() == 6);
  REQUIRE(r.current.has_value());
  CHECK(r.current->strategy == current);
  CHECK(r.evaluated > 0);
  std::set<std::tuple<int, int, int, bool, Schedule, Recompute>> families;
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const Candidate& c = r.candidates[i];
    CHECK_FALSE(find_problem(c.strategy, model, cluster).has_value());
    CHECK(c.cost.feasible);
    CHECK(c.cost.fits_in_memory);
    CHECK(c.strategy.global_batch == 256);  // the current layout's batch
    if (i > 0) CHECK(c.cost.tokens_per_s <= r.candidates[i - 1].cost.tokens_per_s);
    const auto& s = c.strategy;
    CHECK(families.insert({s.tp, s.pp, s.dp, s.sp, s.schedule, s.recompute}).second);
    if (!(c.strategy == current)) CHECK(c.migration_s >= kSwitchPauseS);
  }
  REQUIRE(r.current->cost.fits_in_memory);
  CHECK(r.candidates[0].cost.tokens_per_s >= r.current->cost.tokens_per_s);
}

TEST_CASE("planner: mixed a100 + h800 elastic layout beats uniform data parallel by >= 1.5x") {
  const ModelSpec model = *model_preset("gpt3-1.3b");
  const ClusterSpec cluster = *cluster_preset("1x8xa100-80g+1x8xh800");
  const Planner planner(model, cluster);
  PlanRequest req;
  req.space.global_batch = 256;
  const PlanResult r = planner.plan(req);
  REQUIRE(!r.candidates.empty());
  double uniform = 0;
  for (int mb : {1, 2, 4, 8, 16}) {
    for (int zero : {0, 1, 2}) {
      Strategy dp;
      dp.dp = 16;
      dp.global_batch = 256;
      dp.microbatch_size = mb;
      dp.zero = zero;
      const CostBreakdown b = planner.cost_model().evaluate(dp);
      if (b.fits_in_memory) uniform = std::max(uniform, b.tokens_per_s);
    }
  }
  // Upper bound: each GPU alone at its best, summed.
  double bound = 0;
  for (int g : {0, 8}) {
    double one_gpu = 0;
    for (int mb : {1, 2, 4, 8, 16}) {
      Strategy s;
      s.gpus = {g};
      s.global_batch = 16;
      s.microbatch_size = mb;
      const CostBreakdown b = planner.cost_model().evaluate(s);
      if (b.fits_in_memory) one_gpu = std::max(one_gpu, b.tokens_per_s);
    }
    bound += 8 * one_gpu;
  }
  const double best = best_tokens(r);
  MESSAGE("elastic " << best << " tokens/s, uniform dp " << uniform << ", bound " << bound);
  CHECK(best >= 1.5 * uniform);
  CHECK(best <= bound * 1.0001);
  CHECK(best >= 0.9 * bound);
  // The H800 replicas carry more samples than the A100 ones.
  const Strategy& s = r.candidates[0].strategy;
  REQUIRE(!s.dp_shares.empty());
  int a100 = 0, h800 = 0;
  for (int rep = 0; rep < s.dp; ++rep) {
    const int gpu = s.gpu_of_rank(rep, 0, 0);
    (gpu < 8 ? a100 : h800) = std::max(gpu < 8 ? a100 : h800, s.dp_shares[rep]);
  }
  CHECK(h800 > 2 * a100);
}

TEST_CASE("planner: failed GPUs are never used; slowed GPUs get less work") {
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("2x8xa100-80g");
  const Planner planner(model, cluster);
  PlanRequest req;
  req.space.global_batch = 240;
  req.conditions.gpu_failed.assign(16, false);
  req.conditions.gpu_failed[3] = true;
  const PlanResult r = planner.plan(req);
  REQUIRE(!r.candidates.empty());
  for (const Candidate& c : r.candidates) {
    CHECK(c.cost.feasible);
    CHECK_FALSE(find_problem(c.strategy, model, cluster).has_value());
    for (int d = 0; d < c.strategy.dp; ++d) {
      for (int p = 0; p < c.strategy.pp; ++p) {
        for (int t = 0; t < c.strategy.tp; ++t) CHECK(c.strategy.gpu_of_rank(d, p, t) != 3);
      }
    }
  }

  PlanRequest slow;
  slow.space.global_batch = 256;
  slow.space.tp = {1};
  slow.space.pp = {1};
  slow.conditions.gpu_speed.assign(16, 1.0);
  slow.conditions.gpu_speed[5] = 0.5;
  const PlanResult s = planner.plan(slow);
  REQUIRE(!s.candidates.empty());
  const Strategy& best = s.candidates[0].strategy;
  REQUIRE(best.dp_shares.size() == 16);
  int slow_share = 0, other = 0;
  for (int d = 0; d < 16; ++d) {
    if (best.gpu_of_rank(d, 0, 0) == 5)
      slow_share = best.dp_shares[d];
    else
      other = std::max(other, best.dp_shares[d]);
  }
  CHECK(slow_share > 0);
  CHECK(slow_share < other);
}

TEST_CASE("planner: pipeline stages give fewer blocks to slowed ranks and the logits rank") {
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("1x8xa100-80g");
  const Planner planner(model, cluster);
  PlanRequest req;
  req.space.global_batch = 64;
  req.space.tp = {2};
  req.space.pp = {4};
  req.space.schedule = {Schedule::k1F1B};
  req.space.microbatch_size = {1};
  req.conditions.gpu_speed.assign(8, 1.0);
  req.conditions.gpu_speed[4] = req.conditions.gpu_speed[5] = 0.6;  // tp group of stage 2
  const PlanResult r = planner.plan(req);
  REQUIRE(!r.candidates.empty());
  const Strategy& s = r.candidates[0].strategy;
  REQUIRE(s.stage_layers.size() == 4);
  CHECK(s.stage_layers[2] < s.stage_layers[1]);
  CHECK(s.stage_layers[3] <= s.stage_layers[1]);
  // Better than the balanced split under the same conditions.
  Strategy balanced = s;
  balanced.stage_layers.clear();
  CHECK(r.candidates[0].cost.iteration_time_s <
        planner.cost_model().evaluate(balanced, req.conditions).iteration_time_s);
}

TEST_CASE("planner: compression only when it pays and stays within the error budget") {
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("4x8xa100-80g");
  const Planner planner(model, cluster);
  PlanRequest req;
  req.space.tp = {8};
  req.space.pp = {1};
  req.space.global_batch = 32;
  req.conditions.node_inter_bw.assign(4, 0.02);  // congested network: DP reduction exposed
  req.gradients.error_budget = 0.01;
  req.gradients.topk_ratio = 0.01;
  req.gradients.topk_energy.assign(model.layers, 0.995);
  req.gradients.lowrank_residual.assign(model.layers, 0.5);  // PowerSGD too lossy here
  const PlanResult r = planner.plan(req);
  REQUIRE(!r.candidates.empty());
  const Candidate& c = r.candidates[0];
  const bool compressed = c.strategy.compression.kind != Compression::Kind::kNone ||
                          !c.strategy.compression_overrides.empty();
  CHECK(compressed);
  for (int l = 0; l < model.layers; ++l) {
    CHECK(c.strategy.compression_of_layer(l).kind != Compression::Kind::kPowerSGD);
  }
  Strategy lossless = c.strategy;
  lossless.compression = Compression{};
  lossless.compression_overrides.clear();
  CHECK(c.cost.iteration_time_s <
        planner.cost_model().evaluate(lossless, req.conditions).iteration_time_s);

  // A zero budget forbids every lossy method; a fast network makes compression pointless.
  req.gradients.error_budget = 0;
  const auto zero_budget = planner.plan(req).candidates;
  REQUIRE_FALSE(zero_budget.empty());
  for (const Candidate& k : zero_budget) {
    CHECK(k.strategy.compression.kind == Compression::Kind::kNone);
    CHECK(k.strategy.compression_overrides.empty());
  }
  req.gradients.error_budget = 0.01;
  req.conditions = {};
  // A batch large enough that the last gradient bucket, which never hides, stays under 0.1%
  // of the iteration (flash attention made the iteration shorter than 256 sequences allow).
  req.space.global_batch = 512;
  const auto fast = planner.plan(req).candidates;
  REQUIRE_FALSE(fast.empty());
  int negligible = 0;
  for (const Candidate& k : fast) {
    if (k.cost.dp_comm_s < 0.001 * k.cost.iteration_time_s) {
      ++negligible;
      CHECK(k.strategy.compression.kind == Compression::Kind::kNone);
    }
  }
  CHECK(negligible >= 1);
}

TEST_CASE("planner: compression changes only the exposed DP reduction (the search relies on it)") {
  // The planner skips compressing a family whose time without any DP reduction cannot reach
  // the K-th best; that is exact only while compression leaves iteration - dp_comm unchanged.
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("4x8xa100-80g");
  const Planner planner(model, cluster);
  Conditions congested;
  congested.node_inter_bw.assign(4, 0.05);
  congested.gpu_speed.assign(32, 1.0);
  congested.gpu_speed[3] = 0.6;
  std::vector<Compression> methods(4);
  methods[1].kind = Compression::Kind::kFP16;
  methods[2].kind = Compression::Kind::kTopK;
  methods[2].topk_ratio = 0.01;
  methods[3].kind = Compression::Kind::kPowerSGD;
  methods[3].powersgd_rank = 4;
  for (const auto& [tp, pp, zero] : {std::tuple{8, 1, 1}, {4, 2, 0}, {2, 4, 1}, {1, 1, 2}}) {
    Strategy s;
    s.tp = tp;
    s.pp = pp;
    s.dp = 32 / (tp * pp);
    s.zero = zero;
    s.global_batch = 64;
    s.microbatch_size = 1;
    s.recompute = Recompute::kSelective;
    REQUIRE(!find_problem(s, model, cluster));
    const CostBreakdown plain = planner.cost_model().evaluate(s, congested);
    for (size_t m = 1; m < methods.size(); ++m) {
      for (bool some_layers : {false, true}) {
        Strategy c = s;
        if (some_layers) {
          c.compression_overrides.push_back(CompressionOverride{2, 9, methods[m]});
        } else {
          c.compression = methods[m];
        }
        const CostBreakdown b = planner.cost_model().evaluate(c, congested);
        CAPTURE(tp);
        CAPTURE(pp);
        CAPTURE(m);
        CHECK(b.iteration_time_s - b.dp_comm_s ==
              doctest::Approx(plain.iteration_time_s - plain.dp_comm_s).epsilon(1e-12));
        CHECK(b.fits_in_memory == plain.fits_in_memory);
      }
    }
  }
}

TEST_CASE("planner: migration cost is zero for the same layout and grows with what moves") {
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("2x8xa100-80g");
  const Planner planner(model, cluster);
  Strategy a;
  a.dp = 4;
  a.tp = 4;
  a.zero = 1;  // optimizer state sharded over replicas: a new split has to move it
  a.global_batch = 256;
  const Migration same = planner.migration(a, a);
  CHECK(same.max_bytes == 0);
  CHECK(same.time_s == 0);

  Strategy b = a;
  b.dp = 2;
  b.pp = 2;
  const Migration moved = planner.migration(a, b);
  CHECK(moved.max_bytes > 0);
  CHECK(moved.time_s > kSwitchPauseS);
  // No GPU receives more than the whole state of what it holds afterwards (18 bytes/param for
  // a bf16 model), and pp = 2 means at most half the blocks plus one end layer.
  const double per_gpu_bound = (model.layers / 2 * static_cast<double>(model.params_per_layer()) +
                                static_cast<double>(model.embedding_params())) /
                               4 * 18.0;
  CHECK(moved.max_bytes <= per_gpu_bound * 1.0001);
  // Changing only the microbatch size moves nothing but still pauses to switch.
  Strategy c = a;
  c.microbatch_size = 2;
  CHECK(planner.migration(a, c).max_bytes == 0);
  CHECK(planner.migration(a, c).time_s >= kSwitchPauseS);
}

TEST_CASE("planner: [space] files load, and bad ones fail with file:line, key and reason") {
  const ModelSpec model = *model_preset("llama2-7b");
  TempFile good(
      "[space]\n"
      "tp = [1, 2, 4]\n"
      "pp = 2\n"
      "sp = [true]\n"
      "microbatch_size = [1, 2]\n"
      "schedule = [\"1f1b\", \"interleaved\"]\n"
      "virtual_stages = [2, 4]\n"
      "recompute = \"selective\"\n"
      "zero = [0, 1]\n"
      "max_pp = 8\n"
      "global_batch_range = [128, 512]\n"
      "mixed_types_in_pipeline = false\n");
  const SearchSpace s = ok(load_search_space(good.path(), model));
  CHECK(s.tp == std::vector<int>{1, 2, 4});
  CHECK(s.pp == std::vector<int>{2});
  CHECK(s.sp == std::vector<bool>{true});
  CHECK(s.schedule == std::vector<Schedule>{Schedule::k1F1B, Schedule::kInterleaved});
  CHECK(s.recompute == std::vector<Recompute>{Recompute::kSelective});
  CHECK(s.global_batch_min == 128);
  CHECK(s.global_batch_max == 512);
  CHECK_FALSE(s.mixed_types_in_pipeline);

  TempFile typo("[space]\ntp = 2\ntpp = 4\n");
  const std::string e1 = failure_of(load_search_space(typo.path(), model));
  CHECK(e1.find(typo.path() + ":3") != std::string::npos);
  CHECK(e1.find("unknown key 'tpp'") != std::string::npos);

  TempFile bad_tp("[space]\n\ntp = [1, 3]\n");
  const std::string e2 = failure_of(load_search_space(bad_tp.path(), model));
  CHECK(e2.find(bad_tp.path() + ":3") != std::string::npos);
  CHECK(e2.find("[space] tp") != std::string::npos);
  CHECK(e2.find("does not divide") != std::string::npos);

  TempFile bad_schedule("[space]\nschedule = [\"1f1b\", \"zigzag\"]\n");
  const std::string e3 = failure_of(load_search_space(bad_schedule.path(), model));
  CHECK(e3.find(":2") != std::string::npos);
  CHECK(e3.find("zigzag") != std::string::npos);

  TempFile bad_v("[space]\nschedule = \"interleaved\"\nvirtual_stages = 1\n");
  CHECK(failure_of(load_search_space(bad_v.path(), model)).find("virtual_stages >= 2") !=
        std::string::npos);

  TempFile bad_range("[space]\nglobal_batch_range = [512, 128]\n");
  CHECK(failure_of(load_search_space(bad_range.path(), model)).find("global_batch_range") !=
        std::string::npos);
  TempFile no_table("[strategy]\ntp = 2\n");
  CHECK(failure_of(load_search_space(no_table.path(), model)).find("no [space] table") !=
        std::string::npos);
}

TEST_CASE("planner: [gradients] statistics load and are validated") {
  const ModelSpec model = *model_preset("llama2-7b");
  TempFile good(
      "[conditions]\ngpu_speed = {3 = 0.5}\n\n"
      "[gradients]\nerror_budget = 0.02\ntopk_ratio = 0.01\ntopk_energy = 0.97\n"
      "powersgd_rank = 8\n");
  const GradientStats g = ok(load_gradient_stats(good.path(), model));
  CHECK(g.error_budget == 0.02);
  CHECK(g.topk_energy.size() == static_cast<size_t>(model.layers));
  CHECK(g.topk_energy[5] == 0.97);
  CHECK(g.powersgd_rank == 8);
  CHECK(g.lowrank_residual.empty());

  TempFile none("[conditions]\n");
  CHECK(ok(load_gradient_stats(none.path(), model)).empty());

  TempFile short_array("[gradients]\nerror_budget = 0.1\ntopk_energy = [0.9, 0.8]\n");
  const std::string e = failure_of(load_gradient_stats(short_array.path(), model));
  CHECK(e.find(short_array.path() + ":3") != std::string::npos);
  CHECK(e.find("32 layers") != std::string::npos);
  TempFile no_budget("[gradients]\ntopk_energy = 0.9\n");
  CHECK(failure_of(load_gradient_stats(no_budget.path(), model)).find("error_budget") !=
        std::string::npos);
}

TEST_CASE("planner: with every GPU failed there is no candidate, and the current layout is "
          "evaluated as infeasible") {
  const Planner planner(*model_preset("llama2-7b"), *cluster_preset("1x8xa100-80g"));
  PlanRequest req;
  req.top_k = 3;
  req.conditions.gpu_failed.assign(8, true);
  Strategy current;
  current.dp = 8;
  current.global_batch = 64;
  req.current = current;
  const PlanResult r = planner.plan(req);
  CHECK(r.candidates.empty());
  REQUIRE(r.current.has_value());
  CHECK_FALSE(r.current->cost.feasible);
  // One failed GPU leaves layouts on the other seven.
  req.conditions.gpu_failed.assign(8, false);
  req.conditions.gpu_failed[3] = true;
  CHECK_FALSE(planner.plan(req).candidates.empty());
}

TEST_CASE("planner: concurrent plan() calls on one planner agree with a single call") {
  const ClusterSpec cluster = *cluster_preset("1x8xa100-80g+1x8xh800");
  const Planner planner(*model_preset("gpt3-1.3b"), cluster);
  PlanRequest req;
  req.conditions.gpu_speed.assign(16, 1.0);
  req.conditions.gpu_speed[2] = 0.5;
  const PlanResult expected = planner.plan(req);
  std::vector<PlanResult> results(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] { results[i] = planner.plan(req); });
  }
  for (auto& t : threads) t.join();
  for (const PlanResult& r : results) {
    REQUIRE(r.candidates.size() == expected.candidates.size());
    CHECK(r.evaluated == expected.evaluated);
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      CHECK(r.candidates[i].strategy == expected.candidates[i].strategy);
      CHECK(r.candidates[i].cost.iteration_time_s == expected.candidates[i].cost.iteration_time_s);
    }
  }
}

TEST_CASE("planner: a space with sp = true still allows tp = 1, where sequence parallelism does not exist") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec c = *cluster_preset("8x8xa100-80g");
  const Planner planner(m, c);
  PlanRequest req;
  req.space.tp = {1, 2, 4, 8};
  req.space.pp = {1, 2, 4};
  req.space.microbatch_size = {1, 2};
  req.space.recompute = {Recompute::kSelective};
  req.space.zero = {1};
  req.space.sp = {true};
  req.space.schedule = {Schedule::k1F1B};
  req.space.compression = false;
  req.space.global_batch = 256;
  const PlanResult r = planner.plan(req);
  REQUIRE_FALSE(r.candidates.empty());
  // Pure data parallel is the fastest layout for a 7B model on 64 GPUs in this space.
  Strategy dp;
  dp.dp = 64;
  dp.global_batch = 256;
  dp.microbatch_size = 2;
  dp.zero = 1;
  dp.recompute = Recompute::kSelective;
  REQUIRE_FALSE(find_problem(dp, m, c));
  CHECK(r.candidates.front().strategy.tp == 1);
  CHECK(r.candidates.front().cost.tokens_per_s >=
        planner.cost_model().evaluate(dp).tokens_per_s * (1 - 1e-9));
}

TEST_CASE("planner: the current layout changes only migration costs, its own cost and kernels") {
  // Callers may keep a plan and re-cost its migrations for another running layout
  // (env/sim/sim_env.cc does): the candidates must not depend on the current layout otherwise.
  const ModelSpec model = *model_preset("llama2-7b");
  const ClusterSpec cluster = *cluster_preset("2x8xa100-80g");
  const Planner planner(model, cluster);
  PlanRequest req;
  req.top_k = 4;
  req.space.global_batch = 256;
  req.conditions.gpu_speed.assign(16, 1.0);
  req.conditions.gpu_speed[3] = 0.5;
  req.conditions.node_inter_bw = {1.0, 0.4};
  const PlanResult none = planner.plan(req);
  REQUIRE(none.candidates.size() == 4);
  Strategy a;
  a.dp = 8;
  a.tp = 2;
  a.sp = true;
  a.global_batch = 256;
  a.zero = 1;
  Strategy b = none.candidates[2].strategy;
  // b twice in a row: the second plan prices from the running layout's holdings kept from the
  // first; then back to a.
  for (const Strategy& current : {a, b, b, a}) {
    req.current = current;
    const PlanResult r = planner.plan(req);
    REQUIRE(r.candidates.size() == none.candidates.size());
    REQUIRE(r.current.has_value());
    CHECK(r.current->cost.iteration_time_s ==
          planner.cost_model().evaluate(current, req.conditions).iteration_time_s);
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      const Candidate& got = r.candidates[i];
      CHECK(got.strategy == none.candidates[i].strategy);
      CHECK(got.cost.iteration_time_s == none.candidates[i].cost.iteration_time_s);
      CHECK(none.candidates[i].migration_s == 0);
      const Migration m = planner.migration(current, got.strategy, req.conditions);
      CHECK(got.migration_s == m.time_s);
      CHECK(got.migration_bytes == m.max_bytes);
    }
  }
  // Kernel settings are the running job's, not the planner's: every candidate takes them.
  a.fp8 = true;
  req.current = a;
  for (const Candidate& c : planner.plan(req).candidates) CHECK(c.strategy.fp8);
}
