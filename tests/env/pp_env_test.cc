// The pipeline job simulator (env/pp/pipeline_sim.h) and its env, pp: (env/dp/dp_env.h).
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "env/dp/dp_env.h"
#include "env/env.h"
#include "env/observation.h"
#include "env/pp/pipeline_model.h"
#include "env/pp/pipeline_sim.h"
#include "tests/test_util.h"

using namespace parapilot;
using namespace parapilot::env;
using parapilot::testing::ok;

namespace {

struct Run {
  double tokens = 0;
  double oracle_tokens = 0;
  std::vector<double> rewards;
  int switches = 0;
};

constexpr int kConfirmed = -1;

// One episode of `id` from `seed`, taking `action` at every decision, or (kConfirmed) candidate
// 1 once it promises at least 10% and the condition behind it has held two decisions in a row.
Run run(const std::string& id, uint64_t seed, int action) {
  auto env = ok(make_env(id));
  Observation o = ok(env->reset(seed));
  Run out;
  for (int t = 0; t < env->horizon(); ++t) {
    const bool confirmed =
        feature(o, StateFeature::kConditionAge) * kSwitchMemoryIntervals > 1.5f &&
        feature(o, 0, CandidateFeature::kLogGain) >= std::log(1.1f);
    const int a = action != kConfirmed ? action : confirmed ? 1 : 0;
    const StepResult r = env->step(a);
    o = r.observation;
    out.tokens += r.info.tokens;
    out.rewards.push_back(r.reward);
    out.switches += r.info.migration_committed;
  }
  const auto oracle = env->oracle();
  REQUIRE(oracle.has_value());
  for (double t : oracle->tokens_per_interval) out.oracle_tokens += t;
  return out;
}

// A pipeline of 4 stages x 4 equal blocks, no noise and no event: the truth is plain.
pp::PipelineJobSim plain_sim() {
  dp::Episode e = dp::draw_episode({dp::Family::straggler, 4, 10, 20}, 1);
  e.events.clear();
  e.job.noise_sigma = e.job.hiccup_probability = e.job.drop_probability = 0;
  pp::PipelineShape shape;
  shape.block_ms.assign(16, 2.0);
  shape.block_params.assign(16, 1000);
  shape.block_bytes.assign(16, 1'000'000);
  shape.microbatches = 8;
  shape.fixed_ms = 1;
  shape.p2p_ms = 0.5;
  shape.bytes_per_ms = 1e6;
  return pp::PipelineJobSim(e, shape, 7);
}

}  // namespace

TEST_CASE("pp sim: a step is the schedule around the slowest stage; a switch pays its transfer") {
  pp::PipelineJobSim sim = plain_sim();
  const auto& first = sim.step();
  // (8 + 4 - 1) / 8 x 8 ms + 1 ms + 0.5 ms.
  CHECK(first.wall_ms == doctest::Approx(11.0 / 8 * 8 + 1 + 0.5));
  CHECK(first.best_ms == doctest::Approx(first.wall_ms));
  REQUIRE(first.samples.size() == 4);
  for (int s = 0; s < 4; ++s) {
    const monitor::StepSample& x = first.samples[s];
    CHECK(x.stage.first_block == 4 * s);
    CHECK(x.stage.blocks == 4);
    CHECK(x.stage.microbatches == 8);
    CHECK(x.stage.block_ms == std::vector<double>(4, 2.0));
    CHECK(x.compute_ms == doctest::Approx(9.0));
    CHECK(x.compute_ms <= static_cast<double>(x.end_ns - x.start_ns) / 1e6);
  }
  const double last_wall = first.wall_ms;
  sim.set_counts({5, 4, 3, 4});
  // Blocks 4 and 8 change stage: 2 x 1e6 x 3 bytes at 1e6 bytes per ms.
  CHECK(sim.transfer_ms({4, 4, 4, 4}, {5, 4, 3, 4}) == doctest::Approx(6.0));
  const auto& second = sim.step();
  CHECK(second.paused_ms == doctest::Approx(last_wall + 6.0 + 5));
  CHECK(second.wall_ms == doctest::Approx(11.0 / 8 * 10 + 1.5 + second.paused_ms));
  CHECK(second.samples[1].stage.first_block == 5);
  CHECK(sim.step().paused_ms == 0);
}

TEST_CASE("pp env: same seed, same episode") {
  for (const std::string id : {"pp:random(horizon=8)", "pp:flap(stages=6,horizon=8)"}) {
    INFO(id);
    const Run a = run(id, 5, 1), b = run(id, 5, 1);
    CHECK(a.rewards == b.rewards);
    CHECK(a.tokens == b.tokens);
    CHECK(a.oracle_tokens == b.oracle_tokens);
    CHECK(a.tokens != run(id, 6, 1).tokens);  // another job
  }
}

TEST_CASE("pp env: on stragglers a confirmed candidate beats keeping, and the oracle beats both") {
  double candidate = 0, keep = 0, oracle = 0;
  int switches = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    const Run c = run("pp:straggler(stages=8)", seed, kConfirmed);
    candidate += c.tokens;
    switches += c.switches;
    const Run k = run("pp:straggler(stages=8)", seed, 0);
    keep += k.tokens;
    oracle += k.oracle_tokens;
  }
  CHECK(switches > 0);
  CHECK(candidate > keep * 1.02);
  CHECK(oracle > keep * 1.02);
}

TEST_CASE("pp env: reward is at most 1 up to noise, and the oracle makes at least keep's tokens") {
  for (const std::string family : {"straggler", "comm", "flap", "mixed"}) {
    for (uint64_t seed = 1; seed <= 2; ++seed) {
      const std::string id = "pp:" + family + "(stages=6,horizon=20)";
      INFO(id << " seed " << seed);
      for (int action : {0, 1}) {
        const Run r = run(id, seed, action);
        const double mean = std::accumulate(r.rewards.begin(), r.rewards.end(), 0.0) /
                            static_cast<double>(r.rewards.size());
        CHECK(mean <= 1.01);
        for (double x : r.rewards) {
          CHECK(x > 0);
          CHECK(x <= 1.1);
        }
        if (action == 0) CHECK(r.oracle_tokens >= r.tokens);
      }
    }
  }
}

TEST_CASE("pp env: ids name the family and the parameters; a bad one is an error naming it") {
  auto env = ok(make_env("pp:comm(stages=4,horizon=5,decision_steps=4)"));
  CHECK(env->id() == "pp:comm(decision_steps=4,horizon=5,stages=4)");
  CHECK(env->horizon() == 5);
  ok(env->reset(1));
  CHECK(dynamic_cast<dp::DataParallelEnv&>(*env).job_sim().ranks() == 4);
  const std::pair<const char*, const char*> bad[] = {
      {"pp:straggler(stages=1)", "stages"},
      {"pp:straggler(ranks=8)", "ranks"},
      {"pp:slowpoke", "slowpoke"},
  };
  for (const auto& [id, named] : bad) {
    INFO(id);
    const auto made = make_env(id);
    REQUIRE_FALSE(made.ok());
    CHECK(made.status().code() == StatusCode::kInvalidArgument);
    CHECK(made.status().message().find(named) != std::string::npos);
  }
}
