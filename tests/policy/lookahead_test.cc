// The lookahead baseline (policy/lookahead.h): causal, deterministic, refuses envs without
// dynamics, and recovers a persistent straggler's loss.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "agent/train/evaluate.h"
#include "env/registry.h"
#include "env/sim/sim_env.h"
#include "policy/baselines.h"
#include "policy/lookahead.h"
#include "policy/registry.h"
#include "core/error.h"
#include "tests/test_util.h"

using parapilot::testing::failure_of;
using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::env;

namespace {

// A straggler scenario on 16 GPUs whose slowdowns are all persistent and strong, a few per run.
Scenario persistent_stragglers() {
  Scenario s = builtin_scenario(Family::kStraggler, 16);
  s.straggler.rate_per_gpu_hour = 0.02;
  s.straggler.transient_fraction = 0;
  s.straggler.slowdown_min = 2;
  s.straggler.slowdown_max = 4;
  s.straggler.persistent_median_h = 4;
  return s;
}

// The actions a fresh lookahead policy takes over the first `steps` intervals of an episode.
std::vector<int> actions(SimEnv& env, uint64_t seed, int steps, const policy::LookaheadOptions& o) {
  auto p = ok(policy::make_lookahead(env, o));
  p->begin_episode();
  Observation obs = ok(env.reset(seed, p->reset_options()));
  std::vector<int> out;
  for (int t = 0; t < steps; ++t) {
    out.push_back(p->act(obs));
    obs = env.step(out.back()).observation;
  }
  return out;
}

}  // namespace

TEST_CASE("lookahead: refuses an env without dynamics to sample, naming it and why") {
  const Scenario s = persistent_stragglers();
  Truth recorded = generate_truth(s, 1);
  SimEnv replay(s, "trace:replayed.csv", recorded);  // a replay: no dynamics behind it
  CHECK(replay.planning_view() == nullptr);
  const std::string what = failure_of(policy::make_lookahead(replay, {}));
  CHECK(what.find("trace:replayed.csv") != std::string::npos);
  CHECK(what.find("dynamics") != std::string::npos);
  auto bandit = ok(make_env("bandit(horizon=4)"));
  CHECK_FALSE(policy::make_lookahead(*bandit, {}).ok());
  // The same truth marked as a draw of the scenario's dynamics has a view.
  SimEnv drawn(s, "drawn", recorded, true);
  CHECK(drawn.planning_view() != nullptr);
  CHECK(policy::make_lookahead(drawn, {}).ok());
}

TEST_CASE("lookahead: options by name, and bad ones refused") {
  auto options = [](const std::string& id) {
    return policy::lookahead_options(ok(policy::parse_policy(id)));
  };
  CHECK(failure_of(policy::parse_policy("lookaheadx")).find("unknown policy") != std::string::npos);
  const policy::LookaheadOptions defaults;
  const auto plain = options("lookahead");
  CHECK(plain.futures == defaults.futures);
  CHECK(plain.intervals == defaults.intervals);
  CHECK(plain.min_gain == defaults.min_gain);
  CHECK(plain.seed == defaults.seed);
  CHECK_FALSE(plain.family_dynamics);
  const auto o = options("lookahead(k=8,h=4,min_gain=1.1,seed=9)");
  CHECK(o.futures == 8);
  CHECK(o.intervals == 4);
  CHECK(o.min_gain == 1.1);
  CHECK(o.seed == 9u);
  for (const char* bad : {"lookahead(k=0)", "lookahead(k=2.5)", "lookahead(h=x)",
                          "lookahead(min_gain=0.9)", "lookahead(k=3"}) {
    INFO(bad);
    CHECK(failure_of(policy::parse_policy(bad)).find(bad) != std::string::npos);
  }
  // The message names the parameter and what it allows.
  const std::string k = failure_of(policy::parse_policy("lookahead(k=0)"));
  CHECK(k.find("parameter k") != std::string::npos);
  CHECK(k.find("[1, 100000]") != std::string::npos);
  const std::string unknown = failure_of(policy::parse_policy("lookahead(depth=3)"));
  CHECK(unknown.find("\"depth\"") != std::string::npos);
  CHECK(unknown.find("k, h, min_gain, seed, dynamics") != std::string::npos);
  CHECK_FALSE(options("lookahead(dynamics=own)").family_dynamics);
  CHECK(options("lookahead(k=4,dynamics=family)").family_dynamics);
  CHECK(failure_of(policy::parse_policy("lookahead(dynamics=true)")).find("own or family") !=
        std::string::npos);
}

TEST_CASE("lookahead: dynamics=family plans with the family's rates, not the scenario's own") {
  // A straggler scenario whose own dynamics have no slowdowns, replaying one that has a GPU
  // 3x slower throughout: with its own dynamics the policy reads the believed slowdown as the
  // monitor's noise (no such condition can occur) and never switches; with the straggler
  // family's built-in rates it is a slowdown that lasts, and the policy switches away from it.
  Scenario s = builtin_scenario(Family::kStraggler, 16);
  s.straggler.rate_per_gpu_hour = 0;
  Truth truth;
  for (int t = 0; t < 12; ++t) {
    Conditions c;
    c.gpu_speed.assign(16, 1.0);
    c.gpu_speed[3] = 1.0 / 3;
    truth.conditions.push_back(c);
    truth.seq_len.push_back(s.model.seq_len);
  }
  SimEnv env(s, "sim:recorded-slow-gpu", truth, /*follows_scenario=*/true);
  auto switches = [](const std::vector<int>& a) {
    int n = 0;
    for (int x : a) n += x != 0;
    return n;
  };
  policy::LookaheadOptions own, family;
  family.family_dynamics = true;
  CHECK(switches(actions(env, 1, 12, own)) == 0);
  CHECK(switches(actions(env, 1, 12, family)) >= 1);
}

TEST_CASE("lookahead: the decisions do not change when only the hidden future differs") {
  const Scenario s = persistent_stragglers();
  const uint64_t seed = 4;
  const int T = 30;
  const Truth a = generate_truth(s, seed);
  // b: a's truth up to interval T, then GPU 3 four times slower and node 1 congested to the
  // end. Nothing of it can reach the monitor by interval T's decision.
  Truth b = a;
  for (int t = T + 1; t < s.horizon; ++t) {
    Conditions& c = b.conditions[t];
    if (c.gpu_speed.empty()) c.gpu_speed.assign(16, 1.0);
    c.gpu_speed[3] = 0.25;
    c.node_inter_bw = {1.0, 0.2};
  }
  // c: the same change, but from interval T - 4: in the past by T, which the monitor has seen.
  Truth c = a;
  for (int t = T - 4; t < s.horizon; ++t) {
    Conditions& x = c.conditions[t];
    if (x.gpu_speed.empty()) x.gpu_speed.assign(16, 1.0);
    x.gpu_speed[3] = 0.25;
    x.node_inter_bw = {1.0, 0.2};
  }
  SimEnv env_a(s, "a", a, true), env_b(s, "b", b, true), env_c(s, "c", c, true);
  // The futures differ where it matters: hindsight would act on b's.
  ok(env_a.reset(seed));
  ok(env_b.reset(seed));
  REQUIRE(env_a.oracle()->tokens_per_interval[T + 2] !=
          doctest::Approx(env_b.oracle()->tokens_per_interval[T + 2]).epsilon(0.05));

  const policy::LookaheadOptions o;
  const std::vector<int> seen_a = actions(env_a, seed, T + 1, o);
  const std::vector<int> seen_b = actions(env_b, seed, T + 1, o);
  CHECK(seen_a == seen_b);  // every decision up to and including interval T's
  // The policy does read what it may see: the same change in the past changes its decisions.
  const std::vector<int> seen_c = actions(env_c, seed, T + 1, o);
  CHECK(seen_a != seen_c);
  bool switched = false;
  for (int t = T - 4; t <= T; ++t) switched = switched || seen_c[t] != 0;
  CHECK(switched);
}

TEST_CASE("lookahead: the same seed gives the same episode; the seed keys the futures") {
  auto env = ok(make_env("sim:mixed(gpus=16,horizon=48)"));
  policy::LookaheadOptions o;
  o.futures = 8;
  auto p1 = ok(policy::make_lookahead(*env, o));
  auto p2 = ok(policy::make_lookahead(*env, o));
  const agent::EpisodeStats x = ok(agent::run_episode(*env, *p1, 21));
  const agent::EpisodeStats y = ok(agent::run_episode(*env, *p2, 21));
  CHECK(x.tokens == y.tokens);
  CHECK(x.migrations == y.migrations);
  CHECK(x.tokens_per_s_by_interval == y.tokens_per_s_by_interval);
  // And the policy holds nothing across episodes: a used policy repeats a fresh one.
  const agent::EpisodeStats z = ok(agent::run_episode(*env, *p1, 21));
  CHECK(z.tokens_per_s_by_interval == x.tokens_per_s_by_interval);
}

TEST_CASE("lookahead: recovers a persistent straggler's loss where static cannot") {
  const Scenario s = persistent_stragglers();
  SimEnv env(s, "sim:persistent-stragglers");
  auto lookahead = ok(policy::make_lookahead(env, {}));
  auto fixed = policy::make_static();
  std::vector<double> la, st;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    const double oracle = ok(agent::run_oracle(env, seed)).throughput_tokens_per_s;
    la.push_back(ok(agent::run_episode(env, *lookahead, seed)).throughput_tokens_per_s / oracle);
    st.push_back(ok(agent::run_episode(env, *fixed, seed)).throughput_tokens_per_s / oracle);
  }
  const agent::PairedDifference d = agent::paired_difference(la, st);
  MESSAGE("lookahead - static: " << d.difference.mean << " +- " << d.difference.half_width
                                 << ", lookahead " << agent::mean_interval(la).mean);
  CHECK(std::string(d.verdict()) == "better");
  CHECK(agent::mean_interval(la).mean > 0.9);
}
