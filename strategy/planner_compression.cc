// Search: per-layer gradient compression of the leading candidates, and whether a search keeps
// ZeRO-0 variants for it (docs/planner.md).
#include "strategy/planner_search.h"

#include <algorithm>
#include <optional>

#include "strategy/cost_formulas.h"

namespace parapilot {
namespace planner_internal {

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

// Per-layer compression: among the methods whose error stays within the budget, the one that
// sends the fewest bytes; then only as many layers (largest savings first) as make the
// iteration faster. Lossless when compression does not pay.
void Search::choose_compression(Candidate& cand) {
  const GradientStats& g = req_.gradients;
  if (!space_.compression || g.empty() || cand.strategy.dp <= 1) return;
  const double base = cand.cost.iteration_time_s;
  if (cand.cost.dp_comm_s <= 1e-3 * base) return;  // nothing exposed to save
  const int layers = model_.layers;
  const double grad_bytes = grad_bytes_per_param(model_);
  const double params = static_cast<double>(model_.params_per_layer());
  struct Choice {
    Compression method;
    double saved_bytes;
    int layer;
  };
  thread_local std::vector<Choice> choices;
  choices.clear();
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

  // Sets s's compression to the first n choices' methods on their layers (the others none).
  thread_local std::vector<Compression> per_layer;
  auto compress_first = [&](Strategy& s, size_t n) {
    per_layer.assign(layers, Compression{});
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
  };
  // Compression only shortens the exposed DP reduction (as finish() relies on), so no variant
  // runs faster than base - dp_comm: once that cannot beat the best so far by the margin
  // below, a variant is not costed (a relative margin covers the rounding of the two).
  const double fastest_s = (base - cand.cost.dp_comm_s) * (1 - 1e-9);
  // The variants differ from the candidate only in their compression, which compress_first
  // sets whole: one copy of its strategy serves them all, and only a better one is kept.
  Strategy s = cand.strategy;
  std::optional<Candidate> best;
  double best_s = base;  // the best iteration time so far
  const size_t n = choices.size();
  for (size_t k : {n / 4, n / 2, (3 * n) / 4, n}) {
    if (k == 0) continue;
    if (fastest_s >= best_s - 0.005 * base) break;
    compress_first(s, k);
    ++evaluated_;
    const CostBreakdown b = cost_.evaluate(s, c_, off_nominal_);
    // Lossy only when it pays by more than 0.5%.
    if (b.feasible && b.fits_in_memory && b.iteration_time_s < best_s - 0.005 * base) {
      best = Candidate{s, b, 0, 0};
      best_s = b.iteration_time_s;
    }
  }
  if (best) cand = std::move(*best);
}

}  // namespace planner_internal
}  // namespace parapilot
