// The data-parallel decider of a learned job (balanced shares from measured compute, the gain
// threshold, the revert guardrail), and deploy learning a job from its ranks' JobInfo.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "agent/deploy/agent.h"
#include "env/dp/decider.h"
#include "env/dp/shares.h"
#include "policy/baselines.h"
#include "env/monitor/robust_stats.h"
#include "tests/test_util.h"

using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::agent::deploy;
using namespace parapilot::env::dp;
using namespace std::chrono_literals;

namespace {

// The decider with deploy's rule (measured-shares, min_gain 1.10) choosing: one decision is an
// observation, the rule's action on it, and the guardrail's verdict.
struct RuleDecider : DataParallelDecider {
  explicit RuleDecider(DataParallelOptions o, int confirm = 1)
      : DataParallelDecider(o), rule(policy::make_measured_shares({1.10, confirm})) {}
  DataParallelDecision decide(const monitor::Beliefs& b, bool staging) {
    return DataParallelDecider::decide(rule->act(observe(b, staging)));
  }
  std::unique_ptr<policy::Policy> rule;
};

monitor::Beliefs measured(const std::vector<double>& per_sample_ms, const std::vector<int>& counts) {
  monitor::Beliefs b;
  b.rank_compute_ms = per_sample_ms;
  b.compute_per_sample = true;
  b.rank_samples.assign(counts.begin(), counts.end());
  return b;
}

DataParallelOptions options4() {
  DataParallelOptions o;
  o.ranks = 4;
  o.global_batch = 256;
  o.cooldown_intervals = 1;
  o.verify_steps = 10;
  o.settle_steps = 2;
  o.warmup_steps = 0;
  return o;
}

// Feeds `n` closed steps of `ms` (with multiplicative noise of +-`noise`) from `first`.
uint64_t feed(DataParallelDecider& d, uint64_t first, int n, double ms, double noise,
              std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-noise, noise);
  for (int i = 0; i < n; ++i) d.observe_step(first + static_cast<uint64_t>(i), ms * (1 + u(rng)));
  return first + static_cast<uint64_t>(n);
}

}  // namespace

TEST_CASE("balanced counts equalise the ranks' steps, sum to the batch, keep a sample each") {
  const std::vector<int> c = balanced_counts({1.0, 1.0, 1.0, 3.0}, {}, 256);
  CHECK(std::accumulate(c.begin(), c.end(), 0) == 256);
  CHECK(c[3] == 25);  // 256 x (1/3) / (3 + 1/3) = 25.6, the largest remainders go to the others
  CHECK(c[0] == 77);
  CHECK(predicted_step_ms({1.0, 1.0, 1.0, 3.0}, {}, c) == doctest::Approx(77));
  CHECK(predicted_step_ms({1.0, 1.0, 1.0, 3.0}, {}, even_counts(4, 256)) == doctest::Approx(192));
  const std::vector<int> tiny = balanced_counts({1.0, 1000.0}, {}, 4);
  CHECK(tiny == std::vector<int>{3, 1});
  CHECK(even_counts(3, 10) == std::vector<int>{4, 3, 3});
  // A fixed per-step cost (a slow optimizer step) cannot be shed by samples: the slow rank keeps
  // what fits beside it. 3T + (T - 80) = 256 gives T = 84.
  const std::vector<double> fixed{0, 0, 0, 80};
  const std::vector<int> f = balanced_counts({1.0, 1.0, 1.0, 1.0}, fixed, 256);
  CHECK(f == std::vector<int>{84, 84, 84, 4});
  CHECK(predicted_step_ms({1.0, 1.0, 1.0, 1.0}, fixed, f) == doctest::Approx(84));
  // ... and when it exceeds any balanced step, the rank keeps one sample.
  const std::vector<int> g = balanced_counts({1.0, 1.0, 1.0, 1.0}, {0, 0, 0, 200}, 256);
  CHECK(g[3] == 1);
  CHECK(std::accumulate(g.begin(), g.end(), 0) == 256);
}

TEST_CASE("a gain must be predicted in two decisions in a row: a passing asymmetry is ignored") {
  DataParallelOptions o = options4();
  RuleDecider d(o, 2);
  std::mt19937 rng(4);
  uint64_t step = 0;
  for (int i = 0; i < 21; ++i) {  // rank 0 looks 2x faster every other decision
    step = feed(d, step, 10, 100, 0.05, rng);
    const double r0 = i % 2 ? 0.5 : 1.0;
    CHECK(d.decide(measured({r0, 1.0, 1.0, 1.0}, d.counts()), false).kind ==
          DataParallelDecision::Kind::keep);
  }
  step = feed(d, step, 10, 100, 0.05, rng);
  DataParallelDecision x = d.decide(measured({1.0, 3.0, 1.0, 1.0}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("the policy keeps the shares") != std::string::npos);
  feed(d, step, 10, 100, 0.05, rng);
  x = d.decide(measured({1.0, 3.0, 1.0, 1.0}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::rebalance);
}

TEST_CASE("a confirmation must take work from the same ranks: an asymmetry that wanders is load") {
  DataParallelOptions o = options4();
  RuleDecider d(o, 2);
  std::mt19937 rng(6);
  uint64_t step = 0;
  // Every decision one rank looks 1.6x slower, a different one each time (another process
  // taking one core, then another): each would predict a gain, none is confirmed.
  for (int i = 0; i < 20; ++i) {
    step = feed(d, step, 10, 100, 0.05, rng);
    std::vector<double> levels(4, 1.0);
    levels[static_cast<size_t>(i % 4)] = 1.6;
    const DataParallelDecision x = d.decide(measured(levels, d.counts()), false);
    INFO(x.reason);
    REQUIRE(x.kind == DataParallelDecision::Kind::keep);
    CHECK(x.reason.find("the policy keeps the shares") != std::string::npos);
    CHECK(x.reason.find("rank " + std::to_string(i % 4) + " computes") != std::string::npos);
  }
  // The same rank twice in a row is confirmed.
  step = feed(d, step, 10, 100, 0.05, rng);
  CHECK(d.decide(measured({1.0, 1.0, 1.6, 1.0}, d.counts()), false).kind ==
        DataParallelDecision::Kind::keep);
  feed(d, step, 10, 100, 0.05, rng);
  const DataParallelDecision x = d.decide(measured({1.0, 1.0, 1.6, 1.0}, d.counts()), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  CHECK(x.counts[2] == *std::min_element(x.counts.begin(), x.counts.end()));
}

TEST_CASE("a difference within the noise the monitor measures moves nothing") {
  // Rank 1 is 1.5x the median, beyond the 20% band; whether that is a slow rank depends on how
  // noisy the levels are.
  auto with_se = [](double se) {
    monitor::Beliefs b = measured({1.0, 1.5, 1.0, 1.0}, even_counts(4, 256));
    b.rank_compute_se_ms.assign(4, se);
    return b;
  };
  std::mt19937 rng(8);
  {
    RuleDecider d(options4());
    feed(d, 0, 10, 100, 0.05, rng);
    // 3 x hypot(0.15, 0.15) = 0.64 ms > 0.5 ms: within the noise.
    const DataParallelDecision x = d.decide(with_se(0.15), false);
    CHECK(x.kind == DataParallelDecision::Kind::keep);
    CHECK(x.reason.find("shares already balanced") != std::string::npos);
  }
  {
    RuleDecider d(options4());
    feed(d, 0, 10, 100, 0.05, rng);
    // 3 x hypot(0.05, 0.05) = 0.21 ms < 0.5 ms: a measured difference.
    const DataParallelDecision x = d.decide(with_se(0.05), false);
    REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
    CHECK(x.counts[1] == *std::min_element(x.counts.begin(), x.counts.end()));
  }
}

TEST_CASE("nothing is proposed before the job's first steps were measured") {
  DataParallelOptions o = options4();
  o.warmup_steps = 10;
  RuleDecider d(o);
  std::mt19937 rng(2);
  uint64_t step = feed(d, 0, 15, 100, 0.05, rng);  // 10 warm-up steps + 5
  DataParallelDecision x = d.decide(measured({1.0, 3.0, 1.0, 1.0}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("measuring the job: 5 of 10") != std::string::npos);
  feed(d, step, 5, 100, 0.05, rng);
  x = d.decide(measured({1.0, 3.0, 1.0, 1.0}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::rebalance);
}

TEST_CASE("noise on healthy ranks moves nothing") {
  // Per-step compute noise of +-20% on every rank, through the monitor's estimator as deploy
  // configures it for a learned job (monitor::RobustEwma, alpha 0.2).
  RuleDecider d(options4());
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(-0.2, 0.2);
  monitor::RobustEwma::Options eo;
  eo.alpha = 0.2;
  std::vector<monitor::RobustEwma> level(4, monitor::RobustEwma(eo));
  uint64_t step = 0;
  for (int interval = 0; interval < 300; ++interval) {
    for (int s = 0; s < 10; ++s) {
      for (monitor::RobustEwma& l : level) l.add(1.0 + u(rng));
    }
    step = feed(d, step, 10, 100, 0.2, rng);
    std::vector<double> levels;
    for (const monitor::RobustEwma& l : level) levels.push_back(l.value());
    const DataParallelDecision x = d.decide(measured(levels, d.counts()), false);
    INFO(x.reason);
    REQUIRE(x.kind == DataParallelDecision::Kind::keep);
  }
  CHECK(d.counts() == even_counts(4, 256));
}

TEST_CASE("a slow rank gets a smaller share when the predicted gain clears the threshold") {
  RuleDecider d(options4());
  std::mt19937 rng(1);
  uint64_t step = feed(d, 0, 10, 190, 0.05, rng);
  DataParallelDecision x = d.decide(measured({1.0, 3.0, 1.0, 1.0}, d.counts()), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  CHECK(x.counts[1] == *std::min_element(x.counts.begin(), x.counts.end()));
  CHECK(x.predicted_now_ms > 2.0 * x.predicted_new_ms);
  CHECK(x.current_step_ms == doctest::Approx(190).epsilon(0.06));
  // In flight: nothing else is proposed.
  CHECK(d.decide(measured({1.0, 3.0, 1.0, 1.0}, d.counts()), true).kind ==
        DataParallelDecision::Kind::keep);
  d.committed(x.counts, step + 1, false);
  // A slowdown of 1.15x is inside the equal band: after the switch, nothing more to do.
  step = feed(d, step + 1, 14, 80, 0.05, rng);
  x = d.decide(measured({1.0, 3.0, 1.0, 1.15}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("held") != std::string::npos);
  for (int i = 0; i < 5; ++i) {
    step = feed(d, step, 10, 80, 0.05, rng);
    x = d.decide(measured({1.0, 3.0, 1.0, 1.15}, d.counts()), false);
    CHECK(x.kind == DataParallelDecision::Kind::keep);
  }
}

TEST_CASE("a switch measured slower beyond noise is reverted, and the cool-down doubles") {
  RuleDecider d(options4());
  std::mt19937 rng(3);
  uint64_t step = feed(d, 0, 10, 100, 0.02, rng);
  const std::vector<int> before = d.counts();
  DataParallelDecision x = d.decide(measured({1.0, 2.0, 1.0, 1.0}, before), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  d.committed(x.counts, step, false);
  // The model was wrong: steps got 30% slower.
  step = feed(d, step, 2, 500, 0, rng);  // settle steps are not judged
  step = feed(d, step, 10, 130, 0.02, rng);
  x = d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::revert);
  CHECK(x.counts == before);
  CHECK(d.cooldown_intervals() == 2);
  d.committed(x.counts, step, true);
  CHECK(d.counts() == before);
  // During the longer cool-down nothing is proposed...
  for (int i = 0; i < 2; ++i) {
    step = feed(d, step, 10, 100, 0.02, rng);
    const DataParallelDecision kept = d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
    CHECK(kept.kind == DataParallelDecision::Kind::keep);
    CHECK(kept.reason.find("cool-down") != std::string::npos);
  }
  // ...and after it the same beliefs propose the rebalance again.
  feed(d, step, 10, 100, 0.02, rng);
  CHECK(d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false).kind ==
        DataParallelDecision::Kind::rebalance);
}

TEST_CASE("the guardrail binds any policy: no candidates in the cool-down, a slower switch reverted") {
  // A policy that always asks for the first candidate.
  DataParallelDecider d(options4());
  std::mt19937 rng(3);
  uint64_t step = feed(d, 0, 10, 100, 0.02, rng);
  const std::vector<int> before = d.counts();
  env::Observation o = d.observe(measured({1.0, 2.0, 1.0, 1.0}, before), false);
  REQUIRE(o.mask[0] == 1);
  // The candidates carry the model's gain (balanced: 3T + T/2 = 256 samples, T = 73.1 ms
  // against 128, rounded to whole samples) and a share change's cost: one step of the ten in a
  // decision interval.
  CHECK(std::exp(feature(o, 0, env::CandidateFeature::kLogGain)) == doctest::Approx(128.0 / 74).epsilon(0.01));
  CHECK(feature(o, 0, env::CandidateFeature::kSwitchCost) == doctest::Approx(0.1).epsilon(0.05));
  CHECK(feature(o, 0, env::CandidateFeature::kElastic) == 1.0f);
  CHECK(feature(o, env::StateFeature::kMinSpeed) == doctest::Approx(0.5));
  DataParallelDecision x = d.decide(1);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  d.committed(x.counts, step, false);
  step = feed(d, step, 2, 500, 0, rng);
  // While the switch is measured the policy is offered nothing: its action changes nothing.
  o = d.observe(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
  CHECK(o.mask[0] == 0);
  x = d.decide(1);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("measuring the last switch") != std::string::npos);
  // The model was wrong: steps got 30% slower. The revert stands whatever the policy asks.
  step = feed(d, step, 10, 130, 0.02, rng);
  o = d.observe(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
  CHECK(o.mask[0] == 0);
  x = d.decide(1);
  REQUIRE(x.kind == DataParallelDecision::Kind::revert);
  CHECK(x.counts == before);
  d.committed(x.counts, step, true);
  feed(d, step, 10, 100, 0.02, rng);
  o = d.observe(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
  CHECK(o.mask[0] == 0);
  x = d.decide(1);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("cool-down") != std::string::npos);
}

TEST_CASE("a switch within the noise of its before-measurement is kept") {
  RuleDecider d(options4());
  std::mt19937 rng(5);
  uint64_t step = feed(d, 0, 10, 100, 0.2, rng);
  DataParallelDecision x = d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  d.committed(x.counts, step, false);
  step = feed(d, step, 2, 100, 0, rng);
  feed(d, step, 10, 104, 0.2, rng);  // +4%, inside the revert margin and the noise
  x = d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("held") != std::string::npos);
}

TEST_CASE("a 17% regression is reverted on a job whose steps vary by a few percent, or by 30%") {
  // Steps alternate between (1 - v) and (1 + v) times their level: the median is the level, the
  // spread +-v. At v = 0.3 three standard errors of the two medians come to about 60%: only the
  // cap on the noise bound (max_revert_bound) catches a 17% regression there.
  for (const double v : {0.03, 0.3}) {
    CAPTURE(v);
    RuleDecider d(options4());
    auto alternate = [&](uint64_t first, double ms) {
      for (uint64_t i = 0; i < 10; ++i) d.observe_step(first + i, ms * (i % 2 ? 1 + v : 1 - v));
      return first + 10;
    };
    uint64_t step = alternate(0, 100);
    DataParallelDecision x = d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
    REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
    d.committed(x.counts, step, false);
    step = alternate(step, 100);  // the settle steps and the first of the judged ones
    alternate(step, 117);
    x = d.decide(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), false);
    CHECK(x.kind == DataParallelDecision::Kind::revert);
  }
}

namespace {
// Proposes and commits a rebalance for `per_sample_ms` (after the cool-down), then feeds the
// settle steps and ten judged steps at `after_ms`, and returns the judgement.
DataParallelDecision switch_and_judge(RuleDecider& d, uint64_t& step,
                                      const std::vector<double>& per_sample_ms, double before_ms,
                                      double after_ms, std::mt19937& rng) {
  DataParallelDecision x;
  for (int i = 0; i < 8; ++i) {  // through the cool-down, at the current shares' step time
    step = feed(d, step, 10, before_ms, 0.005, rng);
    x = d.decide(measured(per_sample_ms, d.counts()), false);
    if (x.kind != DataParallelDecision::Kind::keep) break;
  }
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  d.committed(x.counts, step, false);
  step = feed(d, step, 2, after_ms, 0, rng);
  step = feed(d, step, 10, after_ms, 0.005, rng);
  return d.decide(measured(per_sample_ms, d.counts()), false);
}

// Two switches that each hold: 100 -> 98 ms (the fastest shares, returned), then 98 -> 102 ms
// (+4%, within the 5% margin of the shares just left).
std::vector<int> two_held_switches(RuleDecider& d, uint64_t& step, std::mt19937& rng) {
  DataParallelDecision x = switch_and_judge(d, step, {1.0, 2.0, 1.0, 1.0}, 100, 98, rng);
  REQUIRE(x.kind == DataParallelDecision::Kind::keep);
  const std::vector<int> fastest = d.counts();
  x = switch_and_judge(d, step, {1.0, 3.0, 1.0, 1.0}, 98, 102, rng);
  REQUIRE(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("held") != std::string::npos);
  return fastest;
}
}  // namespace

TEST_CASE("switches each within noise of the one before cannot add up to a slower job") {
  // Each switch is judged against the shares just left (within the 5% margin: held) and
  // against the fastest shares measured: the third, 8% slower than the first's 98 ms, goes back
  // to the first's shares, not to the second's.
  RuleDecider d(options4());
  std::mt19937 rng(21);
  uint64_t step = 0;
  const std::vector<int> fastest = two_held_switches(d, step, rng);
  const DataParallelDecision x = switch_and_judge(d, step, {1.0, 4.0, 1.0, 1.0}, 102, 106, rng);  // +4% again, +8% on 98
  REQUIRE(x.kind == DataParallelDecision::Kind::revert);
  CHECK(x.counts == fastest);
  CHECK(x.reason.find("fastest shares") != std::string::npos);
}

TEST_CASE("the fastest shares are forgotten when the job gets slower without a switch") {
  // After the job itself slows (150 ms on the shares in force, no switch), a switch to 140 ms
  // is a gain: it holds, although the shares that once ran at 98 ms were faster then.
  RuleDecider d(options4());
  std::mt19937 rng(22);
  uint64_t step = 0;
  two_held_switches(d, step, rng);
  const DataParallelDecision x = switch_and_judge(d, step, {1.0, 4.0, 1.0, 1.0}, 150, 140, rng);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("held") != std::string::npos);
}

namespace {
monitor::Beliefs with_waits(monitor::Beliefs b, const std::vector<double>& wait_ms) {
  b.rank_wait_ms = wait_ms;
  return b;
}
}  // namespace

TEST_CASE("arrival order must confirm the model's slowest rank before work moves") {
  RuleDecider d(options4());
  std::mt19937 rng(12);
  feed(d, 0, 10, 100, 0.02, rng);
  // Rank 1 looks slow by its compute (a wait it could not measure was charged to it), but rank
  // 3 is the one every collective waits for: nothing moves.
  DataParallelDecision x =
      d.decide(with_waits(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), {40, 30, 40, 1}), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("not confirmed by arrival order") != std::string::npos);
  CHECK(x.reason.find("rank 3 arrives last") != std::string::npos);
  // The same compute with rank 1 arriving last moves work off it.
  x = d.decide(with_waits(measured({1.0, 2.0, 1.0, 1.0}, d.counts()), {40, 1, 40, 38}), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  CHECK(x.counts[1] < 64);
  // Without measured waits (-1), compute alone decides, as before.
  RuleDecider e(options4());
  feed(e, 0, 10, 100, 0.02, rng);
  x = e.decide(with_waits(measured({1.0, 2.0, 1.0, 1.0}, e.counts()), {40, -1, 40, 1}), false);
  CHECK(x.kind == DataParallelDecision::Kind::rebalance);
}

TEST_CASE("no work moves onto the rank that arrives last") {
  RuleDecider d(options4());
  std::mt19937 rng(13);
  feed(d, 0, 10, 100, 0.02, rng);
  // Rank 3 computes as fast as the others by its own account and has few samples, so the model
  // would even the shares out; but it arrives last at the collectives with rank 0 (one of the
  // ranks holding the step up): more work for it is refused.
  const std::vector<int> counts{80, 80, 80, 16};
  monitor::Beliefs b = with_waits(measured({1.0, 1.0, 1.0, 1.0}, counts), {1, 30, 30, 1});
  DataParallelDecision x = d.decide(b, false);
  REQUIRE(d.counts() == counts);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("would move work onto rank 3") != std::string::npos);
}

TEST_CASE("a slow optimizer step behind another synchronisation point moves no work") {
  // Rank 2's optimizer step takes 80 ms. With the gradient reduction the step's only
  // synchronisation, that adds to rank 2's per-sample work: shares shorten the step...
  monitor::Beliefs b = measured({1.0, 1.0, 1.0, 1.0}, even_counts(4, 256));
  b.rank_fixed_ms = {1, 1, 80, 1};
  std::mt19937 rng(14);
  RuleDecider d(options4());
  feed(d, 0, 10, 150, 0.02, rng);
  DataParallelDecision x = d.decide(b, false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  CHECK(x.counts[2] < 64);
  // ...but behind another synchronisation (a buffer broadcast at every forward) the others wait
  // for it there whatever their shares: moving work would only lengthen the per-sample part.
  b.fixed_apart = true;
  RuleDecider e(options4());
  feed(e, 0, 10, 150, 0.02, rng);
  x = e.decide(b, false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("already balanced") != std::string::npos);
  CHECK(predicted_step_ms({1, 1, 1, 1}, {0, 0, 80, 0}, even_counts(4, 256), true) ==
        doctest::Approx(144));
  CHECK(predicted_step_ms({1, 1, 1, 1}, {0, 0, 80, 0}, even_counts(4, 256), false) ==
        doctest::Approx(144));
  CHECK(predicted_step_ms({1, 1, 1, 1}, {0, 0, 80, 0}, {70, 70, 46, 70}, true) ==
        doctest::Approx(150));
  CHECK(predicted_step_ms({1, 1, 1, 1}, {0, 0, 80, 0}, {70, 70, 46, 70}, false) ==
        doctest::Approx(126));
}

TEST_CASE("a rank with no measurement blocks any switch") {
  RuleDecider d(options4());
  std::mt19937 rng(9);
  feed(d, 0, 10, 100, 0.02, rng);
  const DataParallelDecision x = d.decide(measured({1.0, 3.0, 0.0, 1.0}, d.counts()), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("rank(s) 2") != std::string::npos);
}

TEST_CASE(
    "a switch a job announced it cannot make is named, one that changes nothing it acts on "
    "too") {
  const uint32_t ddp = transport::kCapDpShares | transport::kCapCompression;
  Strategy from;
  from.dp = 8;
  from.global_batch = 64;
  Strategy to = from;
  to.tp = 2;
  to.dp = 4;
  CHECK(unsupported_switch(from, to, ddp) ==
        Status::rejected("the job cannot switch tensor parallel"));
  CHECK(unsupported_switch(from, to, ddp | transport::kCapTensor).ok());
  to = from;
  to.pp = 2;
  to.dp = 4;
  CHECK(unsupported_switch(from, to, ddp) ==
        Status::rejected("the job cannot switch pipeline parallel"));
  // Back out of pipeline or tensor parallelism, or a stage move, needs the same capability.
  CHECK(unsupported_switch(to, from, ddp) ==
        Status::rejected("the job cannot switch pipeline parallel"));
  Strategy moved = to;
  moved.stage_layers = {1, 3};
  CHECK(unsupported_switch(to, moved, ddp) ==
        Status::rejected("the job cannot switch pipeline parallel"));
  CHECK(unsupported_switch(to, moved, ddp | transport::kCapPipeline).ok());
  Strategy tensor = from;
  tensor.tp = 2;
  tensor.dp = 4;
  CHECK(unsupported_switch(tensor, from, ddp) ==
        Status::rejected("the job cannot switch tensor parallel"));
  to = from;
  to.zero = 2;
  to.microbatch_size = 2;
  to.recompute = Recompute::kSelective;
  CHECK(unsupported_switch(from, to, ddp) ==
        Status::rejected("the switch changes only settings the job ignores"));
  CHECK(unsupported_switch(from, to, ddp | transport::kCapMicroBatches).ok());
  to = from;
  to.gpus = {1, 0, 2, 3, 4, 5, 6, 7};  // a device map alone means nothing to DDP
  CHECK(unsupported_switch(from, to, ddp) ==
        Status::rejected("the switch changes only settings the job ignores"));
  to.dp_shares = {1, 15, 8, 8, 8, 8, 8, 8};
  CHECK(unsupported_switch(from, to, ddp).ok());
  CHECK(unsupported_switch(from, to, transport::kCapCompression) ==
        Status::rejected("the job cannot switch batch shares"));
}

namespace {

struct Rank {
  std::unique_ptr<transport::Client> client;
  std::mutex mutex;
  std::vector<transport::Message> received;
};

std::unique_ptr<Rank> connect_rank(uint16_t port, uint32_t rank) {
  auto r = std::make_unique<Rank>();
  transport::ClientOptions o;
  o.server_address = "127.0.0.1";
  o.port = port;
  o.secret = transport::Secret("dp-decider-test-secret-0123456789");
  o.name = "worker-" + std::to_string(rank);
  o.rank = rank;
  transport::ClientHandlers h;
  Rank* raw = r.get();
  h.on_message = [raw](transport::Message&& m) {
    std::lock_guard lock(raw->mutex);
    raw->received.push_back(std::move(m));
  };
  auto c = transport::make_tcp_client(std::move(o), std::move(h));
  REQUIRE(c);
  r->client = std::move(*c);
  return r;
}

template <class F>
bool eventually(F f) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!f()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

}  // namespace

TEST_CASE("deploy learns a job from JobInfo, and tells a rank of another job why no plan comes") {
  AgentOptions o;
  o.secret = transport::Secret("dp-decider-test-secret-0123456789");
  std::mutex log_mutex;
  std::vector<std::string> log;
  o.log = [&](const std::string& line) {
    std::lock_guard lock(log_mutex);
    log.push_back(line);
  };
  const auto started = ok(DeployAgent::start(o));
  DeployAgent& agent = *started;
  CHECK(agent.monitor() == nullptr);  // nothing known before the first announcement
  auto r0 = connect_rank(agent.port(), 0);
  auto r1 = connect_rank(agent.port(), 1);
  REQUIRE(eventually([&] { return agent.stats().connected_ranks == 2; }));
  transport::JobInfo info{0, 2, 64, transport::kCapDpShares, "test", {{10, 40}}};
  r0->client->send(info);
  REQUIRE(eventually([&] { return agent.monitor() != nullptr; }));
  info.rank = 1;
  info.world_size = 4;  // rank 1 believes in another job
  r1->client->send(info);
  REQUIRE(eventually([&] {
    std::lock_guard lock(r1->mutex);
    return !r1->received.empty();
  }));
  std::lock_guard lock(r1->mutex);
  const auto* notice = std::get_if<transport::PlanAbort>(&r1->received.front());
  REQUIRE(notice != nullptr);
  CHECK(notice->plan_id == 0);
  CHECK(notice->reason.find("no plans will be sent") != std::string::npos);
  std::lock_guard log_lock(log_mutex);
  bool learned = false, mismatch = false;
  for (const std::string& l : log) {
    learned = learned || l.find("\"job_learned\"") != std::string::npos;
    mismatch = mismatch || l.find("\"job_mismatch\"") != std::string::npos;
  }
  CHECK(learned);
  CHECK(mismatch);
}

namespace {

// Balanced ranks computing `compute_ms` a step on 64 samples each, and the gradient
// all-reduce's link as the monitor reads it: its exposed wait for `bytes` a step, slow or not.
monitor::Beliefs with_link(double compute_ms, bool slow, double wait_ms, double bytes) {
  monitor::Beliefs b = measured(std::vector<double>(4, compute_ms / 64), even_counts(4, 256));
  b.slow_link = slow;
  b.dp_link_ms = wait_ms;
  b.dp_bytes = bytes;
  return b;
}

DataParallelOptions compressing() {
  DataParallelOptions o = options4();
  o.compression = "fp16";
  return o;
}

}  // namespace

TEST_CASE("a slow link gets fp16 proposed, predicted from the measured wait and the bytes") {
  RuleDecider d(compressing());
  std::mt19937 rng(7);
  uint64_t step = feed(d, 0, 10, 72, 0.02, rng);
  DataParallelDecision x = d.decide(with_link(2, true, 70, 1.1e6), false);
  INFO(x.reason);
  REQUIRE(x.kind == DataParallelDecision::Kind::compress);
  CHECK(x.compression.kind == Compression::Kind::kFP16);
  CHECK(x.counts == even_counts(4, 256));  // the shares stay
  CHECK(x.predicted_now_ms == doctest::Approx(72));
  CHECK(x.predicted_new_ms == doctest::Approx(2 + 35));  // compute + half the wait, no cost yet
  d.committed(x.counts, step + 1, false, x.compression);
  CHECK(d.compression().kind == Compression::Kind::kFP16);
  step = feed(d, step + 1, 12, 38, 0.02, rng);
  // Held: fp16 stays while the link is slow ("no compression" predicts 2 + 70 > 3 + 35).
  x = d.decide(with_link(3, true, 35, 0.55e6), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("held") != std::string::npos);
  for (int i = 0; i < 3; ++i) {
    step = feed(d, step, 10, 38, 0.02, rng);
    x = d.decide(with_link(3, true, 35, 0.55e6), false);
    INFO(x.reason);
    CHECK(x.kind == DataParallelDecision::Kind::keep);
  }
  // The link recovered: the wait no longer pays for the method's measured cost (1 ms): without
  // compression 2 + 2 x 0.5 = 3 ms against 3 + 0.5 now.
  step = feed(d, step, 10, 3.5, 0.02, rng);
  step = feed(d, step, 10, 3.5, 0.02, rng);
  x = d.decide(with_link(3, false, 0.5, 0.55e6), false);
  INFO(x.reason);
  REQUIRE(x.kind == DataParallelDecision::Kind::compress);
  CHECK(x.compression == Compression{});
  CHECK(x.predicted_now_ms == doctest::Approx(3.5));
  CHECK(x.predicted_new_ms == doctest::Approx(3.0));
  d.committed(x.counts, step, false, x.compression);
  CHECK(d.compression() == Compression{});
}

TEST_CASE("no compression is proposed without the option, or while the link is not slow") {
  std::mt19937 rng(8);
  RuleDecider plain(options4());
  feed(plain, 0, 10, 72, 0.02, rng);
  DataParallelDecision x = plain.decide(with_link(2, true, 70, 1.1e6), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("already balanced") != std::string::npos);
  CHECK(x.predicted_now_ms == doctest::Approx(2));  // the split model's figure alone
  RuleDecider fast(compressing());
  feed(fast, 0, 10, 9, 0.02, rng);
  x = fast.decide(with_link(2, false, 7, 1.1e6), false);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.predicted_now_ms == doctest::Approx(2));
}

TEST_CASE("fp16 measured slower than before is reverted to no compression") {
  RuleDecider d(compressing());
  std::mt19937 rng(9);
  uint64_t step = feed(d, 0, 10, 72, 0.02, rng);
  DataParallelDecision x = d.decide(with_link(2, true, 70, 1.1e6), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::compress);
  d.committed(x.counts, step, false, x.compression);
  step = feed(d, step, 2, 500, 0, rng);
  step = feed(d, step, 10, 90, 0.02, rng);  // the method cost more than the wait it saved
  x = d.decide(with_link(20, true, 70, 0.55e6), false);
  REQUIRE(x.kind == DataParallelDecision::Kind::revert);
  CHECK(x.compression == Compression{});
  d.committed(x.counts, step, true, x.compression);
  CHECK(d.compression() == Compression{});
}

TEST_CASE("a switch measured while the link slowed is not charged with the link's slowdown") {
  RuleDecider d(compressing());
  std::mt19937 rng(10);
  uint64_t step = feed(d, 0, 10, 10, 0.02, rng);
  monitor::Beliefs b = with_link(2, false, 7, 1.1e6);
  b.rank_compute_ms = {2.0 / 64, 4.0 / 64, 2.0 / 64, 2.0 / 64};  // rank 1 twice as slow
  DataParallelDecision x = d.decide(b, false);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  d.committed(x.counts, step, false, x.compression);
  // The link slows while the switch is measured: every step 7x longer.
  step = feed(d, step, 12, 72, 0.02, rng);
  x = d.decide(with_link(2, true, 70, 1.1e6), false);
  INFO(x.reason);
  CHECK(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("not judged") != std::string::npos);
  CHECK(d.cooldown_intervals() == 1);  // no back-off either
  // The next decision answers the link.
  step = feed(d, step, 10, 72, 0.02, rng);
  x = d.decide(with_link(2, true, 70, 1.1e6), false);
  INFO(x.reason);
  CHECK(x.kind == DataParallelDecision::Kind::compress);
}

TEST_CASE("a method whose casts fill the wait: the way back is tried once the wait falls, and "
          "the method is not proposed again while its own wait exceeds what it saves") {
  RuleDecider d(compressing());
  std::mt19937 rng(12);
  uint64_t step = feed(d, 0, 10, 72, 0.02, rng);
  monitor::Beliefs slow = with_link(2, true, 70, 1.1e6);
  slow.dp_reference = 1.1e6 / 3 / 1e3;  // the normal link: 3 ms for the uncompressed bytes
  slow.dp_noise_ms = 4;
  DataParallelDecision x = d.decide(slow, false);
  REQUIRE(x.kind == DataParallelDecision::Kind::compress);
  d.committed(x.counts, step, false, x.compression);
  monitor::Beliefs fp16 = slow;
  fp16.dp_link_ms = 35;
  fp16.dp_bytes = 0.55e6;
  step = feed(d, step, 12, 37, 0.02, rng);
  REQUIRE(d.decide(fp16, false).kind == DataParallelDecision::Kind::keep);  // held at 35 ms
  // The link recovers, but the method's casts keep the compressed wait at 12 ms: the bytes
  // alone would predict 24 ms without it; the wait fell beyond noise, so the normal link's 3 ms
  // is what the way back is predicted at.
  fp16.dp_link_ms = 12;
  for (int i = 0; i < 2; ++i) step = feed(d, step, 10, 14, 0.02, rng);
  x = d.decide(fp16, false);
  INFO(x.reason);
  REQUIRE(x.kind == DataParallelDecision::Kind::compress);
  CHECK(x.compression == Compression{});
  CHECK(x.predicted_new_ms == doctest::Approx(2 + 3));
  d.committed(x.counts, step, false, x.compression);
  // It held: uncompressed, the wait is 3 ms; fp16 added 12 - 1.5 = 10.5 ms of wait itself.
  monitor::Beliefs back = slow;
  back.dp_link_ms = 3;
  step = feed(d, step, 12, 5, 0.02, rng);
  x = d.decide(back, false);
  INFO(x.reason);
  REQUIRE(x.kind == DataParallelDecision::Kind::keep);
  CHECK(x.reason.find("held") != std::string::npos);
  // The monitor still believes the link slow (its reference is stale): fp16 is not proposed,
  // its own wait (10.5 ms) exceeding what it would save.
  for (int i = 0; i < 4; ++i) {
    step = feed(d, step, 10, 5, 0.02, rng);
    x = d.decide(back, false);
    INFO(x.reason);
    CHECK(x.kind == DataParallelDecision::Kind::keep);
  }
  // The link slows again: half of 70 ms beats the method's 10.5 ms.
  step = feed(d, step, 10, 72, 0.02, rng);
  step = feed(d, step, 10, 72, 0.02, rng);
  x = d.decide(slow, false);
  INFO(x.reason);
  CHECK(x.kind == DataParallelDecision::Kind::compress);
  CHECK(x.compression.kind == Compression::Kind::kFP16);
  CHECK(x.predicted_new_ms == doctest::Approx(2 + 35));
}
