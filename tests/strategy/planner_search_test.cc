// The search's internal fast paths against the plain computations they stand for, on random
// and adversarial inputs: results must be identical, not merely as good.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "strategy/planner_search.h"

using parapilot::planner_internal::speed_order;

namespace {

// The order make_groups used to sort groups into, kept as the reference.
std::vector<int> reference_speed_order(const std::vector<double>& speed) {
  std::vector<int> order(speed.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return speed[a] > speed[b] * (1 + 1e-12);
  });
  return order;
}

}  // namespace

TEST_CASE("planner: speed_order equals the stable sort by speed with its tolerance") {
  std::mt19937_64 rng(20240611);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<int> order;
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = std::uniform_int_distribution<int>(0, trial % 10 == 0 ? 1100 : 40)(rng);
    // A few base speeds; groups take them in stretches, some nudged within or just beyond the
    // tolerance, some zero, infinite, negative or NaN.
    std::vector<double> base(std::uniform_int_distribution<int>(1, 6)(rng));
    for (double& b : base) b = std::uniform_real_distribution<double>(0.1, 10.0)(rng);
    const int kind = trial % 5;
    std::vector<double> speed;
    while (static_cast<int>(speed.size()) < n) {
      double x = base[std::uniform_int_distribution<size_t>(0, base.size() - 1)(rng)];
      const int twist = std::uniform_int_distribution<int>(0, 99)(rng);
      if (kind == 1 && twist < 20) x *= 1 + 1e-13 * std::uniform_int_distribution<int>(-20, 20)(rng);
      if (kind == 2 && twist < 20) x *= 1 + 1e-12 * std::uniform_int_distribution<int>(-3, 3)(rng);
      if (kind == 3 && twist < 5) x = std::uniform_real_distribution<double>(0.1, 10.0)(rng);
      if (kind == 4 && twist < 3) x = 0;
      if (kind == 4 && twist == 3) x = inf;
      if (kind == 4 && twist == 4) x = -x;
      if (kind == 4 && twist == 5) x = std::nan("");
      const int length = std::uniform_int_distribution<int>(1, 16)(rng);
      for (int i = 0; i < length && static_cast<int>(speed.size()) < n; ++i) speed.push_back(x);
    }
    speed_order(speed, order);
    REQUIRE(order == reference_speed_order(speed));
  }
}
