// Futures sampled from the scenario's dynamics (env/sim/futures.h), against generate_truth and
// against the dynamics' own distributions.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "env/sim/futures.h"
#include "env/sim/scenario.h"

using namespace parapilot;
using namespace parapilot::env;

namespace {

// The share of (GPU, interval) pairs slowed and of (node, interval) pairs congested.
struct Shares {
  double slowed = 0, congested = 0, failed = 0;
};

void add(Shares& s, const std::vector<Conditions>& intervals, int gpus, int nodes) {
  for (const Conditions& c : intervals) {
    for (int g = 0; g < gpus; ++g) {
      s.slowed += c.speed(g) < 1.0;
      s.failed += c.failed(g);
    }
    for (int n = 0; n < nodes; ++n) s.congested += c.inter(n) < 1.0;
  }
}

// Adds `draws` episodes' truths (seeds 100 on) and as many futures from nominal beliefs over a
// whole episode's window: two draws of the same process.
void draw_truths_and_futures(const Scenario& s, int draws, std::mt19937_64& rng, Shares& truth,
                             Shares& future) {
  const int gpus = s.cluster.num_gpus(), nodes = s.cluster.num_nodes();
  for (int i = 0; i < draws; ++i) {
    add(truth, generate_truth(s, 100 + i).conditions, gpus, nodes);
    add(future, sample_future(s, Conditions{}, ConditionAges{}, s.horizon, rng), gpus, nodes);
  }
}

}  // namespace

TEST_CASE("futures: from nominal beliefs, conditions start as often as generate_truth starts them") {
  // The mixed family has every kind of condition. A future from nominal beliefs over a whole
  // episode's window is a draw of the same process as the episode's truth.
  Scenario s = builtin_scenario(Family::kMixed, 32);
  s.straggler.rate_per_gpu_hour = 0.05;  // enough events for a tight comparison
  s.congestion.rate_per_node_hour = 0.1;
  s.failure.rate_per_node_hour = 0.05;
  Shares truth, future;
  const int draws = 2000;
  std::mt19937_64 rng(7);
  draw_truths_and_futures(s, draws, rng, truth, future);
  REQUIRE(truth.slowed > 1000);
  REQUIRE(truth.congested > 1000);
  REQUIRE(truth.failed > 1000);
  // Within 5%: over 2,000 episodes the two sums differ by about 1% from sampling alone.
  CHECK(future.slowed == doctest::Approx(truth.slowed).epsilon(0.05));
  CHECK(future.congested == doctest::Approx(truth.congested).epsilon(0.05));
  CHECK(future.failed == doctest::Approx(truth.failed).epsilon(0.05));
}

TEST_CASE("futures: a believed slowdown lasts as the dynamics say one of its age does") {
  Scenario s = builtin_scenario(Family::kStraggler, 16);
  s.straggler.rate_per_gpu_hour = 1e-6;  // next to no new ones: the believed slowdown alone
  const double I = s.interval_s;
  Conditions beliefs;
  beliefs.gpu_speed.assign(16, 1.0);
  beliefs.gpu_speed[5] = 0.5;
  ConditionAges ages;
  ages.gpu_slow_s.assign(16, 0.0);
  // Past every transient slowdown's length (at most 600 s): only persistent ones last this long.
  const double age = 1200;
  ages.gpu_slow_s[5] = age;
  const int H = 24, draws = 4000;
  std::vector<int> slowed(H, 0);
  std::mt19937_64 rng(3);
  for (int d = 0; d < draws; ++d) {
    const std::vector<Conditions> f = sample_future(s, beliefs, ages, H, rng);
    REQUIRE(f.size() == static_cast<size_t>(H));
    CHECK(f[0].speed(5) < 1.0);  // it has not ended the moment it is priced
    for (int i = 0; i < H; ++i) {
      CHECK(f[i].speed(3) == 1.0);
      if (f[i].speed(5) < 1.0) ++slowed[i];
    }
  }
  // Still slowed in interval i when the rest of it exceeds i intervals: the lognormal's
  // survival at age + i * I over its survival at age.
  const double median = s.straggler.persistent_median_h * 3600, sigma = s.straggler.persistent_sigma;
  auto survival = [&](double x) { return 0.5 * std::erfc(std::log(x / median) / (sigma * std::sqrt(2.0))); };
  for (int i : {2, 6, 12, 20}) {
    const double expected = survival(age + i * I) / survival(age);
    CHECK(static_cast<double>(slowed[i]) / draws == doctest::Approx(expected).epsilon(0.05));
  }
  // A young slowdown may be transient: it ends sooner.
  ages.gpu_slow_s[5] = 60;
  int young = 0;
  for (int d = 0; d < draws; ++d) young += sample_future(s, beliefs, ages, H, rng)[6].speed(5) < 1.0;
  CHECK(static_cast<double>(young) / draws < 0.8 * static_cast<double>(slowed[6]) / draws);
  // Where the scenario has no stragglers at all, a believed slowdown is the monitor's noise.
  s.straggler.rate_per_gpu_hour = 0;
  for (const Conditions& c : sample_future(s, beliefs, ages, H, rng)) CHECK(c.gpu_speed.empty());
}

TEST_CASE("futures: the same generator state gives the same future; another seed another") {
  const Scenario s = builtin_scenario(Family::kMixed, 32);
  Conditions beliefs;
  beliefs.gpu_speed.assign(32, 1.0);
  beliefs.gpu_speed[9] = 0.6;
  std::mt19937_64 a(11), b(11), c(12);
  bool differs = false;
  for (int k = 0; k < 20; ++k) {
    const std::vector<Conditions> fa = sample_future(s, beliefs, {}, 48, a);
    const std::vector<Conditions> fb = sample_future(s, beliefs, {}, 48, b);
    const std::vector<Conditions> fc = sample_future(s, beliefs, {}, 48, c);
    for (int i = 0; i < 48; ++i) {
      CHECK(fa[i].gpu_speed == fb[i].gpu_speed);
      CHECK(fa[i].node_inter_bw == fb[i].node_inter_bw);
      CHECK(fa[i].gpu_failed == fb[i].gpu_failed);
      differs = differs || fa[i].gpu_speed != fc[i].gpu_speed;
    }
  }
  CHECK(differs);
}

TEST_CASE("futures: fail-slows start as generate_truth starts them and end as their kind says") {
  Scenario s = builtin_scenario(Family::kFailSlow, 16);
  s.failslow.compute.rate = 0.2;  // enough events for a tight comparison of heavy tails
  s.failslow.communication.rate = 1;
  const int gpus = s.cluster.num_gpus();
  Shares truth, future;
  const int draws = 2000;
  std::mt19937_64 rng(7);
  draw_truths_and_futures(s, draws, rng, truth, future);
  REQUIRE(truth.slowed > 1000);
  REQUIRE(truth.congested > 1000);
  CHECK(future.slowed == doctest::Approx(truth.slowed).epsilon(0.05));
  CHECK(future.congested == doctest::Approx(truth.congested).epsilon(0.05));

  // A GPU just believed slowed: its compute fail-slow (lognormal, median 10 min x
  // exp(-1.5^2 / 2), about 3.2 min) still slows interval k in as many futures as one of its
  // kind lasts k intervals.
  s.failslow.communication.rate = 0;
  s.failslow.compute.rate = 1e-9;  // next to no new ones, but read as a fail-slow, not as noise
  Conditions slowed;
  slowed.gpu_speed.assign(gpus, 1.0);
  slowed.gpu_speed[3] = 0.5;
  int at0 = 0, at3 = 0, at100 = 0;
  for (int i = 0; i < draws; ++i) {
    const auto f = sample_future(s, slowed, ConditionAges{}, 101, rng);
    at0 += f[0].speed(3) < 1;
    at3 += f[3].speed(3) < 1;
    at100 += f[100].speed(3) < 1;
  }
  const double I = s.interval_s;
  const double median = s.failslow.compute.mean_s * std::exp(-0.5 * 1.5 * 1.5);
  auto survival = [&](double t) {
    return 0.5 * std::erfc(std::log(t / median) / (1.5 * std::sqrt(2.0)));
  };
  CHECK(at0 == draws);
  REQUIRE(survival(3 * I) < 0.9);
  CHECK(at3 == doctest::Approx(draws * survival(3 * I)).epsilon(0.08));
  CHECK(at100 == doctest::Approx(draws * survival(100 * I)).epsilon(0.3));
}
