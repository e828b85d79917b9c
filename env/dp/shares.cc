#include "env/dp/shares.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace parapilot::env::dp {

std::vector<int> round_counts(const std::vector<double>& exact, int total) {
  const int n = static_cast<int>(exact.size());
  std::vector<int> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = std::max(1, static_cast<int>(std::floor(exact[r])));
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return exact[a] - std::floor(exact[a]) > exact[b] - std::floor(exact[b]);
  });
  int sum = std::accumulate(counts.begin(), counts.end(), 0);
  for (int i = 0; sum < total; ++i, ++sum) ++counts[order[i % n]];
  while (sum > total) {
    const auto it = std::max_element(counts.begin(), counts.end());
    --*it;
    --sum;
  }
  return counts;
}

std::string counts_text(const std::vector<int>& counts) {
  std::string out;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(counts[i]);
  }
  return out;
}

std::vector<int> even_counts(int ranks, int global_batch) {
  return round_counts(std::vector<double>(ranks, static_cast<double>(global_batch) / ranks),
                      global_batch);
}

std::vector<int> balanced_counts(const std::vector<double>& per_sample_ms,
                                 const std::vector<double>& fixed_ms, int global_batch,
                                 bool fixed_apart) {
  const int n = static_cast<int>(per_sample_ms.size());
  auto fixed = [&](int r) {
    return !fixed_apart && r < static_cast<int>(fixed_ms.size()) ? fixed_ms[r] : 0.0;
  };
  // Samples rank r can take within a step of T ms (at least 1).
  auto take = [&](int r, double t) { return std::max(1.0, (t - fixed(r)) / per_sample_ms[r]); };
  auto total = [&](double t) {
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += take(r, t);
    return sum;
  };
  double lo = 0, hi = 0;
  for (int r = 0; r < n; ++r) hi = std::max(hi, fixed(r) + per_sample_ms[r] * global_batch);
  for (int i = 0; i < 100 && hi - lo > 1e-9 * std::max(1.0, hi); ++i) {
    const double mid = 0.5 * (lo + hi);
    (total(mid) < global_batch ? lo : hi) = mid;
  }
  std::vector<double> exact(n);
  double sum = 0;
  for (int r = 0; r < n; ++r) sum += exact[r] = take(r, hi);
  for (double& e : exact) e *= global_batch / sum;  // the floor of 1 may overshoot slightly
  return round_counts(exact, global_batch);
}

double predicted_step_ms(const std::vector<double>& per_sample_ms,
                         const std::vector<double>& fixed_ms, const std::vector<int>& counts,
                         bool fixed_apart) {
  double worst = 0, worst_fixed = 0;
  for (size_t r = 0; r < per_sample_ms.size() && r < counts.size(); ++r) {
    const double f = r < fixed_ms.size() ? fixed_ms[r] : 0.0;
    worst = std::max(worst, (fixed_apart ? 0.0 : f) + per_sample_ms[r] * counts[r]);
    worst_fixed = std::max(worst_fixed, f);
  }
  return fixed_apart ? worst + worst_fixed : worst;
}

}  // namespace parapilot::env::dp
