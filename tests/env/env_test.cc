// The env conformance suite every registered env passes, plus simulator and baseline checks.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>

#include "agent/train/evaluate.h"
#include "env/env.h"
#include "env/observation.h"
#include "env/sim/sim_env.h"
#include "env/template_env.h"
#include "env/sim/step_telemetry.h"
#include "env/trace/telemetry.h"
#include "env/trace/trace_analysis.h"
#include "policy/baselines.h"
#include "policy/registry.h"
#include "core/error.h"
#include "strategy/spec_io.h"
#include "tests/test_util.h"

using parapilot::testing::failure_of;
using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::env;

namespace {

// Envs under conformance: every registered name, small enough to run fast.
const std::string kTraceDir = std::string(PARAPILOT_TEST_DATA_DIR) + "/traces/bytedance-ST/";
const std::string kConformanceIds[] = {
    "trace:" + kTraceDir + "trace-ST.csv(meta=" + kTraceDir + "meta-ST.yaml)",
    "bandit(horizon=12)",
    "dp:random(ranks=8,horizon=12)",
    "pp:random(stages=6,horizon=12)",
    "sim:hetero(gpus=16,horizon=12)",
    "sim:straggler(gpus=16,horizon=12)",
    "sim:congestion(gpus=16,horizon=12)",
    "sim:failure(gpus=16,horizon=12)",
    "sim:phase(gpus=16,horizon=12)",
    "sim:mixed(gpus=16,horizon=12)",
    "sim:failslow(gpus=16,horizon=12)",
    "sim:random(gpus_max=64,horizon=12)",
};

std::vector<double> rollout(Env& env, uint64_t seed, uint64_t action_seed, int* steps = nullptr) {
  std::mt19937_64 rng(action_seed);
  std::vector<double> trace;
  ok(env.reset(seed));
  int n = 0;
  while (true) {
    const StepResult r = env.step(static_cast<int>(rng() % kNumActions));
    trace.push_back(r.reward);
    for (float v : r.observation.state) trace.push_back(v);
    for (float v : r.observation.candidates) trace.push_back(v);
    ++n;
    if (r.terminated || r.truncated) break;
  }
  if (steps) *steps = n;
  return trace;
}

}  // namespace

TEST_CASE("conformance: every registered env is covered") {
  for (const auto& name : registered_envs()) {
    bool covered = false;
    for (const std::string& id : kConformanceIds)
      covered = covered || ok(parse_env_id(id)).name == name;
    CHECK_MESSAGE(covered, name);
  }
}

TEST_CASE(
    "conformance: same seed, same trajectory; truncation at the horizon; finite observations") {
  for (const std::string& id : kConformanceIds) {
    INFO(id);
    auto a = ok(make_env(id));
    auto b = ok(make_env(id));
    int steps = 0;
    const auto first = rollout(*a, 7, 99, &steps);
    CHECK(steps == a->horizon());
    CHECK(first == rollout(*b, 7, 99));
    CHECK(first == rollout(*a, 7, 99));  // reset really resets
    for (double v : first) CHECK(std::isfinite(v));
    // Random rollouts from other seeds never crash and keep observations in range.
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      ok(a->reset(seed));
      std::mt19937_64 rng(seed);
      for (int t = 0; t < a->horizon(); ++t) {
        const StepResult r = a->step(static_cast<int>(rng() % (kNumActions + 2)) - 1);
        CHECK(r.reward >= 0);
        CHECK(r.reward <= 1.5);
        for (int i = 0; i < kStateDim; ++i) {
          const FeatureRange range = input_range(i);
          INFO(input_name(i));
          CHECK(r.observation.state[i] >= range.lo);
          CHECK(r.observation.state[i] <= range.hi);
        }
        for (int k = 0; k < kMaxCandidates; ++k) {
          for (int f = 0; f < kCandidateDim; ++f) {
            const float v = r.observation.candidates[k * kCandidateDim + f];
            INFO(input_name(kStateDim + f));
            if (!r.observation.mask[k]) {
              CHECK(v == 0.0f);
            } else {
              CHECK(v >= input_range(kStateDim + f).lo);
              CHECK(v <= input_range(kStateDim + f).hi);
            }
          }
        }
        CHECK(r.truncated == (t == a->horizon() - 1));
      }
    }
  }
}

TEST_CASE("env ids: parameters, scenario files and errors") {
  const EnvId id = ok(parse_env_id("sim:straggler(gpus=64, seed=3)"));
  CHECK(id.name == "sim");
  CHECK(id.variant == "straggler");
  CHECK(id.params.at("gpus") == "64");
  CHECK(id.params.at("seed") == "3");
  CHECK(ok(parse_env_id("experiments/scenarios/mixed.toml")).variant ==
        "experiments/scenarios/mixed.toml");
  const EnvId named = ok(parse_env_id("sim:experiments/scenarios/mixed.toml"));
  CHECK(named.name == "sim");
  CHECK(named.variant == "experiments/scenarios/mixed.toml");
  CHECK(ok(parse_env_id("sim:experiments/scenarios/mixed.toml(beliefs=exact)")).variant ==
        "experiments/scenarios/mixed.toml");
  CHECK(failure_of(make_env("nosuch:thing")) != "");
  CHECK(failure_of(make_env("sim:weather")) != "");
  CHECK(failure_of(make_env("sim:straggler(gpus=12)")) != "");
  CHECK(failure_of(make_env("sim:straggler(gpus=abc)")) != "");
  CHECK(failure_of(make_env("sim:straggler(colour=red)")) != "");
  CHECK(failure_of(make_env("sim:straggler(gpus")) != "");
}

TEST_CASE("env factories return a Status naming a bad parameter, and never throw") {
  const auto refusal = [](const std::function<StatusOr<std::unique_ptr<Env>>()>& make) {
    std::optional<StatusOr<std::unique_ptr<Env>>> made;
    try {
      made.emplace(make());
    } catch (const std::exception& e) {
      FAIL("the factory threw instead of returning a Status: " << e.what());
    }
    REQUIRE(made.has_value());
    REQUIRE_FALSE(made->ok());
    CHECK(made->status().code() == StatusCode::kInvalidArgument);
    return made->status().message();
  };
  CHECK(refusal([] { return make_bandit_env(ok(parse_env_id("bandit(best=99)"))); })
            .find("best") != std::string::npos);
  CHECK(refusal([] { return make_sim_env(ok(parse_env_id("sim:straggler(gpus=abc)"))); })
            .find("gpus") != std::string::npos);
  CHECK(refusal([] { return make_trace_env(ok(parse_env_id("trace:/no/such.csv"))); }) != "");
  CHECK(ok(make_bandit_env(ok(parse_env_id("bandit(best=2)")))) != nullptr);
}

TEST_CASE("scenario files: a cluster of any size, and gpus must agree with it") {
  const std::string path = "/tmp/parapilot-env-test-scenario-" + std::to_string(::getpid()) +
                           ".toml";
  auto load = [&](const std::string& text) {
    std::ofstream(path) << text;
    return load_scenario(path);
  };
  const Scenario four =
      ok(load("[scenario]\nfamily = \"straggler\"\ncluster = \"1x4xa100-80g\"\n"));
  CHECK(four.cluster.num_gpus() == 4);
  CHECK(four.family == Family::kStraggler);
  CHECK(ok(load("[scenario]\nfamily = \"failure\"\ngpus = 4\ncluster = \"1x4xa100-80g\"\n"))
            .cluster.num_gpus() == 4);
  CHECK(failure_of(load("[scenario]\nfamily = \"straggler\"\ngpus = 8\ncluster = "
                        "\"1x4xa100-80g\"\n"))
            .find("the cluster has 4 GPUs") != std::string::npos);
  CHECK(failure_of(load("[scenario]\nfamily = \"straggler\"\ngpus = 12\n"))
            .find("multiple of 8") != std::string::npos);
  CHECK(ok(load("[scenario]\nfamily = \"straggler\"\n[scenario.telemetry]\nbeliefs = \"exact\"\n"))
            .telemetry.exact_beliefs);
  CHECK(failure_of(load("[scenario]\nfamily = \"straggler\"\n[scenario.telemetry]\n"
                        "beliefs = \"perfect\"\n"))
            .find("beliefs") != std::string::npos);
  // A 4-GPU scenario is a working env.
  std::ofstream(path) << "[scenario]\nfamily = \"straggler\"\ncluster = \"1x4xa100-80g\"\n"
                         "horizon = 4\n";
  auto small = ok(make_env(path));
  ok(small->reset(3));
  for (int t = 0; t < 4; ++t) CHECK(std::isfinite(small->step(0).reward));
  std::remove(path.c_str());
}

TEST_CASE("simulator: an episode does not depend on the episodes the env ran before") {
  // The env keeps what it learns of the true best layouts across episodes; an episode must
  // play out exactly as on a fresh env (rewards, best tokens and observations). Frequent
  // stragglers and congestion make conditions that differ only in some GPUs or nodes.
  Scenario busy = builtin_scenario(Family::kMixed, 16);
  busy.horizon = 24;
  busy.straggler.rate_per_gpu_hour = 1.0;
  busy.straggler.transient_fraction = 0.3;
  busy.congestion.rate_per_node_hour = 1.0;
  Scenario phase = builtin_scenario(Family::kPhase, 16);
  phase.horizon = 24;
  for (const Scenario& scenario : {busy, phase}) {
    INFO(scenario.name);
    SimEnv fresh(scenario, "fresh"), used(scenario, "used");
    for (uint64_t seed = 1; seed <= 3; ++seed) rollout(used, seed, seed);
    auto best_tokens = [](Env& env, uint64_t seed) {
      ok(env.reset(seed));
      std::vector<double> best;
      for (int t = 0; t < env.horizon(); ++t) best.push_back(env.step(t % 3 == 0).info.best_tokens);
      return best;
    };
    CHECK(rollout(fresh, 7, 99) == rollout(used, 7, 99));
    CHECK(best_tokens(fresh, 2) == best_tokens(used, 2));
  }
}

TEST_CASE("vectorised runner: same per-env trajectories as sequential stepping") {
  const char* id = "sim:mixed(gpus=16,horizon=8)";
  std::vector<std::unique_ptr<Env>> envs;
  for (int i = 0; i < 3; ++i) envs.push_back(ok(make_env(id)));
  VectorEnv vec(std::move(envs), 2);
  ok(vec.reset(100));
  std::vector<std::vector<double>> rewards(3);
  for (int t = 0; t < 8; ++t) {
    const auto results = ok(vec.step({0, 1, 2}));
    for (int i = 0; i < 3; ++i) rewards[i].push_back(results[i].reward);
  }
  for (int i = 0; i < 3; ++i) {
    auto env = ok(make_env(id));
    ok(env->reset(100 + static_cast<uint64_t>(i)));
    for (int t = 0; t < 8; ++t) CHECK(env->step(i).reward == rewards[i][t]);
  }
}

TEST_CASE("simulator: the oracle bounds static and reactive, and adapting beats standing still") {
  auto env = ok(make_env("sim:straggler(gpus=32,horizon=48)"));
  double static_total = 0, reactive_total = 0;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const auto oracle = ok(agent::run_oracle(*env, seed));
    for (const std::string name : {"static", "reactive"}) {
      auto policy = ok(parapilot::policy::make_policy(name, env.get()));
      const auto stats = ok(agent::run_episode(*env, *policy, seed));
      CHECK(stats.tokens <= oracle.tokens * 1.0001);
      (name == "static" ? static_total : reactive_total) += stats.tokens;
    }
  }
  // Strictly: a reactive rule that never switched would tie static (measured: +1.2%).
  CHECK(reactive_total > 1.005 * static_total);
}

TEST_CASE("simulator: every rule is bounded by the oracle and adapts where static cannot") {
  auto env = ok(make_env("sim:straggler(gpus=32,horizon=48)"));
  std::map<std::string, double> total;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    const auto oracle = ok(agent::run_oracle(*env, seed));
    for (const auto& info : parapilot::policy::registered_policies()) {
      const auto& can = info.capabilities;
      if (can.learned || can.hindsight || can.needs_planning_view) continue;  // not a rule
      const std::string& name = info.name;
      auto policy = ok(parapilot::policy::make_policy(name, env.get()));
      const auto stats = ok(agent::run_episode(*env, *policy, seed));
      CHECK(stats.tokens <= oracle.tokens * 1.0001);
      total[name] += stats.tokens;
    }
  }
  for (const char* name : {"threshold", "ski-rental"}) {
    INFO(name);
    CHECK(total[name] > 1.005 * total["static"]);
  }
}

namespace {

// An observation whose current layout is predicted `current_vs_best` of the best candidate,
// with one candidate of gain `gain`, switch `migration` intervals and payback `payback`.
Observation one_candidate(double current_vs_best, double gain, double migration, double payback) {
  Observation o;
  feature(o, StateFeature::kCurrentFeasible) = 1;
  feature(o, StateFeature::kCurrentFits) = 1;
  feature(o, StateFeature::kCurrentVsBest) = static_cast<float>(current_vs_best);
  o.mask[0] = 1;
  feature(o, 0, CandidateFeature::kLogGain) = static_cast<float>(std::log(gain));
  feature(o, 0, CandidateFeature::kMigrationTime) = static_cast<float>(migration);
  feature(o, 0, CandidateFeature::kPayback) = static_cast<float>(payback / 10);
  // The simulator's switch: a 2 s pause in a 300 s interval, staging at a tenth of the speed.
  feature(o, 0, CandidateFeature::kSwitchCost) = static_cast<float>(2.0 / 300 + 0.1 * migration);
  return o;
}

}  // namespace

TEST_CASE("threshold: a switch only when the gain left after paying for it is at least 5%") {
  auto rule = parapilot::policy::make_threshold({});
  // 20% faster and the switch pays back 10x over the run left: 18% after its cost.
  CHECK(rule->act(one_candidate(0.83, 1.2, 0.5, 10)) == 1);
  // 4% faster: below the threshold however cheap.
  CHECK(rule->act(one_candidate(0.96, 1.04, 0.0, 10)) == 0);
  // 20% faster but paying back only 1.2x: 3% after its cost.
  CHECK(rule->act(one_candidate(0.83, 1.2, 4.0, 1.2)) == 0);
  // A broken layout is replaced at once.
  Observation broken = one_candidate(0.0, 1.01, 4.0, 0.1);
  feature(broken, StateFeature::kCurrentFeasible) = 0;
  CHECK(rule->act(broken) == 1);
}

TEST_CASE("measured-shares: a switch once the gain reaches min_gain for confirm decisions in a row") {
  auto rule = parapilot::policy::make_measured_shares({1.10, 2});
  rule->begin_episode();
  auto aged = [](double gain, int age) {
    Observation o = one_candidate(1 / gain, gain, 0.1, 5);
    feature(o, StateFeature::kConditionAge) = static_cast<float>(age) / kSwitchMemoryIntervals;
    return o;
  };
  CHECK(rule->act(aged(1.5, 1)) == 0);   // the first decision of the condition
  CHECK(rule->act(aged(1.5, 2)) == 1);   // confirmed
  CHECK(rule->act(aged(1.08, 5)) == 0);  // below min_gain however long it lasts
  Observation staged = aged(1.5, 3);
  feature(staged, StateFeature::kStaging) = 1;
  CHECK(rule->act(staged) == 0);
}

TEST_CASE("ski-rental: a switch once the throughput lost since the condition began pays for it") {
  auto rule = parapilot::policy::make_ski_rental({});
  rule->begin_episode();
  // 10% lost per interval; the switch costs the pause plus a tenth of 2 intervals' staging:
  // about 0.21 intervals, paid after the third interval of the condition.
  const Observation slow = one_candidate(0.9, 1.11, 2.0, 5);
  CHECK(parapilot::policy::switch_cost_intervals(slow, 0) ==
        doctest::Approx(2.0 / 300 + 0.1 * 2.0));
  CHECK(rule->act(slow) == 0);  // lost 0.1
  CHECK(rule->act(slow) == 0);  // 0.2
  CHECK(rule->act(slow) == 1);  // 0.3 >= 0.207
  // The condition ending resets the count: two short episodes of it never pay.
  CHECK(rule->act(slow) == 0);
  CHECK(rule->act(one_candidate(1.0, 1.0, 2.0, 0)) == 0);
  CHECK(rule->act(slow) == 0);
  CHECK(rule->act(slow) == 0);
  // A cheap action pays at once.
  CHECK(rule->act(one_candidate(0.9, 1.11, 0.0, 10)) == 1);
}

TEST_CASE("simulator: mixed GPUs make uniform data parallel slower than the planned layout") {
  auto env = ok(make_env("sim:hetero(gpus=16,horizon=4)"));
  auto planned = parapilot::policy::make_static();
  auto uniform = parapilot::policy::make_uniform_dp();
  const auto a = ok(agent::run_episode(*env, *planned, 1));
  const auto b = ok(agent::run_episode(*env, *uniform, 1));
  CHECK(a.throughput_tokens_per_s > 1.2 * b.throughput_tokens_per_s);
}

TEST_CASE("simulator: an episode that cannot start is an error naming why, and the env still "
          "runs the next") {
  auto env = ok(make_env("sim:straggler(gpus=16,horizon=4)"));
  ResetOptions bogus;
  bogus.initial_layout = "diagonal";
  const auto refused = env->reset(1, bogus);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == StatusCode::kInvalidArgument);
  CHECK(refused.status().message().find("\"diagonal\"") != std::string::npos);
  // The refused reset left nothing behind: the next episode is a fresh env's, step for step.
  auto fresh = ok(make_env("sim:straggler(gpus=16,horizon=4)"));
  CHECK(ok(env->reset(1)).state == ok(fresh->reset(1)).state);
  for (int t = 0; t < 4; ++t) CHECK(env->step(1).reward == fresh->step(1).reward);
}

TEST_CASE("simulator: a failed GPU crashes the layout and the env restarts it") {
  Scenario s = builtin_scenario(Family::kFailure, 16);
  s.horizon = 24;
  s.failure.rate_per_node_hour = 2.0;  // make a failure certain in this short run
  SimEnv env(s, "failure-test");
  ok(env.reset(5));
  int restarts = 0;
  for (int t = 0; t < s.horizon; ++t) restarts += env.step(0).info.restarted;
  CHECK(restarts >= 1);
}

TEST_CASE("95% interval of the mean") {
  const auto i = agent::mean_interval({1.0, 2.0, 3.0, 4.0});
  CHECK(i.mean == doctest::Approx(2.5));
  CHECK(i.half_width == doctest::Approx(3.182 * std::sqrt(1.6666667 / 4)).epsilon(1e-3));
}

TEST_CASE("shortfall against the oracle by kind of interval") {
  agent::EpisodeStats oracle, policy;
  oracle.tokens_per_s_by_interval = {10, 10, 10, 10, 10};
  policy.tokens_per_s_by_interval = {10, 5, 8, 11, 6};
  CHECK_FALSE(agent::gap_by_change(policy, oracle).has_value());  // the env did not say
  // Changed at 1 after an unchanged 0 (onset), again at 2 (its telemetry followed interval 1's
  // change: next), not at 3 (the interval after a change: next), not at 4 (later).
  oracle.truth_changed = {false, true, true, false, false};
  const auto gap = agent::gap_by_change(policy, oracle);
  REQUIRE(gap.has_value());
  CHECK(gap->onset == doctest::Approx(5.0 / 50));
  CHECK(gap->next == doctest::Approx((2.0 - 1.0) / 50));
  CHECK(gap->later == doctest::Approx(4.0 / 50));
}

TEST_CASE("simulator: the oracle says when the truth changed, and the shortfall adds up") {
  Scenario s = builtin_scenario(Family::kStraggler, 16);
  // Nominal, nominal, GPU 5 slowed, slowed more, the same, nominal again.
  auto truth_with = [&](std::vector<double> gpu5) {
    Truth truth;
    for (double speed : gpu5) {
      Conditions c;
      if (speed != 1.0) {
        c.gpu_speed.assign(16, 1.0);
        c.gpu_speed[5] = speed;
      }
      truth.conditions.push_back(c);
      truth.seq_len.push_back(s.model.seq_len);
    }
    return truth;
  };
  {
    SimEnv env(s, "recorded", truth_with({1.0, 1.0, 0.5, 0.4, 0.4, 1.0}));
    const auto oracle = ok(agent::run_oracle(env, 1));
    CHECK(oracle.truth_changed == std::vector<bool>{false, false, true, true, false, true});
  }
  {
    // Slowed from the start: interval 0 differs from the nominal cluster the run planned for.
    SimEnv env(s, "recorded", truth_with({0.5, 0.5, 1.0}));
    CHECK(ok(agent::run_oracle(env, 1)).truth_changed == std::vector<bool>{true, false, true});
  }
  // On generated episodes the three parts are the score's shortfall, computed apart.
  auto env = ok(make_env("sim:mixed(gpus=32,horizon=48)"));
  auto rule = parapilot::policy::make_reactive({});
  int changes = 0;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    const auto oracle = ok(agent::run_oracle(*env, seed));
    for (bool c : oracle.truth_changed) changes += c;
    const auto stats = ok(agent::run_episode(*env, *rule, seed));
    const auto gap = agent::gap_by_change(stats, oracle);
    REQUIRE(gap.has_value());
    CHECK(gap->onset + gap->next + gap->later ==
          doctest::Approx(1.0 - stats.tokens / oracle.tokens).epsilon(1e-9));
  }
  CHECK(changes > 0);
}

TEST_CASE("exact beliefs: the agent believes the interval just run, failures at once") {
  Scenario s = builtin_scenario(Family::kStraggler, 16);
  s.telemetry.exact_beliefs = true;
  Truth truth;
  for (int t = 0; t < 6; ++t) {
    Conditions c;
    c.gpu_speed.assign(16, 1.0);
    c.gpu_speed[5] = t < 2 ? 0.4 : 0.7;
    c.node_inter_bw = {1.0, 0.3};
    if (t >= 3) {
      c.gpu_failed.assign(16, false);
      c.gpu_failed[12] = true;
    }
    truth.conditions.push_back(c);
    truth.seq_len.push_back(s.model.seq_len);
  }
  SimEnv env(s, "recorded", truth);
  ok(env.reset(3));
  CHECK(env.beliefs().gpu_speed.empty());  // nothing has run yet
  env.step(0);
  CHECK(env.beliefs().gpu_speed == truth.conditions[0].gpu_speed);  // exactly, no noise
  CHECK(env.beliefs().node_inter_bw == truth.conditions[0].node_inter_bw);
  env.step(0);
  env.step(0);
  CHECK(env.beliefs().gpu_speed[5] == 0.7);  // interval 2's
  CHECK(env.beliefs().failed(12));           // interval 3's failure, before it runs
  CHECK(ok(make_env("sim:straggler(gpus=16,beliefs=exact)"))->id() ==
        "sim:straggler(beliefs=exact,gpus=16)");
  CHECK(failure_of(make_env("sim:straggler(beliefs=perfect)")).find("beliefs") !=
        std::string::npos);
  CHECK(ok(make_env("sim:random(beliefs=exact)"))->id() == "sim:random(beliefs=exact)");
}

TEST_CASE("trace env: replays the recorded per-rank speeds as the hidden truth") {
  auto env = ok(make_env(kConformanceIds[0]));
  auto* sim = dynamic_cast<SimEnv*>(env.get());
  REQUIRE(sim);
  ok(env->reset(1));
  CHECK(env->horizon() == 32);  // 32 recorded steps, one per interval
  CHECK(sim->scenario().cluster.num_gpus() == 8);
  // The sample's workers compute at their stage's typical pace: no rank is far off.
  for (const Conditions& c : sim->truth().conditions) {
    for (int g = 0; g < 8; ++g) CHECK(c.speed(g) > 0.5);
  }
  CHECK(failure_of(make_env("trace:" + kTraceDir + "trace-ST.csv")) != "");  // no meta
  CHECK(failure_of(make_env("trace:/nonexistent.csv(meta=x.yaml)")) != "");
}

TEST_CASE("simulator telemetry recording: the trace analysis finds the slowed GPU") {
  Scenario s = builtin_scenario(Family::kStraggler, 16);
  Truth truth;
  for (int t = 0; t < 8; ++t) {
    Conditions c;
    c.gpu_speed.assign(16, 1.0);
    c.gpu_speed[5] = 0.4;
    truth.conditions.push_back(c);
    truth.seq_len.push_back(s.model.seq_len);
  }
  SimEnv env(s, "recorded", truth);
  std::vector<trace::TelemetrySample> samples;
  env.record_telemetry(&samples);
  ResetOptions uniform;
  uniform.initial_layout = "uniform-dp";
  ok(env.reset(1, uniform));
  for (int t = 0; t < 8; ++t) env.step(0);
  REQUIRE(samples.size() == 8u * 16u);  // one per replica (dp = 16, tp = pp = 1) per interval

  // Through the recording format and back, then the what-if analysis.
  std::stringstream csv;
  trace::write_telemetry(samples, csv);
  const trace::TelemetryTrace read = ok(trace::read_telemetry(csv, "recorded.csv"));
  CHECK(read.samples == samples);
  const trace::OpTrace ops = ok(trace::telemetry_to_op_trace(read, trace::telemetry_layout(read)));
  const trace::TraceAnalysis a = ok(trace::analyze_trace(ops));
  REQUIRE_FALSE(a.stragglers.empty());
  CHECK(a.stragglers.front().rank == 5);
  CHECK(a.cause == "worker");
  CHECK(a.slowdown > 1.5);
}

TEST_CASE("simulator noise: NormalDraws draws what std::normal_distribution draws") {
  // Value for value and engine state for engine state, across sigmas (0 included), odd
  // numbers of draws (a saved value left over) and fresh draws on a used engine.
  for (uint64_t seed : {1ull, 7ull, 12345ull}) {
    std::mt19937_64 a(seed), b(seed);
    for (double sigma : {0.05, 1.0, 0.0, 3e-7, 250.0}) {
      for (int n : {1, 2, 3, 1001, 20000}) {
        std::normal_distribution<double> expected(0.0, sigma);
        NormalDraws drawn(sigma);
        for (int i = 0; i < n; ++i) {
          const double x = expected(a), y = drawn(b);
          REQUIRE(std::memcmp(&x, &y, sizeof x) == 0);
        }
        REQUIRE(a == b);
      }
    }
  }
}

TEST_CASE("simulator telemetry: generate() drops missing samples as the env did after it") {
  // The reference: every sample generated, then one uniform draw per sample in order, the
  // missing ones removed. generate() with missing_prob must append the same samples bit for bit
  // and leave the engine in the same state.
  const ModelSpec model = *model_preset("llama3-8b");
  const ClusterSpec cluster = *cluster_preset("2x8xh100");  // two nodes: gradients cross them
  const CostModel cost(model, cluster);
  const Strategy layout = ok(load_strategy("dp=16,global_batch=64", model, cluster));
  const StepTelemetry telemetry(cost, layout);
  auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (double missing : {0.0, 0.05, 0.5, 0.99}) {
    for (uint64_t seed : {3ull, 11ull, 2024ull}) {
      std::mt19937_64 a(seed), b(seed);
      Conditions truth;
      truth.gpu_speed.assign(16, 1.0);
      truth.gpu_speed[seed % 16] = 0.4;
      truth.node_inter_bw = {1.0, 0.5};
      if (seed == 11) {
        truth.gpu_failed.assign(16, false);
        truth.gpu_failed[7] = true;
      }
      std::vector<monitor::StepSample> expected, got;
      for (uint64_t step = 0; step < 5; ++step) {
        const size_t first = expected.size();
        const double expected_ms = telemetry.generate(truth, step, 1000 * step, 0.05, a, expected);
        std::uniform_real_distribution<double> uniform(0.0, 1.0);
        size_t kept = first;
        for (size_t i = first; i < expected.size(); ++i) {
          if (uniform(a) >= missing) expected[kept++] = expected[i];
        }
        expected.resize(kept);
        const double got_ms =
            telemetry.generate(truth, step, 1000 * step, 0.05, b, got, nullptr, missing);
        CHECK(same(got_ms, expected_ms));
      }
      REQUIRE(got.size() == expected.size());
      if (missing < 0.9) {  // transfers reported: the wait-and-transfer path is compared too
        CHECK(std::any_of(got.begin(), got.end(), [](const auto& x) { return x.inter_bytes > 0; }));
      }
      if (missing > 0.4) CHECK(got.size() < 5 * 15);  // some went missing
      for (size_t i = 0; i < got.size(); ++i) {
        const monitor::StepSample &x = got[i], &y = expected[i];
        CHECK(x.rank == y.rank);
        CHECK(x.step == y.step);
        CHECK(x.start_ns == y.start_ns);
        CHECK(x.end_ns == y.end_ns);
        for (auto field :
             {&monitor::StepSample::compute_ms, &monitor::StepSample::samples,
              &monitor::StepSample::fixed_ms, &monitor::StepSample::wait_ms,
              &monitor::StepSample::inter_bytes, &monitor::StepSample::inter_ms,
              &monitor::StepSample::longest_collective_ms, &monitor::StepSample::queue_depth}) {
          CHECK(same(x.*field, y.*field));
        }
      }
      CHECK(a == b);
    }
  }
}

TEST_CASE("simulator beliefs come from the monitor fed with the steps' telemetry") {
  Scenario s = builtin_scenario(Family::kStraggler, 16);  // default noise, delay and loss
  Truth truth;
  for (int t = 0; t < 6; ++t) {
    Conditions c;
    c.gpu_speed.assign(16, 1.0);
    c.gpu_speed[5] = 0.4;
    c.node_inter_bw = {1.0, 0.3};
    c.gpu_failed.assign(16, false);
    if (t >= 4) c.gpu_failed[12] = true;
    truth.conditions.push_back(c);
    truth.seq_len.push_back(s.model.seq_len);
  }
  SimEnv env(s, "recorded", truth);
  ResetOptions uniform;
  uniform.initial_layout = "uniform-dp";  // data parallel across both nodes: the links show
  ok(env.reset(3, uniform));
  CHECK(env.beliefs().gpu_speed.empty());  // nothing measured yet
  env.step(0);
  env.step(0);
  // Interval 0's and 1's telemetry arrived: the slow GPU and the congested node are believed
  // near their truth; every other GPU and node reads exactly nominal (noise within the band).
  const Conditions& b = env.beliefs();
  REQUIRE(b.gpu_speed.size() == 16u);
  REQUIRE(b.node_inter_bw.size() == 2u);
  CHECK(b.gpu_speed[5] == doctest::Approx(0.4).epsilon(0.1));
  for (int g = 0; g < 16; ++g) {
    if (g != 5) CHECK(b.gpu_speed[g] == 1.0);
  }
  CHECK(b.node_inter_bw[0] == 1.0);
  CHECK(b.node_inter_bw[1] == doctest::Approx(0.3).epsilon(0.15));
  CHECK_FALSE(b.failed(12));
  env.step(0);
  env.step(0);  // GPU 12 fails in interval 4: seen at once, before its telemetry could say
  CHECK(env.beliefs().failed(12));
}

TEST_CASE("docs/observation.md lists every feature by its index, name and range") {
  std::ifstream in(std::string(PARAPILOT_SOURCE_DIR) + "/docs/observation.md");
  REQUIRE(in);
  const std::string doc((std::istreambuf_iterator<char>(in)), {});
  // "[lo, hi]" as the page writes it: shortest form, with a true minus sign.
  auto range_text = [](FeatureRange r) {
    auto number = [](float v) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%g", static_cast<double>(std::abs(v)));
      return (v < 0 ? std::string("\u2212") : std::string()) + buf;
    };
    return "[" + number(r.lo) + ", " + number(r.hi) + "]";
  };
  for (int i = 0; i < kStateDim; ++i) {
    const auto f = static_cast<StateFeature>(i);
    const std::string row = "| " + std::to_string(i) + " | `" + feature_name(f) + "` | " +
                            range_text(feature_range(f)) + " |";
    INFO(row);
    CHECK(doc.find(row) != std::string::npos);
  }
  const auto cand = doc.find("## Candidates");
  REQUIRE(cand != std::string::npos);
  for (int i = 0; i < kCandidateDim; ++i) {
    const auto f = static_cast<CandidateFeature>(i);
    const std::string row = "| " + std::to_string(i) + " | `" + feature_name(f) + "` | " +
                            range_text(feature_range(f)) + " |";
    INFO(row);
    CHECK(doc.find(row, cand) != std::string::npos);
  }
}
