// The actor-critic network of the scheduling policy (libtorch).
//
// An encoder turns the (normalised) state vector into an embedding; a candidate scorer, one
// MLP over [state embedding, candidate features, candidate rank] shared by every candidate,
// gives one logit per candidate; a keep head gives the logit of "keep"; a value head estimates
// the return. Because the scorer is shared, the number of candidates may differ from
// env::kMaxCandidates (up to kMaxRanks), and the state vector does not depend on the cluster
// size. Missing candidates (mask 0) get a logit of kMaskedLogit, i.e. probability 0.
//
// Logit order: [keep, candidate 0, candidate 1, ...] — the env's action numbering.
// A module is not thread-safe for training; concurrent forward passes under NoGradGuard are.
#pragma once

#include <array>
#include <cstdint>
#include <random>
#include <vector>

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wpedantic"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wdouble-promotion"
#include <torch/torch.h>
#pragma GCC diagnostic pop

#include "env/env.h"

namespace parapilot::policy {

inline constexpr int kMaxRanks = 16;          // most candidates one decision may score
inline constexpr int kMinHidden = 4;          // narrowest hidden layer a network may have
inline constexpr int kMaxHidden = 512;        // widest (FastActor's stack buffers)
inline constexpr float kMaskedLogit = -1e9f;  // logit of a missing candidate

struct NetworkOptions {
  int state_dim = env::kStateDim;
  int candidate_dim = env::kCandidateDim;
  int hidden = 64;         // width of every hidden layer, in [kMinHidden, kMaxHidden]
  double keep_bias = 1.0;  // initial bias of the keep logit (favours keeping at first)
};

struct ActorCriticOutput {
  torch::Tensor logits;  // [B, 1 + K]
  torch::Tensor value;   // [B]
};

class ActorCriticImpl : public torch::nn::Module {
 public:
  explicit ActorCriticImpl(const NetworkOptions& options = {});

  // state [B, state_dim]; candidates [B, K, candidate_dim]; mask [B, K] (bool or 0/1).
  ActorCriticOutput forward(const torch::Tensor& state, const torch::Tensor& candidates,
                            const torch::Tensor& mask);

  const NetworkOptions& options() const { return options_; }
  int64_t parameter_count() const;

 private:
  NetworkOptions options_;
  torch::nn::Linear enc1_{nullptr}, enc2_{nullptr};
  torch::nn::Linear score_state_{nullptr}, score_candidate_{nullptr}, score_out_{nullptr};
  torch::nn::Embedding score_rank_{nullptr};
  torch::nn::Linear keep1_{nullptr}, keep_out_{nullptr};
  torch::nn::Linear value1_{nullptr}, value_out_{nullptr};
  friend class FastActor;
};
TORCH_MODULE(ActorCritic);

// Tensors of a batch of (already normalised) observations.
struct ObservationBatch {
  torch::Tensor state, candidates, mask;
};
ObservationBatch to_batch(const std::vector<env::Observation>& observations);

// Index of the largest logit among allowed actions (keep is always allowed).
int greedy_action(const float* logits, int num_actions);
// Samples an action from softmax(logits); masked logits have probability 0.
int sample_action(const float* logits, int num_actions, std::mt19937_64& rng);

// A copy of the actor's weights as plain floats with a hand-written forward pass: one decision
// in a few microseconds, no libtorch dispatch, safe to share between threads. Produces the same
// logits as the module up to float rounding.
class FastActor {
 public:
  // Precondition: the network's hidden width is at most kMaxHidden (the checkpoint loader and
  // the training config check it).
  explicit FastActor(ActorCritic& network);
  // Logits [keep, candidate 0..kMaxCandidates-1] of one normalised observation.
  std::array<float, env::kNumActions> logits(const env::Observation& o) const;

 private:
  struct Layer {
    int in = 0, out = 0;
    std::vector<float> w, b;  // w row-major [out][in]
    void apply(const float* x, float* y) const;
  };
  Layer enc1_, enc2_, score_state_, score_candidate_, score_out_, keep1_, keep_out_;
  std::vector<float> rank_;  // [kMaxRanks][hidden]
  int hidden_ = 0;
};

}  // namespace parapilot::policy
