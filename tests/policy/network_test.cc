// The actor-critic network: size, varying candidate counts, masks, action selection, and the
// hand-written inference path against libtorch.
#include <doctest/doctest.h>

#include <random>

#include "env/observation.h"
#include "policy/features.h"
#include "policy/network.h"

namespace pp = parapilot::policy;
namespace env = parapilot::env;

TEST_CASE(
    "network: under 100k parameters, logits for keep plus each candidate, any candidate count") {
  torch::manual_seed(7);
  pp::ActorCritic net;
  CHECK(net->parameter_count() < 100000);
  for (int64_t K : {1, 4, 7, 16}) {
    const int64_t B = 3;
    const auto out =
        net->forward(torch::randn({B, env::kStateDim}), torch::randn({B, K, env::kCandidateDim}),
                     torch::ones({B, K}, torch::kBool));
    CHECK(out.logits.size(0) == B);
    CHECK(out.logits.size(1) == K + 1);
    CHECK(out.value.size(0) == B);
    CHECK(torch::isfinite(out.logits).all().item<bool>());
  }
  CHECK_THROWS(net->forward(torch::randn({1, env::kStateDim}),
                            torch::randn({1, pp::kMaxRanks + 1, env::kCandidateDim}),
                            torch::ones({1, pp::kMaxRanks + 1}, torch::kBool)));
}

TEST_CASE("network: a candidate's logit does not depend on the candidates after it") {
  torch::manual_seed(3);
  pp::ActorCritic net;
  const auto state = torch::randn({1, env::kStateDim});
  const auto cands = torch::randn({1, 6, env::kCandidateDim});
  const auto all = net->forward(state, cands, torch::ones({1, 6}, torch::kBool)).logits;
  const auto first3 =
      net->forward(state, cands.slice(1, 0, 3), torch::ones({1, 3}, torch::kBool)).logits;
  CHECK(torch::allclose(all.slice(1, 0, 4), first3));
}

TEST_CASE("network: masked candidates get probability zero and are never chosen") {
  torch::manual_seed(11);
  pp::ActorCritic net;
  const int64_t B = 64, K = env::kMaxCandidates;
  auto mask = torch::rand({B, K}) > 0.5;
  const auto out = net->forward(torch::randn({B, env::kStateDim}),
                                torch::randn({B, K, env::kCandidateDim}), mask);
  const auto p = torch::softmax(out.logits, 1);
  const auto masked_p = p.slice(1, 1, K + 1).masked_select(mask.logical_not());
  CHECK(masked_p.numel() > 0);
  CHECK(masked_p.max().item<float>() == 0.0f);
  const auto entropy = -(p * torch::log_softmax(out.logits, 1)).sum(1);
  CHECK(torch::isfinite(entropy).all().item<bool>());

  std::mt19937_64 rng(5);
  const auto logits = out.logits.contiguous();
  const bool* m = mask.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const float* l = logits.data_ptr<float>() + b * (K + 1);
    const int g = pp::greedy_action(l, static_cast<int>(K + 1));
    CHECK((g == 0 || m[b * K + g - 1]));
    for (int draw = 0; draw < 50; ++draw) {
      const int a = pp::sample_action(l, static_cast<int>(K + 1), rng);
      REQUIRE((a == 0 || m[b * K + a - 1]));
    }
  }
}

TEST_CASE("network: sampling follows the softmax") {
  const float logits[3] = {0.0f, std::log(3.0f), pp::kMaskedLogit};
  std::mt19937_64 rng(1);
  int count[3] = {0, 0, 0};
  for (int i = 0; i < 20000; ++i) ++count[pp::sample_action(logits, 3, rng)];
  CHECK(count[2] == 0);
  CHECK(std::abs(count[1] / 20000.0 - 0.75) < 0.02);
}

TEST_CASE("network: the hand-written actor gives the module's logits") {
  torch::manual_seed(13);
  pp::ActorCritic net;
  pp::FastActor fast(net);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int trial = 0; trial < 20; ++trial) {
    env::Observation o;
    for (auto& x : o.state) x = normal(rng);
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      o.mask[k] = static_cast<uint8_t>((trial + k) % 3 != 0);
      for (int j = 0; j < env::kCandidateDim; ++j) {
        o.candidates[k * env::kCandidateDim + j] = o.mask[k] ? normal(rng) : 0.0f;
      }
    }
    const auto b = pp::to_batch({o});
    torch::NoGradGuard no_grad;
    const auto reference = net->forward(b.state, b.candidates, b.mask).logits.contiguous();
    const auto got = fast.logits(o);
    for (int a = 0; a < env::kNumActions; ++a) {
      CHECK(got[a] == doctest::Approx(reference.data_ptr<float>()[a]).epsilon(1e-4));
    }
  }
}

TEST_CASE("features: running normalisation") {
  pp::ObservationNormalizer n;
  env::Observation o;
  for (int i = 0; i < 100; ++i) {
    o.state[0] = static_cast<float>(i % 2 == 0 ? 1.0 : 3.0);  // mean 2, std 1
    o.mask = {1, 0, 0, 0};
    o.candidates[0] = static_cast<float>(i);
    o.candidates[env::kCandidateDim] = 123.0f;  // candidate 1 is missing: not counted
    n.update(o);
  }
  CHECK(n.state_stats().mean[0] == doctest::Approx(2.0));
  CHECK(n.state_stats().stddev(0) == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(n.candidate_stats().count == 100);
  CHECK(n.candidate_stats().mean[0] == doctest::Approx(49.5));
  o.state[0] = 3.0f;
  o.state[1] = 1e6f;  // constant 0 so far: clipped
  o.mask = {1, 0, 0, 0};
  const auto z = n.normalise(o);
  CHECK(z.state[0] == doctest::Approx(1.0f));
  CHECK(z.state[1] == doctest::Approx(pp::ObservationNormalizer::kClip));
  CHECK(z.candidates[env::kCandidateDim] == 0.0f);  // missing candidates stay zero
}

TEST_CASE("features: a rare value inside the feature's range keeps its magnitude, and is named "
          "when training never produced it") {
  pp::ObservationNormalizer n;
  env::Observation o;
  o.mask = {1, 0, 0, 0};
  const auto failed = static_cast<int>(env::StateFeature::kFailedFraction);
  const auto gain = env::kStateDim + static_cast<int>(env::CandidateFeature::kLogGain);
  for (int i = 0; i < 1000; ++i) {
    o.state[failed] = i == 0 ? 0.125f : 0.0f;  // one failure in a thousand
    o.candidates[0] = 0.1f * static_cast<float>(i % 3);  // log_gain in [0, 0.2]
    n.update(o);
  }
  // The plain z-score of a 25% failure would be about 63 standard deviations: saturated. The
  // scale keeps failed_fraction's whole range [0, 1] inside the clip.
  o.state[failed] = 0.25f;
  o.candidates[0] = 0.1f;
  const auto z = n.normalise(o);
  CHECK(z.state[failed] > 0.5f);
  CHECK(static_cast<double>(z.state[failed]) < pp::ObservationNormalizer::kClip);
  CHECK(n.clipped(o).empty());
  // 0.25 is past anything training saw (at most 0.125); log_gain 0.1 is inside [0, 0.2].
  CHECK(n.outside_training(o) == std::vector<int>{failed});
  o.state[failed] = 0.125f;
  o.candidates[0] = 0.2f + 0.03f;  // past training's largest by less than 2% of [-2, 2]
  CHECK(n.outside_training(o).empty());
  o.candidates[0] = -0.5f;
  CHECK(n.outside_training(o) == std::vector<int>{gain});
  o.mask = {0, 0, 0, 0};  // a missing candidate's zeros are not inputs
  CHECK(n.outside_training(o).empty());
}
