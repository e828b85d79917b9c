// PPO training of the scheduling policy (loading trained policies: policy/loader.h).
//
// PpoTrainer runs proximal policy optimisation (clipped surrogate, value loss, entropy bonus,
// GAE, per-minibatch advantage normalisation, running observation normalisation, gradient-norm
// clipping, a linearly decaying learning rate) over vectorised rollouts: each update runs one
// whole episode in each of `envs` envs on a thread pool (env::VectorEnv), then optimises.
//
// Determinism: the same config (seed included) gives the same run, bit for bit, on one machine:
// weights are initialised from torch::manual_seed(seed); actions are sampled and minibatches
// shuffled with std::mt19937_64 streams seeded from (seed, update); episode seeds are a function
// of (seed, update, env index); libtorch runs one intra-op thread (at::set_num_threads(1)).
// Because every update starts fresh episodes and all random streams are keyed by the update
// index, a run resumed from a checkpoint continues exactly as if it had not stopped.
//
// Seeds: training episodes use seeds >= 2^40; validation episodes use kValidationSeed + i; the
// eval CLI's held-out episodes use small seeds (1000 by default), so none overlap.
//
// This header does not include libtorch; a trainer and a loaded policy are not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "policy/policy.h"
#include "checkpoints/checkpoint.h"

namespace parapilot::agent {

inline constexpr uint64_t kValidationSeed = 900000;

struct PpoConfig {
  std::string env_ids = "sim:mixed";  // comma-separated env ids; env i runs id i mod count
  int64_t total_steps = 200000;       // env steps over the whole run
  int envs = 8;                       // parallel envs (episodes per update)
  int threads = 2;                    // env worker threads
  uint64_t seed = 1;
  double learning_rate = 3e-4;                // at the start; decays linearly ...
  double final_learning_rate_fraction = 0.1;  // ... to this fraction at total_steps
  double gamma = 0.99;
  double gae_lambda = 0.95;
  double clip = 0.2;
  double entropy_coef = 0.01;
  double value_coef = 0.5;
  double max_grad_norm = 0.5;
  int epochs = 4;
  int minibatches = 4;
  int hidden = 64;
  // The learner sees reward - reward_offset: with reward = tokens / best tokens, an offset of 1
  // makes it the per-interval loss against the best layout, keeping value targets small.
  // Episodes have a fixed length, so the offset does not change the optimal policy.
  double reward_offset = 1.0;
  // Subtracted from the learner's reward of each interval in which a switch starts: a
  // regulariser against switching between layouts of equal worth (thrashing), not a cost the
  // env models (validation and eval score throughput alone). 0: none.
  double switch_penalty = 0.0;
  int validation_episodes = 8;  // per env id; greedy policy, scored against the oracle
};

// Figures of one update.
struct UpdateReport {
  int64_t update = 0;
  int64_t step = 0;
  double elapsed_s = 0;       // wall time of the run so far (continues across resumes)
  double steps_per_s = 0;     // of this update
  double mean_reward = 0;     // mean per-step env reward of the rollout
  double episode_reward = 0;  // mean summed env reward per episode
  double policy_loss = 0, value_loss = 0, entropy = 0, approx_kl = 0, clip_fraction = 0;
  double learning_rate = 0;
};

struct ValidationReport {
  double score = 0;                      // mean policy / oracle throughput
  std::map<std::string, double> by_env;  // the same per env id
};

class PpoTrainer {
 public:
  // A fresh run: kInvalidArgument naming a bad config value or env id.
  static StatusOr<std::unique_ptr<PpoTrainer>> start(const PpoConfig& config);
  // Continues the run saved in `checkpoint`. total_steps may be raised by
  // `total_steps_override` (> 0); that changes the learning-rate schedule. kInvalidArgument
  // when the checkpoint holds no optimizer state (an inference-only policy), an unreadable
  // config or tensors, or a config start() would refuse.
  static StatusOr<std::unique_ptr<PpoTrainer>> resume(const checkpoints::PolicyCheckpoint& checkpoint,
                                                      int64_t total_steps_override = 0);
  ~PpoTrainer();
  PpoTrainer(const PpoTrainer&) = delete;
  PpoTrainer& operator=(const PpoTrainer&) = delete;

  const PpoConfig& config() const;
  bool done() const;  // total_steps reached
  int64_t step() const;
  int64_t update_index() const;
  int steps_per_update() const;
  int64_t parameter_count() const;

  // One rollout (an episode per env) and its optimisation. Errors: an env's episode could not
  // start (env::Env::reset); the update is then not applied.
  StatusOr<UpdateReport> update();
  // The greedy policy on the validation episodes. Does not change the training state. Errors as
  // update().
  StatusOr<ValidationReport> validate();

  // A checkpoint of the current state; `metrics` are stored with it.
  checkpoints::PolicyCheckpoint checkpoint(const std::map<std::string, double>& metrics) const;
  // All network parameters, flattened (for tests comparing runs).
  std::vector<float> parameters() const;
  // The current greedy policy (a snapshot; later updates do not change it).
  std::unique_ptr<policy::Policy> greedy_policy() const;

 private:
  struct State;
  PpoTrainer();
  void resume_from(const checkpoints::PolicyCheckpoint& checkpoint, int64_t total_steps_override);
  std::unique_ptr<State> s_;
};

// The config stored in a checkpoint: kInvalidArgument when unreadable.
StatusOr<PpoConfig> config_of(const checkpoints::PolicyCheckpoint& checkpoint);

}  // namespace parapilot::agent
