#include "policy/features.h"

#include <algorithm>
#include <cmath>

namespace parapilot::policy {

void RunningStats::add(const float* values) {
  count += 1;
  for (size_t i = 0; i < mean.size(); ++i) {
    const double x = static_cast<double>(values[i]);
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

float normalised(const RunningStats& s, int i, float x) {
  // Before any statistics exist the features pass through (they are already scaled).
  if (s.count < 2)
    return std::clamp(x, -static_cast<float>(ObservationNormalizer::kClip),
                      static_cast<float>(ObservationNormalizer::kClip));
  const double z = (static_cast<double>(x) - s.mean[i]) / s.stddev(i);
  return static_cast<float>(
      std::clamp(z, -ObservationNormalizer::kClip, ObservationNormalizer::kClip));
}

}  // namespace

env::Observation ObservationNormalizer::normalise(const env::Observation& o) const {
  env::Observation out;
  out.mask = o.mask;
  for (int i = 0; i < env::kStateDim; ++i) out.state[i] = normalised(state_, i, o.state[i]);
  for (int k = 0; k < env::kMaxCandidates; ++k) {
    if (!o.mask[k]) continue;
    for (int j = 0; j < env::kCandidateDim; ++j) {
      out.candidates[k * env::kCandidateDim + j] =
          normalised(candidate_, j, o.candidates[k * env::kCandidateDim + j]);
    }
  }
  return out;
}

std::vector<int> ObservationNormalizer::clipped(const env::Observation& o) const {
  std::vector<int> out;
  auto at_clip = [](const RunningStats& st, int i, float x) {
    return st.count >= 2 && std::abs(static_cast<double>(normalised(st, i, x))) >= ObservationNormalizer::kClip;
  };
  for (int i = 0; i < env::kStateDim; ++i) {
    if (at_clip(state_, i, o.state[i])) out.push_back(i);
  }
  for (int j = 0; j < env::kCandidateDim; ++j) {
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      if (o.mask[k] && at_clip(candidate_, j, o.candidates[k * env::kCandidateDim + j])) {
        out.push_back(env::kStateDim + j);
        break;
      }
    }
  }
  return out;
}

}  // namespace parapilot::policy
