// The data-parallel job simulator's env (env/dp/dp_env.h).
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "env/dp/dp_env.h"
#include "env/env.h"
#include "env/observation.h"
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

// Takes candidate 1 once it promises at least 10% and the condition behind it has held two
// decisions in a row: misreports and interference pass within a decision, a fail-slow does not.
constexpr int kConfirmed = -1;

// One episode of `id` from `seed`, taking `action` (or kConfirmed's choice) at every decision.
Run run(const std::string& id, uint64_t seed, int action) {
  auto env = ok(make_env(id));
  Observation o = ok(env->reset(seed));
  Run out;
  for (int t = 0; t < env->horizon(); ++t) {
    const bool confirmed = feature(o, StateFeature::kConditionAge) * kSwitchMemoryIntervals > 1.5f &&
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

}  // namespace

TEST_CASE("dp env: same seed, same episode") {
  for (const std::string id : {"dp:random(horizon=8)", "dp:flap(ranks=12,horizon=8)"}) {
    INFO(id);
    const Run a = run(id, 5, 1), b = run(id, 5, 1);
    CHECK(a.rewards == b.rewards);
    CHECK(a.tokens == b.tokens);
    CHECK(a.oracle_tokens == b.oracle_tokens);
    CHECK(a.tokens != run(id, 6, 1).tokens);  // another job
  }
}

TEST_CASE(
    "dp env: on stragglers, a confirmed candidate beats keeping; on comm, keeping is as good") {
  double candidate = 0, keep = 0, oracle = 0, comm_keep = 0, comm_switch = 0;
  int switches = 0;
  size_t comm_events = 0;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    const Run c = run("dp:straggler(ranks=16)", seed, kConfirmed);
    candidate += c.tokens;
    switches += c.switches;
    const Run k = run("dp:straggler(ranks=16)", seed, 0);
    keep += k.tokens;
    oracle += k.oracle_tokens;
    comm_keep += run("dp:comm(ranks=16,horizon=30)", seed, 0).tokens;
    comm_switch += run("dp:comm(ranks=16,horizon=30)", seed, 1).tokens;
    auto comm = ok(make_env("dp:comm(ranks=16,horizon=30)"));
    ok(comm->reset(seed));
    comm_events += comm->events().size();
  }
  CHECK(comm_events > 0);  // the all-reduce did slow down
  CHECK(switches > 0);
  CHECK(candidate > keep * 1.02);
  CHECK(oracle > candidate);
  CHECK(comm_keep >= comm_switch);
}

TEST_CASE("dp env: reward is at most 1 up to noise, and the oracle makes at least keep's tokens") {
  for (const std::string family : {"straggler", "comm", "flap", "mixed"}) {
    for (uint64_t seed = 1; seed <= 2; ++seed) {
      const std::string id = "dp:" + family + "(ranks=24,horizon=20)";
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

TEST_CASE("dp env: ids name the family and the parameters; a bad one is an error naming it") {
  auto env = ok(make_env("dp:comm(ranks=8,horizon=5,decision_steps=4)"));
  CHECK(env->id() == "dp:comm(decision_steps=4,horizon=5,ranks=8)");
  CHECK(env->horizon() == 5);
  ok(env->reset(1));
  CHECK(dynamic_cast<dp::DataParallelEnv&>(*env).job_sim().ranks() == 8);
  const std::pair<const char*, const char*> bad[] = {
      {"dp:straggler(ranks=abc)", "ranks"},
      {"dp:straggler(ranks=1)", "ranks"},
      {"dp:straggler(horizon=0)", "horizon"},
      {"dp:straggler(decision_steps=-2)", "decision_steps"},
      {"dp:straggler(gpus=8)", "gpus"},
      {"dp:slowpoke", "slowpoke"},
      {"dp", "family"},
  };
  for (const auto& [id, named] : bad) {
    INFO(id);
    const auto made = make_env(id);
    REQUIRE_FALSE(made.ok());
    CHECK(made.status().code() == StatusCode::kInvalidArgument);
    CHECK(made.status().message().find(named) != std::string::npos);
  }
}
