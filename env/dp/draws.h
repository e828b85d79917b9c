// Random draws of the simulators (env/dp/job_sim.h, env/pp/pipeline_sim.h) from the generator's
// raw output only: the standard distributions' algorithms differ between standard libraries,
// these do not, so an episode is the same on every platform.
//
// Pure functions of the generator passed in.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

namespace parapilot::env::dp {

/// Uniform in [0, 1).
inline double uniform(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}
/// Uniform in [lo, hi).
inline double uniform(std::mt19937_64& rng, double lo, double hi) {
  return lo + (hi - lo) * uniform(rng);
}
/// Log-uniform in [lo, hi), lo > 0.
inline double log_uniform(std::mt19937_64& rng, double lo, double hi) {
  return std::exp(uniform(rng, std::log(lo), std::log(hi)));
}
/// Uniform in [lo, hi], lo <= hi.
inline int uniform_int(std::mt19937_64& rng, int lo, int hi) {
  return lo + static_cast<int>(rng() % static_cast<uint64_t>(hi - lo + 1));
}
/// Standard normal (Box-Muller).
inline double normal(std::mt19937_64& rng) {
  const double u = 1.0 - uniform(rng);  // (0, 1]
  return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * uniform(rng));
}

}  // namespace parapilot::env::dp
