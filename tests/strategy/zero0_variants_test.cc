// The planner's ZeRO-0 variants (docs/planner.md): one search gives the same candidates as
// merging a search of the whole space with one restricted to ZeRO 0, each compressed on its
// leaders, keeping the faster layout of each family.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "strategy/planner.h"
#include "tests/strategy/two_search_merge.h"

using namespace parapilot;
using parapilot::testing::same_family;
using parapilot::testing::two_search_merge;

namespace {

bool strongly_compressed(const Strategy& s, int layers) {
  for (int l = 0; l < layers; ++l) {
    const Compression::Kind k = s.compression_of_layer(l).kind;
    if (k == Compression::Kind::kTopK || k == Compression::Kind::kPowerSGD) return true;
  }
  return false;
}

// Gradients whose blocks compress unevenly: top-k fits the budget on some, PowerSGD on others.
GradientStats gradients(int layers, double budget) {
  GradientStats g;
  g.error_budget = budget;
  for (int l = 0; l < layers; ++l) {
    g.topk_energy.push_back(0.94 + 0.05 * ((l * 7) % 11) / 10.0);
    g.lowrank_residual.push_back(0.01 + 0.06 * ((l * 5) % 9) / 8.0);
  }
  return g;
}

}  // namespace

TEST_CASE("planner: one search with ZeRO-0 variants equals the two-search merge") {
  struct Setup {
    const char* model;
    const char* cluster;
  };
  int compared = 0, zero0_wins = 0;
  for (const Setup& setup :
       {Setup{"gpt3-1.3b", "2x8xa100-80g"}, Setup{"gpt3-1.3b", "1x8xa100-80g+1x8xh800"},
        Setup{"llama2-7b", "4x8xa100-80g"}}) {
    const ModelSpec model = *model_preset(setup.model);
    const ClusterSpec cluster = *cluster_preset(setup.cluster);
    const Planner planner(model, cluster);
    const int gpus = cluster.num_gpus();
    const int nodes = gpus / 8;
    for (int variant = 0; variant < 12; ++variant) {
      PlanRequest req;
      req.gradients = gradients(model.layers, variant % 2 ? 0.05 : 0.02);
      if (variant % 3 == 1) req.conditions.node_inter_bw.assign(nodes, 0.1);  // congested
      if (variant % 3 == 2) {
        req.conditions.gpu_speed.assign(gpus, 1.0);
        req.conditions.gpu_speed[3] = 0.4;
        req.conditions.node_inter_bw.assign(nodes, 0.3);
      }
      req.space.zero = variant % 4 < 2 ? std::vector<int>{0, 1} : std::vector<int>{};
      req.top_k = std::vector<int>{1, 3, 5, 2}[variant % 4];
      req.zero0_top_k = variant % 5 == 0 ? 0 : 5;
      if (variant >= 6) {
        Strategy current;
        current.dp = gpus;
        current.zero = 1;
        current.global_batch = default_global_batch(gpus);
        current.microbatch_size = 1;
        req.current = current;
      }
      CAPTURE(setup.model);
      CAPTURE(setup.cluster);
      CAPTURE(variant);
      const PlanResult single = planner.plan(req);
      const PlanResult merged = two_search_merge(planner, req);
      REQUIRE(single.candidates.size() == merged.candidates.size());
      for (size_t i = 0; i < single.candidates.size(); ++i) {
        const Candidate& a = single.candidates[i];
        const Candidate& b = merged.candidates[i];
        CAPTURE(i);
        CHECK(a.strategy == b.strategy);
        CHECK(a.cost.tokens_per_s == b.cost.tokens_per_s);
        CHECK(a.cost.iteration_time_s == b.cost.iteration_time_s);
        CHECK(a.migration_bytes == b.migration_bytes);
        CHECK(a.migration_s == b.migration_s);
      }
      // Without the variants the ZeRO-0 layouts that compress well are often missed.
      PlanRequest plain = req;
      plain.zero0_variants = false;
      const PlanResult without = planner.plan(plain);
      for (const Candidate& c : single.candidates) {
        if (c.strategy.zero != 0 || !strongly_compressed(c.strategy, model.layers)) continue;
        const bool found =
            std::any_of(without.candidates.begin(), without.candidates.end(),
                        [&](const Candidate& o) { return o.strategy == c.strategy; });
        zero0_wins += found ? 0 : 1;
      }
      ++compared;
    }
  }
  MESSAGE(compared << " requests compared; " << zero0_wins
                   << " candidates came from the ZeRO-0 variants");
  CHECK(zero0_wins > 0);
}

TEST_CASE("planner: ZeRO-0 variants only when the gradients admit top-k or PowerSGD") {
  const ModelSpec model = *model_preset("gpt3-1.3b");
  const Planner planner(model, *cluster_preset("2x8xa100-80g"));
  PlanRequest req;
  req.space.zero = {0, 1};
  req.conditions.node_inter_bw.assign(2, 0.1);
  req.gradients = gradients(model.layers, 0.005);  // fp16 only: no block fits top-k or PowerSGD
  PlanRequest off = req;
  off.zero0_variants = false;
  const PlanResult with = planner.plan(req);
  const PlanResult without = planner.plan(off);
  CHECK(with.evaluated == without.evaluated);
  REQUIRE(with.candidates.size() == without.candidates.size());
  for (size_t i = 0; i < with.candidates.size(); ++i) {
    CHECK(with.candidates[i].strategy == without.candidates[i].strategy);
  }
  // A space of ZeRO 0 alone needs no second ranking either.
  req.gradients = gradients(model.layers, 0.05);
  req.space.zero = {0};
  off = req;
  off.zero0_variants = false;
  CHECK(planner.plan(req).evaluated == planner.plan(off).evaluated);
}
