// The reference for the planner's ZeRO-0 variants (docs/planner.md), shared by the strategy and
// env suites: what one search with variants must equal.
#pragma once

#include <algorithm>
#include <vector>

#include "strategy/planner.h"

namespace parapilot::testing {

// Same layout family: the degrees, sequence parallelism, schedule and recompute.
inline bool same_family(const Strategy& x, const Strategy& y) {
  return x.tp == y.tp && x.pp == y.pp && x.dp == y.dp && x.sp == y.sp && x.schedule == y.schedule &&
         x.recompute == y.recompute;
}

// The reference: two searches without ZeRO-0 variants, the second over ZeRO 0 alone ranking
// max(top_k, zero0_top_k) families, merged best first (the first search's on a tie), one
// candidate per family, top_k in all.
inline PlanResult two_search_merge(const Planner& planner, PlanRequest req) {
  const int top_k = req.top_k;
  req.zero0_variants = false;
  PlanResult result = planner.plan(req);
  // Only while some block may take top-k or PowerSGD, and the space has ZeRO 0 and more.
  const GradientStats& g = req.gradients;
  bool strong = false;
  for (size_t l = 0; l < g.topk_energy.size(); ++l)
    strong |= 1.0 - g.topk_energy[l] <= g.error_budget;
  for (double r : g.lowrank_residual) strong |= r <= g.error_budget;
  const std::vector<int>& zero = req.space.zero;
  const bool zero0_and_more =
      zero.empty() || (zero.size() > 1 && std::find(zero.begin(), zero.end(), 0) != zero.end());
  if (g.empty() || !strong || !zero0_and_more || !req.space.compression) return result;
  req.space.zero = {0};
  req.top_k = std::max(top_k, req.zero0_top_k);
  const PlanResult plain = planner.plan(req);
  std::vector<Candidate> all = std::move(result.candidates);
  all.insert(all.end(), plain.candidates.begin(), plain.candidates.end());
  std::stable_sort(all.begin(), all.end(), [](const Candidate& a, const Candidate& b) {
    return a.cost.tokens_per_s > b.cost.tokens_per_s;
  });
  result.candidates.clear();
  for (const Candidate& cand : all) {
    if (static_cast<int>(result.candidates.size()) == top_k) break;
    const bool seen =
        std::any_of(result.candidates.begin(), result.candidates.end(),
                    [&](const Candidate& o) { return same_family(o.strategy, cand.strategy); });
    if (!seen) result.candidates.push_back(cand);
  }
  return result;
}

}  // namespace parapilot::testing
