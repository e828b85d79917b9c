// Latency of one scheduling decision on CPU: normalise an observation, score keep and the
// candidates, pick greedily. Prints median and p99 for the shipped inference path (the
// hand-written actor) and for a batch-1 libtorch forward pass; and the whole decision deploy
// makes for a learned job (env/dp/decider.h: the observation from the monitor's beliefs, the
// shipped policy's act, the guardrail): a data-parallel job at 8, 64 and 512 ranks, a pipeline
// (env/pp/pipeline_model.h, 8 blocks per stage) at 4, 16 and 64 stages.
//
//   build/benchmarks/policy/bench_policy [CHECKPOINT] [--json FILE]
//     CHECKPOINT: default the shipped default policy; when the file is absent only the fresh
//     network is measured. --json FILE: also write the figures as JSON (benchmarks/report.h):
//     "checkpoint", "checkpoint_found", "parameters" and "paths", one row per measured path
//     (microseconds per decision: median, p90, p99, max).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include "env/dp/decider.h"
#include "env/dp/shares.h"
#include "env/pp/pipeline_model.h"
#include "policy/loader.h"
#include "benchmarks/report.h"
#include "policy/features.h"
#include "policy/network.h"

namespace pp = parapilot::policy;
namespace env = parapilot::env;

namespace {

std::vector<env::Observation> random_observations(int n) {
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<env::Observation> out(n);
  for (auto& o : out) {
    for (auto& x : o.state) x = normal(rng);
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      o.mask[k] = static_cast<uint8_t>(rng() % 4 != 0);
      for (int j = 0; j < env::kCandidateDim; ++j)
        o.candidates[k * env::kCandidateDim + j] = o.mask[k] ? normal(rng) : 0.0f;
    }
  }
  return out;
}

template <class F>
nlohmann::json measure(const char* id, const char* what, int n, F&& decide) {
  std::vector<double> us(n);
  int sink = 0;
  for (int i = 0; i < std::min(n, 1000); ++i) sink += decide(i);  // warm-up
  for (int i = 0; i < n; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    sink += decide(i);
    us[i] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  std::sort(us.begin(), us.end());
  std::printf("%-44s median %7.2f us   p99 %7.2f us   (%d decisions, checksum %d)\n", what,
              us[n / 2], us[static_cast<size_t>(n * 0.99)], n, sink % 7);
  return {{"path", id},
          {"description", what},
          {"decisions", n},
          {"median_us", us[n / 2]},
          {"p90_us", us[static_cast<size_t>(n * 0.9)]},
          {"p99_us", us[static_cast<size_t>(n * 0.99)]},
          {"max_us", us[static_cast<size_t>(n - 1)]},
          {"checksum", sink % 7}};
}

}  // namespace

int main(int argc, char** argv) {
  if (parapilot::bench::print_help(argc, argv,
                                   "usage: bench_policy [CHECKPOINT] [--json FILE]\n"
                                   "decision latency of the policy (default: the shipped one)")) {
    return 0;
  }
  const std::string json_path = parapilot::bench::take_json_flag(argc, argv);
  parapilot::bench::Report report("bench_policy", argc, argv);
  nlohmann::json& fig = report.figures();
  fig["paths"] = nlohmann::json::array();
  at::set_num_threads(1);
  const int n = 20000;
  const auto obs = random_observations(n);
  const std::string path = argc > 1 ? argv[1] : parapilot::policy::default_policy_path();
  fig["checkpoint"] = path;
  fig["checkpoint_found"] = std::filesystem::exists(path);
  if (std::filesystem::exists(path)) {
    auto loaded = parapilot::policy::load_policy(path);
    if (!loaded.ok()) {
      std::fprintf(stderr, "bench_policy: %s\n", loaded.status().message().c_str());
      return 2;
    }
    std::unique_ptr<parapilot::policy::Policy> policy = std::move(*loaded);
    std::printf("policy %s\n", path.c_str());
    fig["policy"] = policy->name();
    fig["paths"].push_back(measure("checkpoint_hand_written",
                                   "decision (normalise + hand-written actor)", n,
                                   [&](int i) { return policy->act(obs[i]); }));
    for (int ranks : {8, 64, 512}) {
      // A job with one rank twice as slow per sample: every decision has four candidates.
      env::dp::DataParallelOptions o;
      o.ranks = ranks;
      o.global_batch = 32 * ranks;
      o.warmup_steps = 0;
      env::dp::DataParallelDecider decider(o);
      for (uint64_t s = 0; s < 20; ++s) decider.observe_step(s, 100);
      parapilot::monitor::Beliefs b;
      b.compute_per_sample = true;
      b.rank_compute_ms.assign(ranks, 1.0);
      b.rank_compute_ms[ranks / 2] = 2.0;
      b.rank_compute_se_ms.assign(ranks, 0.01);
      b.rank_fixed_ms.assign(ranks, 5.0);
      const std::string id = "dp_decision_" + std::to_string(ranks);
      const std::string what = "data-parallel decision, " + std::to_string(ranks) + " ranks";
      fig["paths"].push_back(measure(id.c_str(), what.c_str(), n / 4, [&](int) {
        const int action = policy->act(decider.observe(b, false));
        return action + static_cast<int>(decider.decide(0).kind);  // kept: the same state
      }));
    }
    for (int stages : {4, 16, 64}) {
      // A pipeline of 8 equal blocks per stage, the middle stage at half speed: every decision
      // fits the model and has three candidates.
      const int blocks = 8 * stages;
      env::pp::PipelineModelOptions po;
      po.stages = stages;
      po.global_batch = 64;
      po.block_params.assign(blocks, 1000);
      po.block_bytes.assign(blocks, 4000000);
      po.microbatches = 8;
      env::dp::DataParallelOptions o;
      o.ranks = stages;
      o.global_batch = 64;
      o.warmup_steps = 0;
      env::dp::DataParallelDecider decider(o, std::make_unique<env::pp::PipelineModel>(po));
      for (uint64_t s = 0; s < 20; ++s) decider.observe_step(s, 100);
      parapilot::monitor::Beliefs b;
      for (int s = 0; s < stages; ++s) {
        const double block_ms = s == stages / 2 ? 4.0 : 2.0;
        b.rank_stage.push_back({8 * s, 8, 8, std::vector<double>(8, block_ms), 4.0, 4e6});
        b.rank_compute_ms.push_back(8 * block_ms + 1);
        b.rank_compute_se_ms.push_back(0.01);
      }
      const std::string id = "pp_decision_" + std::to_string(stages);
      const std::string what = "pipeline decision, " + std::to_string(stages) + " stages";
      fig["paths"].push_back(measure(id.c_str(), what.c_str(), n / 4, [&](int) {
        const int action = policy->act(decider.observe(b, false));
        return action + static_cast<int>(decider.decide(0).kind);  // kept: the same state
      }));
    }
  } else {
    std::printf("policy %s not found: only the fresh network is measured\n", path.c_str());
  }
  torch::manual_seed(1);
  pp::ActorCritic net;
  std::printf("network: %lld parameters\n", static_cast<long long>(net->parameter_count()));
  fig["parameters"] = static_cast<long long>(net->parameter_count());
  pp::FastActor fast(net);
  pp::ObservationNormalizer normalizer;
  for (int i = 0; i < 100; ++i) normalizer.update(obs[i]);
  fig["paths"].push_back(
      measure("fresh_hand_written", "fresh network, hand-written actor", n, [&](int i) {
        const auto l = fast.logits(normalizer.normalise(obs[i]));
        return pp::greedy_action(l.data(), env::kNumActions);
      }));
  fig["paths"].push_back(measure(
      "fresh_libtorch_forward", "fresh network, libtorch forward (batch 1)", n / 4, [&](int i) {
        c10::InferenceMode guard;
        const auto b = pp::to_batch({normalizer.normalise(obs[i])});
        const auto logits = net->forward(b.state, b.candidates, b.mask).logits.contiguous();
        return pp::greedy_action(logits.data_ptr<float>(), env::kNumActions);
      }));
  return report.write(json_path) ? 0 : 1;
}
