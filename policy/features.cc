#include "policy/features.h"

#include <algorithm>
#include <cmath>

#include "env/observation.h"

namespace parapilot::policy {

void RunningStats::add(const float* values) {
  count += 1;
  for (size_t i = 0; i < mean.size(); ++i) {
    const double x = static_cast<double>(values[i]);
    min[i] = count == 1 ? x : std::min(min[i], x);
    max[i] = count == 1 ? x : std::max(max[i], x);
    const double delta = x - mean[i];
    mean[i] += delta / count;
    m2[i] += delta * (x - mean[i]);
  }
}

double RunningStats::stddev(int i) const {
  const double var = count > 1 ? m2[i] / count : 1.0;
  return std::sqrt(var + 1e-8);
}

void ObservationNormalizer::update(const env::Observation& o) {
  state_.add(o.state.data());
  for (int k = 0; k < env::kMaxCandidates; ++k) {
    if (o.mask[k]) candidate_.add(&o.candidates[k * env::kCandidateDim]);
  }
}

namespace {

// `input` is the flat index of dimension i (env::input_range).
float normalised(const RunningStats& s, int i, int input, float x) {
  // Before any statistics exist the features pass through (they are already scaled).
  if (s.count < 2)
    return std::clamp(x, -static_cast<float>(ObservationNormalizer::kClip),
                      static_cast<float>(ObservationNormalizer::kClip));
  // The scale is at least what keeps the feature's whole range within ±kRangeZ.
  const env::FeatureRange r = env::input_range(input);
  const double lo = r.lo, hi = r.hi;
  const double reach = std::max(hi - s.mean[i], s.mean[i] - lo);
  const double scale = std::max(s.stddev(i), reach / ObservationNormalizer::kRangeZ);
  const double z = (static_cast<double>(x) - s.mean[i]) / scale;
  return static_cast<float>(
      std::clamp(z, -ObservationNormalizer::kClip, ObservationNormalizer::kClip));
}

}  // namespace

env::Observation ObservationNormalizer::normalise(const env::Observation& o) const {
  env::Observation out;
  out.mask = o.mask;
  for (int i = 0; i < env::kStateDim; ++i) out.state[i] = normalised(state_, i, i, o.state[i]);
  for (int k = 0; k < env::kMaxCandidates; ++k) {
    if (!o.mask[k]) continue;
    for (int j = 0; j < env::kCandidateDim; ++j) {
      out.candidates[k * env::kCandidateDim + j] =
          normalised(candidate_, j, env::kStateDim + j, o.candidates[k * env::kCandidateDim + j]);
    }
  }
  return out;
}

namespace {

// The flat input indices (state features, then candidate features once each) for which `hit`
// holds on `o`'s state or on any present candidate.
template <class Hit>
std::vector<int> inputs_where(const env::Observation& o, const RunningStats& state,
                              const RunningStats& candidate, Hit hit) {
  std::vector<int> out;
  for (int i = 0; i < env::kStateDim; ++i) {
    if (hit(state, i, i, o.state[i])) out.push_back(i);
  }
  for (int j = 0; j < env::kCandidateDim; ++j) {
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      if (o.mask[k] && hit(candidate, j, env::kStateDim + j, o.candidates[k * env::kCandidateDim + j])) {
        out.push_back(env::kStateDim + j);
        break;
      }
    }
  }
  return out;
}

}  // namespace

std::vector<int> ObservationNormalizer::clipped(const env::Observation& o) const {
  return inputs_where(o, state_, candidate_, [](const RunningStats& s, int i, int input, float x) {
    return s.count >= 2 &&
           std::abs(static_cast<double>(normalised(s, i, input, x))) >= ObservationNormalizer::kClip;
  });
}

std::vector<int> ObservationNormalizer::outside_training(const env::Observation& o) const {
  return inputs_where(o, state_, candidate_, [](const RunningStats& s, int i, int input, float x) {
    if (s.count < 1) return false;
    const env::FeatureRange r = env::input_range(input);
    const double slack = ObservationNormalizer::kRangeSlack * static_cast<double>(r.hi - r.lo);
    const double v = x;
    return v < s.min[i] - slack || v > s.max[i] + slack;
  });
}

}  // namespace parapilot::policy
