// The training distribution (env/sim/distribution.h): draws are a function of the seed, span
// the ranges docs/scenarios.md states, and every reset of sim:random runs a scenario that fits.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>

#include "env/env.h"
#include "env/registry.h"
#include "env/sim/distribution.h"
#include "env/sim/planning_view.h"
#include "tests/test_util.h"

using namespace parapilot;
using namespace parapilot::env;
using parapilot::testing::ok;

TEST_CASE("distribution: a draw is a function of its seed") {
  const ScenarioRanges r;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    const Scenario a = draw_scenario(r, seed), b = draw_scenario(r, seed);
    CHECK(a.cluster.name == b.cluster.name);
    CHECK(a.model.name == b.model.name);
    CHECK(a.straggler.rate_per_gpu_hour == b.straggler.rate_per_gpu_hour);
    CHECK(a.congestion.duration_median_s == b.congestion.duration_median_s);
    CHECK(a.telemetry.noise == b.telemetry.noise);
  }
  // Different seeds draw different scenarios.
  std::set<std::string> clusters;
  for (uint64_t seed = 1; seed <= 20; ++seed) clusters.insert(draw_scenario(r, seed).cluster.name);
  CHECK(clusters.size() >= 10);
}

TEST_CASE("distribution: draws span sizes, GPU generations and mixes, models, spaces and "
          "dynamics") {
  const ScenarioRanges r;
  int smallest = 1 << 30, largest = 0, mixed = 0, single = 0, dp_only = 0, compressed = 0;
  int no_stragglers = 0, congested = 0, failing = 0, long_context = 0, ramps = 0;
  std::set<std::string> gpus, models;
  const int draws = 400;
  for (uint64_t seed = 0; seed < draws; ++seed) {
    const Scenario s = draw_scenario(r, seed);
    const int n = s.cluster.num_gpus();
    smallest = std::min(smallest, n);
    largest = std::max(largest, n);
    CHECK(n <= r.gpus_max);
    CHECK((n >= r.gpus_min || s.cluster.groups.size() == 1));
    CHECK(s.horizon == r.horizon);
    for (const NodeGroup& g : s.cluster.groups) gpus.insert(g.gpu.name);
    mixed += s.cluster.groups.size() > 1;
    single += n <= 8;
    models.insert(s.model.name);
    dp_only += s.space.tp == std::vector<int>{1} && s.space.pp == std::vector<int>{1};
    compressed += s.space.compression;
    no_stragglers += s.straggler.rate_per_gpu_hour == 0;
    congested += s.congestion.rate_per_node_hour > 0;
    failing += s.failure.rate_per_node_hour > 0;
    long_context += s.phase.seq_len_factor > 1;
    ramps += s.phase.batch_start_fraction < 1;
    // The ranges docs/scenarios.md gives.
    CHECK(s.straggler.rate_per_gpu_hour <= 0.03);
    CHECK(s.straggler.slowdown_min >= 1.1);
    CHECK(s.straggler.slowdown_max <= 6.0);
    CHECK(s.straggler.slowdown_max >= s.straggler.slowdown_min);
    CHECK(s.congestion.factor_max >= s.congestion.factor_min);
    CHECK(s.failure.rate_per_node_hour <= 0.02);
    CHECK(s.telemetry.noise >= 0.02);
    CHECK(s.telemetry.noise <= 0.08);
  }
  CHECK(smallest <= 4);
  CHECK(largest >= 512);
  CHECK(gpus.size() == 6);
  CHECK(models.size() >= 5);
  // Small jobs train small models too (switches that cost little more than the pause).
  CHECK(models.count("gpt3-125m") == 1);
  CHECK(models.count("gpt3-350m") == 1);
  // Each kind is drawn often, and none always.
  for (int count : {mixed, single, dp_only, compressed, no_stragglers, congested, failing,
                    long_context, ramps}) {
    CHECK(count >= draws / 20);
    CHECK(count <= draws - draws / 20);
  }
}

TEST_CASE("distribution: every reset of sim:random runs a drawn scenario that fits, and a seed "
          "replays its episode") {
  auto env = ok(make_env("sim:random(gpus_max=128,horizon=4)"));
  CHECK(env->id() == "sim:random(gpus_max=128,horizon=4)");
  std::set<std::string> seen;
  for (uint64_t seed = 0; seed < 30; ++seed) {
    ok(env->reset(seed));
    REQUIRE(env->planning_view() != nullptr);
    const Scenario& s = env->planning_view()->scenario();
    const std::string drawn = s.cluster.name + " " + s.model.name;
    seen.insert(drawn);
    CHECK(s.cluster.num_gpus() <= 128);
    double reward = 0;
    for (int t = 0; t < env->horizon(); ++t) {
      const StepResult r = env->step(0);
      reward += r.reward;
      CHECK(r.reward >= 0);
      CHECK(r.info.best_tokens > 0);  // the drawn model runs on the drawn cluster
      if (r.truncated) break;
    }
    // The same seed draws the same scenario and the same episode.
    ok(env->reset(seed));
    const Scenario& replayed = env->planning_view()->scenario();
    CHECK(replayed.cluster.name + " " + replayed.model.name == drawn);
    double again = 0;
    for (int t = 0; t < env->horizon(); ++t) again += env->step(0).reward;
    CHECK(again == reward);
  }
  CHECK(seen.size() >= 20);
}

TEST_CASE("distribution: bad parameters are refused with their name") {
  CHECK(make_env("sim:random(gpus=64)").status().message().find("gpus") != std::string::npos);
  CHECK(!make_env("sim:random(gpus_max=4)").ok());
  CHECK(!make_env("sim:random(gpus_min=64,gpus_max=32)").ok());
}
