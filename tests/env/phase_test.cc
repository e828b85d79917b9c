// The phase family's workload changes: the long-context stage, the global-batch ramp, and the
// change of gradient compressibility after the learning-rate decay (docs/scenarios.md).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policy/baselines.h"
#include "agent/train/evaluate.h"
#include "env/sim/sim_env.h"
#include "core/error.h"
#include "strategy/planner.h"
#include "tests/strategy/two_search_merge.h"
#include "tests/test_util.h"

using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::env;

namespace {

Scenario phase_scenario(int horizon = 96, int gpus = 16) {
  Scenario s = builtin_scenario(Family::kPhase, gpus);
  s.horizon = horizon;
  s.telemetry.noise = 0;
  s.telemetry.missing_prob = 0;
  return s;
}

bool has_event(const Truth& truth, int interval, const std::string& text) {
  for (const auto& [at, what] : truth.events) {
    if (at == interval && what.find(text) != std::string::npos) return true;
  }
  return false;
}

bool compresses_beyond_fp16(const Strategy& s, int layers) {
  for (int l = 0; l < layers; ++l) {
    const Compression::Kind k = s.compression_of_layer(l).kind;
    if (k == Compression::Kind::kTopK || k == Compression::Kind::kPowerSGD) return true;
  }
  return false;
}

Compression powersgd(int rank) {
  Compression c;
  c.kind = Compression::Kind::kPowerSGD;
  c.powersgd_rank = rank;
  return c;
}

// Writes a scenario file and returns the error message load_scenario gives for it ("" when
// it loads).
std::string load_error(const std::string& phase_table) {
  const std::string path = "phase_test_scenario.toml";
  {
    std::ofstream f(path);
    f << "[scenario]\nfamily = \"phase\"\ngpus = 16\n\n[scenario.phase]\n" << phase_table;
  }
  const StatusOr<Scenario> read = load_scenario(path);
  const std::string message = read.ok() ? "" : read.status().message();
  std::remove(path.c_str());
  return message;
}

}  // namespace

TEST_CASE("phase: the global batch ramps from a quarter to the full batch in three steps") {
  const Scenario s = phase_scenario();
  const Truth truth = generate_truth(s, 3);
  REQUIRE(truth.global_batch.size() == 96u);
  CHECK(final_global_batch(s) == 256);
  // 25% of 96 intervals = 24, in steps at 8, 16 and 24.
  for (int t = 0; t < 96; ++t) {
    const int expected = t < 8 ? 64 : t < 16 ? 128 : t < 24 ? 192 : 256;
    CHECK_MESSAGE(truth.global_batch[t] == expected, "interval " << t);
  }
  CHECK(has_event(truth, 0, "global batch 64"));
  CHECK(has_event(truth, 8, "global batch 128"));
  CHECK(has_event(truth, 24, "global batch 256"));

  // The running layout follows the ramp, and the same layout's throughput grows with it: a
  // larger batch amortises the gradient reduction over more tokens.
  SimEnv env(s, "phase-test");
  ok(env.reset(3));
  const Strategy start = env.current_layout();
  CHECK(start.global_batch == 64);
  for (int t = 0; t < 30; ++t) {
    CHECK(env.current_layout().global_batch == truth.global_batch[t]);
    env.step(0);
  }
  CHECK(env.current_layout().global_batch == 256);
  CHECK(env.true_tokens_per_s(start, 30) > 1.05 * env.true_tokens_per_s(start, 0));

  // Other families run the full batch from the start.
  const Truth straggler = generate_truth(builtin_scenario(Family::kStraggler, 16), 3);
  for (int b : straggler.global_batch) CHECK(b == 256);
  CHECK(straggler.gradient_regimes.empty());
}

TEST_CASE("phase: the ramp never starts below one sample per GPU") {
  Scenario s = phase_scenario(40);
  s.phase.seq_len_factor = 1;  // pure data parallel does not fit the long-context stage
  s.phase.batch_start_fraction = 0.01;
  s.phase.batch_ramp_steps = 2;
  s.phase.batch_ramp_fraction = 0.5;
  const Truth truth = generate_truth(s, 1);
  CHECK(truth.global_batch[0] == 16);
  CHECK(truth.global_batch[10] == 128);  // 16 + (256 - 16) / 2, a multiple of 16
  CHECK(truth.global_batch[20] == 256);
  SimEnv env(s, "phase-test");
  ResetOptions dp;
  dp.initial_layout = "uniform-dp";
  ok(env.reset(1, dp));
  for (int t = 0; t < s.horizon; ++t) CHECK(env.step(0).info.tokens > 0);
}

TEST_CASE("phase: convergence efficiency of compression against the budget") {
  const Truth truth = generate_truth(phase_scenario(), 1);
  REQUIRE(truth.gradient_regimes.size() == 2u);
  const GradientStats& before = truth.gradient_regimes[0];
  const GradientStats& after = truth.gradient_regimes[1];
  const int layers = 32;  // llama2-7b
  CHECK(truth.gradient_regime[47] == 0);
  CHECK(truth.gradient_regime[48] == 1);
  CHECK(has_event(truth, 48, "learning-rate decay"));
  CHECK(has_event(truth, 72, "sequence length x4"));

  Strategy s;
  CHECK(convergence_efficiency(s, layers, before, 2.0) == 1.0);
  s.compression.kind = Compression::Kind::kFP16;
  CHECK(convergence_efficiency(s, layers, before, 2.0) == 1.0);
  s.compression = powersgd(4);
  // PowerSGD's error 0.25 against a budget of 0.10: 1 - 2 * 0.15.
  CHECK(convergence_efficiency(s, layers, before, 2.0) == doctest::Approx(0.7));
  CHECK(convergence_efficiency(s, layers, after, 2.0) == 1.0);
  // Compressing half the blocks costs half as much.
  s.compression = Compression{};
  s.compression_overrides = {CompressionOverride{0, layers / 2 - 1, powersgd(4)}};
  CHECK(convergence_efficiency(s, layers, before, 2.0) == doctest::Approx(0.85));
  // Other ratios and ranks: more kept, less error.
  Compression topk;
  topk.kind = Compression::Kind::kTopK;
  topk.topk_ratio = 0.01;
  CHECK(compression_error(topk, before, 0) == doctest::Approx(0.30));
  topk.topk_ratio = 0.1;
  CHECK(compression_error(topk, before, 0) < 0.30);
  CHECK(compression_error(topk, before, 0) > 0.0);
  CHECK(compression_error(powersgd(8), before, 0) == doctest::Approx(0.125));
}

TEST_CASE("phase: a compressed layout loses progress before the decay and gains after it") {
  const Scenario s = phase_scenario();
  SimEnv env(s, "phase-test");
  ok(env.reset(2));
  // A plain all-reduce layout, uncompressed and with PowerSGD, at the full batch before and
  // after the decay at interval 48 (the long-context stage starts at 72).
  Strategy plain;
  plain.dp = 8;
  plain.tp = 2;
  plain.sp = true;
  plain.zero = 0;
  plain.global_batch = 256;
  plain.recompute = Recompute::kSelective;
  REQUIRE_FALSE(find_problem(plain, s.model, s.cluster));
  Strategy compressed = plain;
  compressed.compression = powersgd(4);
  const int before = 40, after = 60;
  REQUIRE(env.true_tokens_per_s(plain, before) > 0);
  // On this network the cost model says compression is much faster...
  const double raw_gain =
      env.true_tokens_per_s(compressed, after) / env.true_tokens_per_s(plain, after);
  CHECK(raw_gain > 1.1);
  // ... but before the decay only 70% of its tokens count: 1 - 2 * (0.25 - 0.10).
  CHECK(env.true_tokens_per_s(compressed, before) ==
        doctest::Approx(0.7 * raw_gain * env.true_tokens_per_s(plain, before)).epsilon(1e-6));
  CHECK(env.true_tokens_per_s(plain, before) == env.true_tokens_per_s(plain, after));
}

TEST_CASE("phase: the planner offers compressed layouts only once the decay is measured") {
  // 64 GPUs in 8 nodes: the gradient reduction crosses the thin network.
  const Scenario s = phase_scenario(96, 64);
  const int layers = s.model.layers;
  // Before the decay: whatever the policy switches to compresses at most to fp16.
  {
    SimEnv env(s, "phase-test");
    ok(env.reset(4));
    int switched = 0;
    for (int t = 0; t < 48; ++t) {
      switched += env.step(t % 6 == 5 ? 1 : 0).info.migration_committed ? 1 : 0;
      CHECK_FALSE(compresses_beyond_fp16(env.current_layout(), layers));
    }
    CHECK(switched >= 1);  // the policy did switch, to what the planner offered
  }
  // After it (measured one interval late), the best candidate compresses, and it pays.
  SimEnv env(s, "phase-test");
  ok(env.reset(4));
  double before_switch = 0;
  for (int t = 0; t < 49; ++t) before_switch = env.step(0).reward;
  CHECK_FALSE(compresses_beyond_fp16(env.current_layout(), layers));
  env.step(1);  // interval 49: take the best candidate
  for (int t = 50; t < 54; ++t) env.step(0);
  CHECK(compresses_beyond_fp16(env.current_layout(), layers));
  CHECK(env.step(0).reward > before_switch + 0.03);
}

TEST_CASE("phase: the oracle adopts compression after the decay; static cannot") {
  Scenario s = phase_scenario(96, 64);
  auto static_policy = parapilot::policy::make_static();
  SimEnv env(s, "phase-test");
  const auto fixed = ok(agent::run_episode(env, *static_policy, 6));
  const auto oracle = ok(agent::run_oracle(env, 6));
  double fixed_late = 0, oracle_late = 0, fixed_mid = 0, oracle_mid = 0;
  for (int t = 30; t < 46; ++t) {
    fixed_mid += fixed.tokens_per_s_by_interval[t];
    oracle_mid += oracle.tokens_per_s_by_interval[t];
  }
  for (int t = 52; t < 70; ++t) {
    fixed_late += fixed.tokens_per_s_by_interval[t];
    oracle_late += oracle.tokens_per_s_by_interval[t];
  }
  CHECK(oracle.tokens >= fixed.tokens);
  // The oracle's lead grows once gradients compress without harm.
  CHECK(oracle_late / fixed_late > 1.03 * (oracle_mid / fixed_mid));
}

TEST_CASE("phase: generate_truth is a pure function of (scenario, seed)") {
  const Scenario s = builtin_scenario(Family::kMixed, 16);
  const Truth a = generate_truth(s, 11);
  const Truth b = generate_truth(s, 11);
  CHECK(a.global_batch == b.global_batch);
  CHECK(a.gradient_regime == b.gradient_regime);
  CHECK(a.events == b.events);
  CHECK(a.seq_len == b.seq_len);
  // Mixed carries every workload change.
  CHECK(a.global_batch.front() < a.global_batch.back());
  CHECK(a.gradient_regimes.size() == 2u);
}

TEST_CASE("phase: [scenario.phase] keys are read and validated with their location") {
  CHECK(load_error("batch_start_fraction = 0.5\nbatch_ramp_steps = 2\ndecay_at_fraction = 0.9\n"
                   "topk_error_after = 0.02\nerror_budget = 0.05\nconvergence_penalty = 1.5\n"
                   "compression = false\n") == "");
  {
    const std::string path = "phase_test_scenario.toml";
    std::ofstream(path) << "[scenario]\nfamily = \"phase\"\ngpus = 16\n[scenario.phase]\n"
                           "batch_start_fraction = 0.5\nbatch_ramp_steps = 2\n"
                           "powersgd_error_before = 0.4\ncompression = false\n";
    const StatusOr<Scenario> read = load_scenario(path);
    REQUIRE_MESSAGE(read.ok(), read.status().message());
    const Scenario s = *read;
    std::remove(path.c_str());
    CHECK(s.phase.batch_start_fraction == 0.5);
    CHECK(s.phase.batch_ramp_steps == 2);
    CHECK(s.phase.powersgd_error_before == 0.4);
    CHECK_FALSE(s.phase.compression);
    CHECK(generate_truth(s, 1).gradient_regimes.empty());
  }
  const std::string steps = load_error("batch_ramp_steps = 0\n");
  CHECK(steps.find("phase_test_scenario.toml:6") != std::string::npos);
  CHECK(steps.find("[scenario.phase] batch_ramp_steps") != std::string::npos);
  CHECK(load_error("batch_start_fraction = 0\n").find("batch_start_fraction") != std::string::npos);
  CHECK(load_error("topk_error_before = 1.5\n").find("topk_error_before") != std::string::npos);
  CHECK(load_error("compression = \"yes\"\n").find("compression") != std::string::npos);
  CHECK(load_error("error_budget = 0.0001\n").find("fp16") != std::string::npos);
  CHECK(load_error("batch_ramp = 3\n").find("batch_ramp") != std::string::npos);
  CHECK(load_error("convergence_penalty = -1\n").find("convergence_penalty") != std::string::npos);
}

// SimEnv plans with one planner search (ZeRO-0 variants, docs/planner.md). The reference is the
// merge of a search of the scenario's space with one over ZeRO 0 alone: on the phase and mixed
// scenarios' requests both give the same candidates.
TEST_CASE("phase: one planner search equals the two-search merge on phase and mixed requests") {
  using parapilot::testing::two_search_merge;
  int compared = 0, strong = 0;
  for (Family family : {Family::kPhase, Family::kMixed}) {
    for (int gpus : {16, 64}) {
      Scenario s = builtin_scenario(family, gpus);
      s.horizon = 48;
      const Truth truth = generate_truth(s, 3);
      REQUIRE(truth.gradient_regimes.size() == 2u);
      std::map<int, std::unique_ptr<Planner>> planners;
      for (int t = 0; t < s.horizon; t += 3) {
        auto& planner = planners[truth.seq_len[t]];
        if (!planner) {
          ModelSpec model = s.model;
          model.seq_len = truth.seq_len[t];
          planner = std::make_unique<Planner>(model, s.cluster);
        }
        PlanRequest req;
        req.conditions = truth.conditions[t];
        req.gradients = truth.gradient_regimes[(t / 3) % 2];
        req.space = s.space;
        req.space.global_batch = truth.global_batch[t];
        req.top_k = t % 2 ? 1 : kMaxCandidates + 1;
        req.zero0_top_k = kMaxCandidates + 1;
        CAPTURE(to_string(family));
        CAPTURE(gpus);
        CAPTURE(t);
        PlanResult single, merged;
        try {
          single = planner->plan(req);
        } catch (const InputError&) {
          CHECK_THROWS_AS(two_search_merge(*planner, req), InputError);
          continue;
        }
        merged = two_search_merge(*planner, req);
        REQUIRE(single.candidates.size() == merged.candidates.size());
        for (size_t i = 0; i < single.candidates.size(); ++i) {
          CAPTURE(i);
          CHECK(single.candidates[i].strategy == merged.candidates[i].strategy);
          CHECK(single.candidates[i].cost.tokens_per_s == merged.candidates[i].cost.tokens_per_s);
          strong += compresses_beyond_fp16(single.candidates[i].strategy, s.model.layers);
        }
        ++compared;
      }
    }
  }
  MESSAGE(compared << " requests compared, " << strong << " candidates with top-k or PowerSGD");
  CHECK(strong > 0);
}
