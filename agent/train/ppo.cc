#include "agent/train/ppo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <sstream>
#include <stdexcept>

#include <cereal/archives/json.hpp>
#include <cereal/types/string.hpp>

#include "env/env.h"
#include "policy/features.h"
#include "policy/learned.h"
#include "policy/network.h"
#include "core/error.h"

namespace parapilot::agent {

template <class Archive>
void serialize(Archive& ar, PpoConfig& c) {
  ar(cereal::make_nvp("env_ids", c.env_ids), cereal::make_nvp("total_steps", c.total_steps),
     cereal::make_nvp("envs", c.envs), cereal::make_nvp("threads", c.threads),
     cereal::make_nvp("seed", c.seed), cereal::make_nvp("learning_rate", c.learning_rate),
     cereal::make_nvp("final_learning_rate_fraction", c.final_learning_rate_fraction),
     cereal::make_nvp("gamma", c.gamma), cereal::make_nvp("gae_lambda", c.gae_lambda),
     cereal::make_nvp("clip", c.clip), cereal::make_nvp("entropy_coef", c.entropy_coef),
     cereal::make_nvp("value_coef", c.value_coef),
     cereal::make_nvp("max_grad_norm", c.max_grad_norm), cereal::make_nvp("epochs", c.epochs),
     cereal::make_nvp("minibatches", c.minibatches), cereal::make_nvp("hidden", c.hidden),
     cereal::make_nvp("reward_offset", c.reward_offset),
     cereal::make_nvp("validation_episodes", c.validation_episodes));
  // Added after the first shipped checkpoints: a config without it trained with none.
  if constexpr (Archive::is_loading::value) {
    try {
      ar(cereal::make_nvp("switch_penalty", c.switch_penalty));
    } catch (const cereal::Exception&) {  // absent: the name search fails before reading
      c.switch_penalty = 0.0;
    }
  } else {
    ar(cereal::make_nvp("switch_penalty", c.switch_penalty));
  }
}

namespace {

std::string config_json(const PpoConfig& c) {
  std::ostringstream out;
  {
    cereal::JSONOutputArchive ar(out);
    PpoConfig copy = c;
    ar(cereal::make_nvp("ppo", copy));
  }
  return out.str();
}

void check_config(const PpoConfig& c) {
  auto require = [](bool ok, const std::string& what) {
    if (!ok) throw InputError("training config: " + what);
  };
  require(c.envs >= 1 && c.envs <= 4096, "envs must be in [1, 4096]");
  require(c.threads >= 1 && c.threads <= 256, "threads must be in [1, 256]");
  require(c.total_steps >= 1, "steps must be >= 1");
  require(c.learning_rate > 0 && c.learning_rate < 1, "learning rate must be in (0, 1)");
  require(c.final_learning_rate_fraction >= 0 && c.final_learning_rate_fraction <= 1,
          "final learning-rate fraction must be in [0, 1]");
  require(c.gamma > 0 && c.gamma <= 1 && c.gae_lambda >= 0 && c.gae_lambda <= 1,
          "gamma and lambda must be in (0, 1]");
  require(c.clip > 0 && c.epochs >= 1 && c.minibatches >= 1,
          "clip, epochs and minibatches must be positive");
  require(c.hidden >= policy::kMinHidden && c.hidden <= policy::kMaxHidden,
          "hidden must be in [" + std::to_string(policy::kMinHidden) + ", " +
              std::to_string(policy::kMaxHidden) + "]");
  require(c.validation_episodes >= 0 && c.validation_episodes <= 1000,
          "validation episodes must be in [0, 1000]");
  require(!env::split_ids(c.env_ids).empty(), "name at least one env");
  require(static_cast<size_t>(c.envs) >= env::split_ids(c.env_ids).size(),
          "each parallel env runs one scenario: --envs " + std::to_string(c.envs) +
              " is fewer than the " + std::to_string(env::split_ids(c.env_ids).size()) +
              " scenarios named");
}

uint64_t mix(uint64_t a, uint64_t b) {
  // splitmix64 of a combination: independent streams per (seed, update, purpose).
  uint64_t z = a * 0x9E3779B97F4A7C15ULL + b + 0x632BE59BD9B4E5ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

std::string torch_bytes(const std::function<void(std::ostream&)>& save) {
  std::ostringstream out(std::ios::binary);
  save(out);
  return out.str();
}

policy::ActorCritic make_network(const PpoConfig& c) {
  policy::NetworkOptions o;
  o.hidden = c.hidden;
  return policy::ActorCritic(o);
}

void load_tensors(const std::string& where, const std::function<void()>& load) {
  try {
    load();
  } catch (const std::exception& e) {
    std::string what = e.what();
    if (const auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    throw InputError(where + ": " + what);
  }
}

}  // namespace

StatusOr<PpoConfig> config_of(const checkpoints::PolicyCheckpoint& checkpoint) {
  PpoConfig c;
  try {
    std::istringstream in(checkpoint.config);
    cereal::JSONInputArchive ar(in);
    ar(cereal::make_nvp("ppo", c));
  } catch (const std::exception& e) {  // cereal reports bad JSON by throwing
    return Status::invalid_argument("checkpoint: unreadable training config (" +
                                    std::string(e.what()) + ")");
  }
  return c;
}

struct PpoTrainer::State {
  PpoConfig config;
  std::vector<std::string> ids;
  policy::ActorCritic net{nullptr};
  std::unique_ptr<torch::optim::Adam> optimizer;
  policy::ObservationNormalizer normalizer;
  std::unique_ptr<env::VectorEnv> envs;
  int horizon = 0;
  int64_t step = 0, update = 0;
  double elapsed_s = 0;
  // Validation: envs, their seeds and the oracle's tokens per episode.
  std::unique_ptr<env::VectorEnv> validation;
  std::vector<double> validation_oracle;

  void init_envs() {
    at::set_num_threads(1);
    ids = env::split_ids(config.env_ids);
    std::vector<std::unique_ptr<env::Env>> list;
    for (int i = 0; i < config.envs; ++i) list.push_back(take(env::make_env(ids[i % ids.size()])));
    horizon = list.front()->horizon();
    for (const auto& e : list) {
      if (e->horizon() != horizon)
        throw InputError("training envs must share one horizon (" + config.env_ids + ")");
    }
    envs = std::make_unique<env::VectorEnv>(std::move(list), config.threads);
  }

  void init_optimizer() {
    optimizer = std::make_unique<torch::optim::Adam>(
        net->parameters(), torch::optim::AdamOptions(config.learning_rate).eps(1e-5));
  }

  void init_validation() {
    if (config.validation_episodes == 0) return;
    std::vector<std::unique_ptr<env::Env>> list;
    for (const auto& id : ids) {
      for (int k = 0; k < config.validation_episodes; ++k) list.push_back(take(env::make_env(id)));
    }
    validation = std::make_unique<env::VectorEnv>(std::move(list), config.threads);
    take(validation->reset(kValidationSeed));
    for (int i = 0; i < validation->size(); ++i) {
      env::Env& e = validation->env(i);
      const auto oracle = e.oracle();
      double tokens = 0;
      if (oracle) {
        for (double t : oracle->tokens_per_interval) tokens += t;
      }
      validation_oracle.push_back(tokens);
    }
  }

  double learning_rate() const {
    const double progress =
        std::min(1.0, static_cast<double>(step) / static_cast<double>(config.total_steps));
    return config.learning_rate * (1.0 - (1.0 - config.final_learning_rate_fraction) * progress);
  }
};

PpoTrainer::PpoTrainer() : s_(std::make_unique<State>()) {}

StatusOr<std::unique_ptr<PpoTrainer>> PpoTrainer::start(const PpoConfig& config) {
  return catch_input_error([&] {
    std::unique_ptr<PpoTrainer> trainer(new PpoTrainer());
    State& s = *trainer->s_;
    check_config(config);
    s.config = config;
    s.init_envs();
    torch::manual_seed(config.seed);
    s.net = make_network(config);
    s.init_optimizer();
    s.init_validation();
    return trainer;
  });
}

StatusOr<std::unique_ptr<PpoTrainer>> PpoTrainer::resume(const checkpoints::PolicyCheckpoint& checkpoint,
                                                         int64_t total_steps_override) {
  return catch_input_error([&] {
    std::unique_ptr<PpoTrainer> trainer(new PpoTrainer());
    trainer->resume_from(checkpoint, total_steps_override);
    return trainer;
  });
}

void PpoTrainer::resume_from(const checkpoints::PolicyCheckpoint& checkpoint,
                             int64_t total_steps_override) {
  PpoConfig config = take(config_of(checkpoint));
  if (total_steps_override > 0) config.total_steps = total_steps_override;
  check_config(config);
  if (checkpoint.optimizer.empty()) {
    throw InputError(
        "checkpoint holds no optimizer state (an inference-only policy cannot be resumed)");
  }
  s_->config = config;
  s_->init_envs();
  torch::manual_seed(config.seed);
  s_->net = make_network(config);
  s_->init_optimizer();
  load_tensors("checkpoint weights", [&] {
    std::istringstream in(checkpoint.model, std::ios::binary);
    torch::load(s_->net, in);
  });
  load_tensors("checkpoint optimizer state", [&] {
    std::istringstream in(checkpoint.optimizer, std::ios::binary);
    torch::load(*s_->optimizer, in);
  });
  s_->normalizer = checkpoint.normalizer;
  s_->step = checkpoint.step;
  s_->update = checkpoint.update;
  if (auto it = checkpoint.metrics.find("elapsed_s"); it != checkpoint.metrics.end())
    s_->elapsed_s = it->second;
  s_->init_validation();
}

PpoTrainer::~PpoTrainer() = default;

const PpoConfig& PpoTrainer::config() const { return s_->config; }
bool PpoTrainer::done() const { return s_->step >= s_->config.total_steps; }
int64_t PpoTrainer::step() const { return s_->step; }
int64_t PpoTrainer::update_index() const { return s_->update; }
int PpoTrainer::steps_per_update() const { return s_->config.envs * s_->horizon; }
int64_t PpoTrainer::parameter_count() const { return s_->net->parameter_count(); }

StatusOr<UpdateReport> PpoTrainer::update() {
  State& s = *s_;
  const auto start = std::chrono::steady_clock::now();
  const PpoConfig& c = s.config;
  const int E = c.envs, T = s.horizon, N = E * T;
  std::mt19937_64 action_rng(mix(c.seed, static_cast<uint64_t>(s.update) * 2 + 0));
  std::mt19937_64 shuffle_rng(mix(c.seed, static_cast<uint64_t>(s.update) * 2 + 1));

  // Rollout: one episode per env, time-major buffers [T][E].
  std::vector<env::Observation> buffer(static_cast<size_t>(N));
  std::vector<int64_t> actions(N);
  std::vector<float> old_logp(N), values(N), rewards(N);
  double reward_sum = 0;
  const uint64_t base_seed = (1ULL << 40) + (c.seed << 24) + static_cast<uint64_t>(s.update) * E;
  auto started = s.envs->reset(base_seed);
  if (!started.ok()) return started.status();
  std::vector<env::Observation> obs = std::move(*started);
  std::vector<int> act(E);
  torch::NoGradGuard no_grad;
  for (int t = 0; t < T; ++t) {
    for (const auto& o : obs) s.normalizer.update(o);
    for (int i = 0; i < E; ++i) buffer[t * E + i] = s.normalizer.normalise(obs[i]);
    const std::vector<env::Observation> now(buffer.begin() + t * E, buffer.begin() + (t + 1) * E);
    const policy::ObservationBatch b = policy::to_batch(now);
    const policy::ActorCriticOutput out = s.net->forward(b.state, b.candidates, b.mask);
    const torch::Tensor logits = out.logits.contiguous();
    const torch::Tensor logp_all = torch::log_softmax(logits, 1);
    const float* l = logits.data_ptr<float>();
    const float* lp = logp_all.data_ptr<float>();
    const float* v = out.value.data_ptr<float>();
    for (int i = 0; i < E; ++i) {
      act[i] = policy::sample_action(l + i * env::kNumActions, env::kNumActions, action_rng);
      actions[t * E + i] = act[i];
      old_logp[t * E + i] = lp[i * env::kNumActions + act[i]];
      values[t * E + i] = v[i];
    }
    const auto stepped = s.envs->step(act);
    if (!stepped.ok()) return stepped.status();
    const std::vector<env::StepResult>& results = *stepped;
    for (int i = 0; i < E; ++i) {
      reward_sum += results[i].reward;
      const double penalty = results[i].info.migration_started ? c.switch_penalty : 0.0;
      rewards[t * E + i] = static_cast<float>(results[i].reward - c.reward_offset - penalty);
      obs[i] = results[i].observation;
    }
  }
  // GAE: every episode ends at t = T-1 (fixed horizon), so nothing is bootstrapped past it.
  std::vector<float> advantages(N), returns(N);
  for (int i = 0; i < E; ++i) {
    double gae = 0;
    for (int t = T - 1; t >= 0; --t) {
      const double value = static_cast<double>(values[t * E + i]);
      const double next_value = t + 1 < T ? static_cast<double>(values[(t + 1) * E + i]) : 0.0;
      const double delta = static_cast<double>(rewards[t * E + i]) + c.gamma * next_value - value;
      gae = delta + c.gamma * c.gae_lambda * gae;
      advantages[t * E + i] = static_cast<float>(gae);
      returns[t * E + i] = static_cast<float>(gae + value);
    }
  }

  // Optimisation.
  const policy::ObservationBatch all = policy::to_batch(buffer);
  const torch::Tensor t_actions = torch::from_blob(actions.data(), {N}, torch::kLong).clone();
  const torch::Tensor t_old_logp = torch::from_blob(old_logp.data(), {N}).clone();
  const torch::Tensor t_adv = torch::from_blob(advantages.data(), {N}).clone();
  const torch::Tensor t_ret = torch::from_blob(returns.data(), {N}).clone();
  const double lr = s.learning_rate();
  for (auto& group : s.optimizer->param_groups()) {
    static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
  }
  UpdateReport report;
  std::vector<int64_t> order(N);
  const int M = std::max(1, N / c.minibatches);
  int batches = 0;
  for (int epoch = 0; epoch < c.epochs; ++epoch) {
    for (int i = 0; i < N; ++i) order[i] = i;
    for (int i = N - 1; i > 0; --i) {  // Fisher-Yates with our own draw: the same everywhere
      const int j = static_cast<int>(shuffle_rng() % static_cast<uint64_t>(i + 1));
      std::swap(order[i], order[j]);
    }
    for (int first = 0; first + M <= N; first += M) {
      const torch::Tensor idx = torch::from_blob(order.data() + first, {M}, torch::kLong).clone();
      torch::AutoGradMode grad(true);
      const policy::ActorCriticOutput out =
          s.net->forward(all.state.index_select(0, idx), all.candidates.index_select(0, idx),
                         all.mask.index_select(0, idx));
      const torch::Tensor logp_all = torch::log_softmax(out.logits, 1);
      const torch::Tensor a = t_actions.index_select(0, idx);
      const torch::Tensor logp = logp_all.gather(1, a.unsqueeze(1)).squeeze(1);
      const torch::Tensor old = t_old_logp.index_select(0, idx);
      torch::Tensor adv = t_adv.index_select(0, idx);
      adv = (adv - adv.mean()) / (adv.std() + 1e-8);
      const torch::Tensor ratio = torch::exp(logp - old);
      const torch::Tensor surrogate =
          -torch::min(ratio * adv, torch::clamp(ratio, 1.0 - c.clip, 1.0 + c.clip) * adv).mean();
      const torch::Tensor value_loss = 0.5 * (out.value - t_ret.index_select(0, idx)).pow(2).mean();
      const torch::Tensor entropy = -(torch::softmax(out.logits, 1) * logp_all).sum(1).mean();
      const torch::Tensor loss = surrogate + c.value_coef * value_loss - c.entropy_coef * entropy;
      s.optimizer->zero_grad();
      loss.backward();
      torch::nn::utils::clip_grad_norm_(s.net->parameters(), c.max_grad_norm);
      s.optimizer->step();
      {
        torch::NoGradGuard ng;
        report.policy_loss += surrogate.item<double>();
        report.value_loss += value_loss.item<double>();
        report.entropy += entropy.item<double>();
        report.approx_kl += (old - logp).mean().item<double>();
        report.clip_fraction +=
            ((ratio - 1.0).abs() > c.clip).to(torch::kFloat).mean().item<double>();
      }
      ++batches;
    }
  }
  report.policy_loss /= batches;
  report.value_loss /= batches;
  report.entropy /= batches;
  report.approx_kl /= batches;
  report.clip_fraction /= batches;
  s.step += N;
  ++s.update;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  s.elapsed_s += seconds;
  report.update = s.update;
  report.step = s.step;
  report.elapsed_s = s.elapsed_s;
  report.steps_per_s = N / std::max(seconds, 1e-9);
  report.mean_reward = reward_sum / N;
  report.episode_reward = reward_sum / E;
  report.learning_rate = lr;
  return report;
}

StatusOr<ValidationReport> PpoTrainer::validate() {
  State& s = *s_;
  ValidationReport report;
  if (!s.validation) return report;
  const auto start = std::chrono::steady_clock::now();
  const int V = s.validation->size();
  policy::FastActor actor(s.net);
  auto first = s.validation->reset(kValidationSeed);
  if (!first.ok()) return first.status();
  std::vector<env::Observation> obs = std::move(*first);
  std::vector<double> tokens(V, 0.0);
  std::vector<int> act(V);
  for (int t = 0; t < s.horizon; ++t) {
    for (int i = 0; i < V; ++i) {
      const auto logits = actor.logits(s.normalizer.normalise(obs[i]));
      act[i] = policy::greedy_action(logits.data(), env::kNumActions);
    }
    const auto stepped = s.validation->step(act);
    if (!stepped.ok()) return stepped.status();
    const std::vector<env::StepResult>& results = *stepped;
    for (int i = 0; i < V; ++i) {
      tokens[i] += results[i].info.tokens;
      obs[i] = results[i].observation;
    }
  }
  std::map<std::string, int> count;
  for (int i = 0; i < V; ++i) {
    const double score = s.validation_oracle[i] > 0 ? tokens[i] / s.validation_oracle[i] : 0.0;
    const std::string& id = s.ids[static_cast<size_t>(i / s.config.validation_episodes)];
    report.by_env[id] += score;
    ++count[id];
    report.score += score / V;
  }
  for (auto& [id, v] : report.by_env) v /= count[id];
  // Validation time counts towards the run's wall time (it is part of training's cost).
  s.elapsed_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

checkpoints::PolicyCheckpoint PpoTrainer::checkpoint(const std::map<std::string, double>& metrics) const {
  const State& s = *s_;
  checkpoints::PolicyCheckpoint c;
  c.env_id = s.config.env_ids;
  c.config = config_json(s.config);
  c.step = s.step;
  c.update = s.update;
  c.metrics = metrics;
  c.metrics["elapsed_s"] = s.elapsed_s;
  c.normalizer = s.normalizer;
  c.model = torch_bytes([&](std::ostream& out) { torch::save(s.net, out); });
  c.optimizer = torch_bytes([&](std::ostream& out) { torch::save(*s.optimizer, out); });
  return c;
}

std::vector<float> PpoTrainer::parameters() const {
  std::vector<float> out;
  for (const auto& p : s_->net->parameters()) {
    const torch::Tensor t = p.detach().contiguous();
    out.insert(out.end(), t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
  }
  return out;
}

std::unique_ptr<policy::Policy> PpoTrainer::greedy_policy() const {
  return std::make_unique<policy::LearnedPolicy>(s_->net, s_->normalizer);
}

}  // namespace parapilot::agent
