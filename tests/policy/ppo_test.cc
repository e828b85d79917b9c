// The PPO trainer: learns a known optimum, is deterministic for its seed, and resumes exactly.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "policy/baselines.h"
#include "agent/train/evaluate.h"
#include "agent/train/ppo.h"
#include "policy/loader.h"
#include "policy/lookahead.h"
#include "checkpoints/checkpoint.h"
#include "env/env.h"
#include "core/error.h"
#include "tests/test_util.h"

using parapilot::testing::failure_of;
using parapilot::testing::ok;

namespace ag = parapilot::agent;
namespace cp = parapilot::checkpoints;

namespace {

ag::PpoConfig bandit_config() {
  ag::PpoConfig c;
  c.env_ids = "bandit(horizon=16,best=3)";
  c.envs = 8;
  c.threads = 2;
  c.total_steps = 8 * 16 * 60;
  c.learning_rate = 3e-3;
  c.seed = 42;
  c.hidden = 16;
  c.validation_episodes = 2;
  return c;
}

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("parapilot-ppo-tests-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

}  // namespace

TEST_CASE("ppo: learns the best arm of a bandit (known optimum)") {
  const auto started = ok(ag::PpoTrainer::start(bandit_config()));
  ag::PpoTrainer& trainer = *started;
  while (!trainer.done()) ok(trainer.update());
  auto policy = trainer.greedy_policy();
  auto bandit = ok(parapilot::env::make_env("bandit(horizon=16,best=3)"));
  const ag::EpisodeStats stats = ok(ag::run_episode(*bandit, *policy, 7));
  const ag::EpisodeStats oracle = ok(ag::run_oracle(*bandit, 7));
  CHECK(stats.mean_reward > 0.95);
  REQUIRE(oracle.throughput_tokens_per_s > 0);
  // The known optimum, nearly: the greedy policy's throughput against the hindsight oracle's.
  CHECK(stats.throughput_tokens_per_s >= 0.95 * oracle.throughput_tokens_per_s);
  CHECK(ok(trainer.validate()).score > 0.95);
  parapilot::env::Observation o;
  o.state[0] = 1.0f;
  o.mask.fill(1);
  CHECK(policy->act(o) == 3);
}

TEST_CASE("ppo: the same seed gives the same run; another seed another") {
  ag::PpoConfig c = bandit_config();
  c.total_steps = 8 * 16 * 3;
  const auto started_a = ok(ag::PpoTrainer::start(c));
  const auto started_b = ok(ag::PpoTrainer::start(c));
  ag::PpoTrainer &a = *started_a, &b = *started_b;
  for (int i = 0; i < 3; ++i) {
    const auto ra = ok(a.update());
    const auto rb = ok(b.update());
    CHECK(ra.mean_reward == rb.mean_reward);
    CHECK(ra.policy_loss == rb.policy_loss);
  }
  CHECK(a.parameters() == b.parameters());
  c.seed = 43;
  const auto started_other = ok(ag::PpoTrainer::start(c));
  ag::PpoTrainer& other = *started_other;
  ok(other.update());
  CHECK(other.parameters() != a.parameters());
}

TEST_CASE("ppo: a run resumed from a checkpoint continues exactly as if it had not stopped") {
  ag::PpoConfig c = bandit_config();
  c.total_steps = 8 * 16 * 6;
  const auto started = ok(ag::PpoTrainer::start(c));
  ag::PpoTrainer& straight = *started;
  for (int i = 0; i < 3; ++i) ok(straight.update());
  const std::string path = temp_path("resume.ckpt");
  REQUIRE(cp::write_checkpoint(path, straight.checkpoint({{"validation_score", 0.5}})).ok());
  std::vector<ag::UpdateReport> expected;
  while (!straight.done()) expected.push_back(ok(straight.update()));

  const auto saved = cp::read_checkpoint(path);
  REQUIRE(saved.ok());
  const auto resumed_started = ok(ag::PpoTrainer::resume(*saved));
  ag::PpoTrainer& resumed = *resumed_started;
  CHECK(resumed.step() == 8 * 16 * 3);
  CHECK(resumed.update_index() == 3);
  size_t k = 0;
  while (!resumed.done()) {
    const auto r = ok(resumed.update());
    REQUIRE(k < expected.size());
    CHECK(r.mean_reward == expected[k].mean_reward);
    CHECK(r.policy_loss == expected[k].policy_loss);
    CHECK(r.value_loss == expected[k].value_loss);
    CHECK(r.learning_rate == expected[k].learning_rate);
    ++k;
  }
  CHECK(k == expected.size());
  CHECK(resumed.parameters() == straight.parameters());
}

TEST_CASE("ppo: a trained policy loads from its checkpoint and acts as the trainer's") {
  ag::PpoConfig c = bandit_config();
  c.total_steps = 8 * 16 * 2;
  const auto started = ok(ag::PpoTrainer::start(c));
  ag::PpoTrainer& trainer = *started;
  while (!trainer.done()) ok(trainer.update());
  const std::string path = temp_path("policy.ckpt");
  REQUIRE(cp::write_checkpoint(path, trainer.checkpoint({})).ok());
  auto read = parapilot::policy::load_policy(path);
  REQUIRE(read.ok());
  auto loaded = std::move(*read);
  auto live = trainer.greedy_policy();
  CHECK(loaded->name() == "rl");
  parapilot::env::Observation o;
  o.state[0] = 1.0f;
  o.mask.fill(1);
  for (int t = 0; t < 16; ++t) {
    o.state[1] = static_cast<float>(t / 16.0);
    CHECK(loaded->act(o) == live->act(o));
  }
  CHECK(ok(ag::config_of(ok(cp::read_checkpoint(path)))).seed == 42);
}

TEST_CASE("ppo: a switch penalty above the best arm's advantage makes staying the optimum") {
  // Arms 1.. start a switch: arm 3 pays 1.0, staying (arm 0) 0.2. Less 1.0 per switch, staying
  // is best; the penalty is the learner's alone, and it is kept in the checkpoint's config.
  ag::PpoConfig c = bandit_config();
  c.switch_penalty = 1.0;
  const auto started = ok(ag::PpoTrainer::start(c));
  ag::PpoTrainer& trainer = *started;
  while (!trainer.done()) ok(trainer.update());
  auto policy = trainer.greedy_policy();
  parapilot::env::Observation o;
  o.state[0] = 1.0f;
  o.mask.fill(1);
  CHECK(policy->act(o) == 0);
  const std::string path = temp_path("penalised.ckpt");
  REQUIRE(cp::write_checkpoint(path, trainer.checkpoint({})).ok());
  CHECK(ok(ag::config_of(ok(cp::read_checkpoint(path)))).switch_penalty == 1.0);
}

TEST_CASE("ppo: a checkpoint trained before switch penalties reads as trained without one") {
  const auto started = ok(ag::PpoTrainer::start(bandit_config()));
  cp::PolicyCheckpoint checkpoint = started->checkpoint({});
  // The config as written before the field existed: the same JSON without its last member.
  std::string& config = checkpoint.config;
  const size_t field = config.find("\"switch_penalty\"");
  REQUIRE(field != std::string::npos);
  const size_t comma = config.rfind(',', field);
  const size_t end = config.find_first_of("\n}", field);
  REQUIRE(comma != std::string::npos);
  config.erase(comma, end - comma);
  REQUIRE(config.find("switch_penalty") == std::string::npos);
  const ag::PpoConfig c = ok(ag::config_of(checkpoint));
  CHECK(c.switch_penalty == 0.0);
  CHECK(c.seed == 42);
  CHECK(c.validation_episodes == 2);
}

TEST_CASE("ppo: bad configs and env ids are input errors") {
  ag::PpoConfig c = bandit_config();
  c.envs = 0;
  CHECK(failure_of(ag::PpoTrainer::start(c)) != "");
  c = bandit_config();
  c.env_ids = "nosuchenv";
  CHECK(failure_of(ag::PpoTrainer::start(c)) != "");
}

TEST_CASE("ppo: the shipped default policy loads and is not significantly worse than reactive "
          "or lookahead, the strongest rule, on mixed") {
  auto shipped = parapilot::policy::load_policy(parapilot::policy::default_policy_path());
  REQUIRE_MESSAGE(shipped.ok(), shipped.status().message());
  auto policy = std::move(*shipped);
  auto env = ok(parapilot::env::make_env("sim:mixed"));
  auto reactive = parapilot::policy::make_reactive({});
  auto lookahead = ok(parapilot::policy::make_lookahead(*env, {}));
  // Paired on the same seeds: per episode, rl's score against the oracle minus the rule's.
  const int episodes = 10;
  std::vector<double> rl, re, la;
  for (uint64_t seed = 1000; seed < 1000 + episodes; ++seed) {
    const double oracle = ok(ag::run_oracle(*env, seed)).throughput_tokens_per_s;
    rl.push_back(ok(ag::run_episode(*env, *policy, seed)).throughput_tokens_per_s / oracle);
    re.push_back(ok(ag::run_episode(*env, *reactive, seed)).throughput_tokens_per_s / oracle);
    la.push_back(ok(ag::run_episode(*env, *lookahead, seed)).throughput_tokens_per_s / oracle);
  }
  const auto paired = [&](const std::vector<double>& rule) {
    std::vector<double> diff;
    for (std::size_t i = 0; i < rl.size(); ++i) diff.push_back(rl[i] - rule[i]);
    return ag::mean_interval(diff);
  };
  const auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return s / static_cast<double>(v.size());
  };
  const auto vs_reactive = paired(re), vs_lookahead = paired(la);
  std::printf("shipped policy on mixed, seeds 1000-1009: %.4f of the oracle; reactive %.4f "
              "(paired difference %+.4f +- %.4f, 95%%); lookahead %.4f (%+.4f +- %.4f)\n",
              mean(rl), mean(re), vs_reactive.mean, vs_reactive.half_width, mean(la),
              vs_lookahead.mean, vs_lookahead.half_width);
  // Parity, not a win (issue 17): no rule may be significantly better, i.e. each paired
  // interval's upper end is at or above zero. Retrain and replace checkpoints/default-mixed.ckpt
  // when the simulator or the observation changes enough to break this (docs/policy.md).
  CHECK(vs_reactive.mean + vs_reactive.half_width >= 0);
  CHECK(vs_lookahead.mean + vs_lookahead.half_width >= 0);
}
