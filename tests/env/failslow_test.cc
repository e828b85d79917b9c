// The failslow family: seed-determinism, the scenario's switch pause, slowdowns that end on their
// own (some flapping), and the switch-cost scaling with the model.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

#include "env/env.h"
#include "env/sim/scenario.h"
#include "env/sim/sim_env.h"
#include "tests/test_util.h"

using parapilot::testing::failure_of;
using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::env;

namespace {

// Per place (GPU speeds, then node bandwidths), the slowdown factor of each interval (1: nominal).
std::vector<std::vector<double>> slowdowns(const Truth& truth, int gpus, int nodes) {
  std::vector<std::vector<double>> out(static_cast<size_t>(gpus + nodes));
  for (const Conditions& c : truth.conditions) {
    for (int g = 0; g < gpus; ++g) out[g].push_back(1.0 / c.speed(g));
    for (int n = 0; n < nodes; ++n) out[gpus + n].push_back(1.0 / c.inter(n));
  }
  return out;
}

}  // namespace

TEST_CASE("failslow: a pure function of the seed, and seeds differ") {
  const Scenario s = builtin_scenario(Family::kFailSlow, 64);
  CHECK(s.family == Family::kFailSlow);
  const Truth a = generate_truth(s, 11);
  const Truth b = generate_truth(s, 11);
  REQUIRE(!a.events.empty());
  CHECK(a.events == b.events);
  const int gpus = s.cluster.num_gpus(), nodes = s.cluster.num_nodes();
  CHECK(slowdowns(a, gpus, nodes) == slowdowns(b, gpus, nodes));
  CHECK(a.events != generate_truth(s, 12).events);

  // The env too: the same seed and actions give the same rewards.
  auto run = [](uint64_t seed) {
    auto env = ok(make_env("sim:failslow(gpus=16,horizon=30)"));
    ok(env->reset(seed));
    std::vector<double> rewards;
    for (int t = 0; t < env->horizon(); ++t) {
      rewards.push_back(env->step(t % 4 == 0 ? 1 : 0).reward);
    }
    return rewards;
  };
  CHECK(run(5) == run(5));
  CHECK(run(5) != run(6));
}

TEST_CASE("failslow: slowdowns start and end on their own, some flapping") {
  const Scenario s = builtin_scenario(Family::kFailSlow, 64);
  const int gpus = s.cluster.num_gpus(), nodes = s.cluster.num_nodes();
  int episodes_with_events = 0, recovered = 0, flapped = 0, compute = 0, communication = 0;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const Truth truth = generate_truth(s, seed);
    episodes_with_events += !truth.events.empty();
    const auto per_place = slowdowns(truth, gpus, nodes);
    for (size_t p = 0; p < per_place.size(); ++p) {
      // Runs of slowed intervals: one that ends before the horizon recovered on its own; a
      // place slowed, then nominal, then slowed again flapped (or had two events).
      int runs = 0;
      bool slow = false;
      for (size_t t = 0; t < per_place[p].size(); ++t) {
        const bool now = per_place[p][t] > 1.0;
        if (now && !slow) ++runs;
        if (!now && slow) ++recovered;
        slow = now;
      }
      if (runs > 0) ++(p < static_cast<size_t>(gpus) ? compute : communication);
      flapped += runs >= 2;
    }
  }
  CHECK(episodes_with_events >= 18);
  CHECK(recovered >= 20);
  CHECK(flapped >= 3);
  CHECK(compute > 0);
  CHECK(communication > compute);  // communication fail-slows are the common kind
  // Nothing slows at all when the rates are 0 (every other family's setting).
  Scenario off = s;
  off.failslow.communication.rate = off.failslow.compute.rate = 0;
  CHECK(generate_truth(off, 3).events.empty());
}

TEST_CASE("failslow: durations are lognormal around the published means, capped at 10 h") {
  const FailSlowDynamics d;
  std::mt19937_64 rng(3);
  double sum = 0, shortest = 1e9, longest = 0;
  int under_a_minute = 0, flapping = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const FailSlowDraw x = draw_failslow(d.communication, d.flap_fraction, rng);
    CHECK(x.factor >= d.communication.factor_min);
    CHECK(x.factor <= d.communication.factor_max);
    sum += x.duration_s;
    shortest = std::min(shortest, x.duration_s);
    longest = std::max(longest, x.duration_s);
    under_a_minute += x.duration_s < 60;
    flapping += x.flapping;
  }
  CHECK(sum / n == doctest::Approx(24 * 60).epsilon(0.1));
  CHECK(shortest < 60);
  CHECK(under_a_minute > n / 100);
  CHECK(longest <= kMaxPersistentSlowdownS);
  CHECK(longest > 5 * 3600);
  CHECK(flapping == doctest::Approx(0.3 * n).epsilon(0.05));
}

TEST_CASE("failslow: the switch pause comes from the scenario, longer than an interval too") {
  // A nominal cluster throughout: a switch loses exactly its pause (times the new layout's
  // rate) against the same switch with another pause; a 20 s pause outlasts the 18 s interval
  // and stops the next one for the rest.
  Scenario s = builtin_scenario(Family::kFailSlow, 64);
  s.horizon = 4;
  REQUIRE(s.interval_s < 20);
  Truth nominal = generate_truth(s, 1);
  for (Conditions& c : nominal.conditions) c = Conditions{};
  nominal.events.clear();
  struct Run {
    std::vector<double> tokens;
    double migration_s = 0;
    bool committed = false;
  };
  auto run = [&](double pause_s) {
    Scenario p = s;
    p.switch_pause_s = pause_s;
    SimEnv env(p, "failslow-pause", nominal, true);
    ok(env.reset(4));
    Run out;
    REQUIRE(env.planning_view() != nullptr);
    REQUIRE(!env.planning_view()->candidates().empty());
    out.migration_s = env.planning_view()->candidates().front().migration_s;
    for (int t = 0; t < s.horizon; ++t) {
      const StepResult r = env.step(t == 0 ? 1 : 0);
      if (t == 0) out.committed = r.info.migration_committed;
      out.tokens.push_back(r.info.tokens);
    }
    return out;
  };
  const Run fast = run(0.05), slow = run(20);
  REQUIRE(fast.committed);
  REQUIRE(slow.committed);
  // The planner's estimate carries the pause ...
  CHECK(slow.migration_s - fast.migration_s == doctest::Approx(20 - 0.05));
  // ... and the simulator charges it: the same staging, then 0.05 s or 20 s of no training,
  // the 20 s running into the next interval (which the 0.05 s pause leaves whole).
  const double rate = fast.tokens[2] / s.interval_s;
  CHECK(rate > 0);
  CHECK(fast.tokens[1] == doctest::Approx(fast.tokens[2]));
  CHECK(slow.tokens[1] < fast.tokens[1]);
  CHECK(slow.tokens[2] == doctest::Approx(fast.tokens[2]));
  CHECK((fast.tokens[0] + fast.tokens[1]) - (slow.tokens[0] + slow.tokens[1]) ==
        doctest::Approx(rate * (20 - 0.05)));
  // The observation's payback charges the scenario's pause too: the two differ.
  Scenario p = s;
  p.switch_pause_s = 20;
  SimEnv a(s, "a", nominal, true), b(p, "b", nominal, true);
  CHECK(ok(a.reset(4)).candidates != ok(b.reset(4)).candidates);
}

TEST_CASE("stage_switch and run_pause: a pause longer than the interval goes on into the next") {
  double staging_left = 5, pause_left = 0;
  const StagedInterval first = stage_switch(staging_left, 18, 20);
  CHECK(first.staged_s == 5);
  CHECK(first.committed);
  CHECK(first.rest_s == 0);
  CHECK(first.pause_left_s == 7);
  pause_left = first.pause_left_s;
  CHECK(run_pause(pause_left, 18) == 11);
  CHECK(pause_left == 0);
  staging_left = 5;
  const StagedInterval fits = stage_switch(staging_left, 18, 2);
  CHECK(fits.rest_s == 11);
  CHECK(fits.pause_left_s == 0);
}

TEST_CASE("failslow: switch costs scale with the model, from tens of ms to seconds") {
  Scenario small = builtin_scenario(Family::kFailSlow, 8);
  small.model = *model_preset("gpt3-125m");
  const FailSlowTiming tiny = ok(failslow_timing(small));
  CHECK(tiny.switch_pause_s > kLivePauseFixedS);
  CHECK(tiny.switch_pause_s < 0.1);

  const Scenario seven = builtin_scenario(Family::kFailSlow, 64);
  const FailSlowTiming t7 = ok(failslow_timing(seven));
  CHECK(seven.switch_pause_s == t7.switch_pause_s);
  CHECK(seven.interval_s == doctest::Approx(kFailSlowStepsPerInterval * t7.step_s));
  CHECK(seven.interval_s >= 10);
  CHECK(seven.interval_s <= 60);

  Scenario seventy = builtin_scenario(Family::kFailSlow, 512);
  seventy.model = *model_preset("llama2-70b");
  const FailSlowTiming t70 = ok(failslow_timing(seventy));
  CHECK(t70.switch_pause_s > 1);
  CHECK(t70.switch_pause_s < 10);
  CHECK(t70.switch_pause_s > 10 * tiny.switch_pause_s);
  MESSAGE("pause: gpt3-125m/8 " << tiny.switch_pause_s << " s, llama2-7b/64 " << t7.switch_pause_s
                                << " s (interval " << seven.interval_s << " s), llama2-70b/512 "
                                << t70.switch_pause_s << " s (step " << t70.step_s << " s)");
}

TEST_CASE("failslow: scenario files set switch_pause_s and refit to their model") {
  const std::string path = "/tmp/parapilot-failslow-test-" + std::to_string(::getpid()) + ".toml";
  auto load = [&](const std::string& text) {
    std::ofstream(path) << text;
    return load_scenario(path);
  };
  CHECK(ok(load("[scenario]\nfamily = \"straggler\"\n")).switch_pause_s == kSwitchPauseS);
  CHECK(ok(load("[scenario]\nfamily = \"straggler\"\nswitch_pause_s = 0.05\n")).switch_pause_s ==
        0.05);
  CHECK(failure_of(load("[scenario]\nfamily = \"straggler\"\nswitch_pause_s = -1\n"))
            .find("switch_pause_s") != std::string::npos);
  CHECK(failure_of(load("[scenario]\nfamily = \"failslow\"\nswitch_pause_s = \"fast\"\n"))
            .find("switch_pause_s") != std::string::npos);
  // A failslow file on another model is timed for that model, unless it says otherwise.
  const Scenario builtin = builtin_scenario(Family::kFailSlow, 64);
  const Scenario bigger = ok(load("[scenario]\nfamily = \"failslow\"\nmodel = \"llama2-70b\"\n"));
  CHECK(bigger.interval_s > builtin.interval_s);
  CHECK(bigger.switch_pause_s != builtin.switch_pause_s);
  const Scenario fixed =
      ok(load("[scenario]\nfamily = \"failslow\"\nmodel = \"llama2-70b\"\n"
              "interval_s = 30\nswitch_pause_s = 3\n"));
  CHECK(fixed.interval_s == 30);
  CHECK(fixed.switch_pause_s == 3);
  // A [space] of tp = 2, pp = 2 alone is timed for its own best layout; steps_per_interval stays.
  const Scenario dp_only =
      ok(load("[scenario]\nfamily = \"failslow\"\n[scenario.telemetry]\n"
              "steps_per_interval = 3\n[space]\ntp = [2]\npp = [2]\n"));
  CHECK(dp_only.interval_s != builtin.interval_s);
  CHECK(dp_only.switch_pause_s != builtin.switch_pause_s);
  CHECK(dp_only.telemetry.steps_per_interval == 3);
  const Scenario tuned =
      ok(load("[scenario]\nfamily = \"failslow\"\n[scenario.failslow]\n"
              "comm_rate_per_node_hour = 1\nflap_fraction = 0\n"));
  CHECK(tuned.failslow.communication.rate == 1);
  CHECK(tuned.failslow.flap_fraction == 0);
  CHECK(failure_of(load("[scenario]\nfamily = \"failslow\"\n[scenario.failslow]\n"
                        "flap_intervals_min = 4\nflap_intervals_max = 2\n"))
            .find("flap_intervals_max") != std::string::npos);
  std::remove(path.c_str());
}
