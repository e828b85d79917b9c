#include "policy/network.h"

#include <algorithm>
#include <cmath>
#include <cassert>
#include <cstdio>
#include <cstdlib>

namespace parapilot::policy {

ActorCriticImpl::ActorCriticImpl(const NetworkOptions& options) : options_(options) {
  const int64_t h = options.hidden;
  enc1_ = register_module("enc1", torch::nn::Linear(options.state_dim, h));
  enc2_ = register_module("enc2", torch::nn::Linear(h, h));
  score_state_ = register_module("score_state", torch::nn::Linear(h, h));
  score_candidate_ =
      register_module("score_candidate", torch::nn::Linear(options.candidate_dim, h));
  score_rank_ = register_module("score_rank", torch::nn::Embedding(kMaxRanks, h));
  score_out_ = register_module("score_out", torch::nn::Linear(h, 1));
  keep1_ = register_module("keep1", torch::nn::Linear(h, h));
  keep_out_ = register_module("keep_out", torch::nn::Linear(h, 1));
  value1_ = register_module("value1", torch::nn::Linear(h, h));
  value_out_ = register_module("value_out", torch::nn::Linear(h, 1));
  // Small output layers: the first policy is near uniform over candidates, keep favoured.
  torch::NoGradGuard no_grad;
  score_rank_->weight.mul_(0.1);
  score_out_->weight.mul_(0.01);
  score_out_->bias.zero_();
  keep_out_->weight.mul_(0.01);
  keep_out_->bias.fill_(options.keep_bias);
}

ActorCriticOutput ActorCriticImpl::forward(const torch::Tensor& state,
                                           const torch::Tensor& candidates,
                                           const torch::Tensor& mask) {
  const int64_t K = candidates.size(1);
  assert(K <= kMaxRanks && "ActorCritic: more candidates than kMaxRanks");
  const torch::Tensor h = torch::tanh(enc2_(torch::tanh(enc1_(state))));  // [B, H]
  // The scorer's first layer over [h, candidate, rank] as a sum of three projections.
  const torch::Tensor ranks = torch::arange(K, torch::kLong);
  const torch::Tensor z = torch::tanh(score_state_(h).unsqueeze(1) + score_candidate_(candidates) +
                                      score_rank_(ranks).unsqueeze(0));  // [B, K, H]
  torch::Tensor scores = score_out_(z).squeeze(-1);                      // [B, K]
  scores = scores.masked_fill(mask.to(torch::kBool).logical_not(), kMaskedLogit);
  const torch::Tensor keep = keep_out_(torch::tanh(keep1_(h)));  // [B, 1]
  ActorCriticOutput out;
  out.logits = torch::cat({keep, scores}, 1);
  out.value = value_out_(torch::tanh(value1_(h))).squeeze(-1);
  return out;
}

int64_t ActorCriticImpl::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

ObservationBatch to_batch(const std::vector<env::Observation>& observations) {
  const int64_t B = static_cast<int64_t>(observations.size());
  ObservationBatch b;
  b.state = torch::empty({B, env::kStateDim});
  b.candidates = torch::empty({B, env::kMaxCandidates, env::kCandidateDim});
  b.mask = torch::empty({B, env::kMaxCandidates}, torch::kBool);
  float* s = b.state.data_ptr<float>();
  float* c = b.candidates.data_ptr<float>();
  bool* m = b.mask.data_ptr<bool>();
  for (int64_t i = 0; i < B; ++i) {
    const env::Observation& o = observations[i];
    std::copy(o.state.begin(), o.state.end(), s + i * env::kStateDim);
    std::copy(o.candidates.begin(), o.candidates.end(),
              c + i * env::kMaxCandidates * env::kCandidateDim);
    for (int k = 0; k < env::kMaxCandidates; ++k) m[i * env::kMaxCandidates + k] = o.mask[k] != 0;
  }
  return b;
}

int greedy_action(const float* logits, int num_actions) {
  int best = 0;
  for (int a = 1; a < num_actions; ++a) {
    if (logits[a] > kMaskedLogit / 2 && logits[a] > logits[best]) best = a;
  }
  return best;
}

int sample_action(const float* logits, int num_actions, std::mt19937_64& rng) {
  double top = logits[0];
  for (int a = 1; a < num_actions; ++a) top = std::max(top, static_cast<double>(logits[a]));
  std::vector<double> p(num_actions);
  double sum = 0;
  for (int a = 0; a < num_actions; ++a) {
    p[a] = logits[a] > kMaskedLogit / 2 ? std::exp(static_cast<double>(logits[a]) - top) : 0.0;
    sum += p[a];
  }
  // A hand-rolled draw (not std::discrete_distribution) so the sequence is the same everywhere.
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
  double acc = 0;
  for (int a = 0; a < num_actions; ++a) {
    acc += p[a];
    if (u < acc && p[a] > 0) return a;
  }
  for (int a = num_actions - 1; a >= 0; --a) {
    if (p[a] > 0) return a;
  }
  return 0;
}

namespace {

void copy_linear(const torch::nn::Linear& l, int& in, int& out, std::vector<float>& w,
                 std::vector<float>& b) {
  const torch::Tensor weight = l->weight.detach().contiguous();
  const torch::Tensor bias = l->bias.detach().contiguous();
  out = static_cast<int>(weight.size(0));
  in = static_cast<int>(weight.size(1));
  w.assign(weight.data_ptr<float>(), weight.data_ptr<float>() + weight.numel());
  b.assign(bias.data_ptr<float>(), bias.data_ptr<float>() + bias.numel());
}

}  // namespace

void FastActor::Layer::apply(const float* x, float* y) const {
  for (int o = 0; o < out; ++o) {
    const float* row = &w[static_cast<size_t>(o) * in];
    float acc = b[o];
    for (int i = 0; i < in; ++i) acc += row[i] * x[i];
    y[o] = acc;
  }
}

FastActor::FastActor(ActorCritic& network) {
  torch::NoGradGuard no_grad;
  auto& n = *network;
  copy_linear(n.enc1_, enc1_.in, enc1_.out, enc1_.w, enc1_.b);
  copy_linear(n.enc2_, enc2_.in, enc2_.out, enc2_.w, enc2_.b);
  copy_linear(n.score_state_, score_state_.in, score_state_.out, score_state_.w, score_state_.b);
  copy_linear(n.score_candidate_, score_candidate_.in, score_candidate_.out, score_candidate_.w,
              score_candidate_.b);
  copy_linear(n.score_out_, score_out_.in, score_out_.out, score_out_.w, score_out_.b);
  copy_linear(n.keep1_, keep1_.in, keep1_.out, keep1_.w, keep1_.b);
  copy_linear(n.keep_out_, keep_out_.in, keep_out_.out, keep_out_.w, keep_out_.b);
  const torch::Tensor rank = n.score_rank_->weight.detach().contiguous();
  rank_.assign(rank.data_ptr<float>(), rank.data_ptr<float>() + rank.numel());
  hidden_ = enc1_.out;
  // The buffers of logits() are sized kMaxHidden: a wider network would overflow them, so the
  // precondition holds in every build, not only where asserts are compiled in.
  if (hidden_ > kMaxHidden) {
    std::fprintf(stderr, "FastActor: hidden width %d exceeds %d\n", hidden_, kMaxHidden);
    std::abort();
  }
}

std::array<float, env::kNumActions> FastActor::logits(const env::Observation& o) const {
  if (hidden_ > kMaxHidden) __builtin_unreachable();  // the constructor's check
  float a[kMaxHidden], h[kMaxHidden], s[kMaxHidden], c[kMaxHidden], z[kMaxHidden];
  enc1_.apply(o.state.data(), a);
  for (int i = 0; i < hidden_; ++i) a[i] = std::tanh(a[i]);
  enc2_.apply(a, h);
  for (int i = 0; i < hidden_; ++i) h[i] = std::tanh(h[i]);
  std::array<float, env::kNumActions> out{};
  keep1_.apply(h, a);
  for (int i = 0; i < hidden_; ++i) a[i] = std::tanh(a[i]);
  keep_out_.apply(a, &out[0]);
  score_state_.apply(h, s);
  for (int k = 0; k < env::kMaxCandidates; ++k) {
    if (!o.mask[k]) {
      out[k + 1] = kMaskedLogit;
      continue;
    }
    score_candidate_.apply(&o.candidates[k * env::kCandidateDim], c);
    const float* r = &rank_[static_cast<size_t>(k) * hidden_];
    for (int i = 0; i < hidden_; ++i) z[i] = std::tanh(s[i] + c[i] + r[i]);
    score_out_.apply(z, &out[k + 1]);
  }
  return out;
}

}  // namespace parapilot::policy
