// Running policies through episodes and summarising them against the hindsight oracle.
//
// Pure functions over an Env they are given; not thread-safe with respect to that env.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "policy/baselines.h"
#include "env/env.h"

namespace parapilot::agent {

struct EpisodeStats {
  double tokens = 0;
  double throughput_tokens_per_s = 0;
  double mean_reward = 0;
  int migrations = 0;
  int restarts = 0;
  std::vector<double> tokens_per_s_by_interval;
  /// Policy inputs read at the normaliser's clip, and outside training's range
  /// (Policy::check_inputs), summed over the episode's decisions, by input (env::input_name);
  /// empty for rules and the oracle.
  std::map<std::string, int> clipped_inputs, unseen_inputs;
};

// Runs one episode of `policy` on `env` from `seed`.
EpisodeStats run_episode(env::Env& env, policy::Policy& policy, uint64_t seed);
// The oracle's episode from `seed`; kInvalidArgument naming the env when it has no oracle (a
// live job cannot see its future).
StatusOr<EpisodeStats> run_oracle(env::Env& env, uint64_t seed);

// Mean and the half-width of a 95% confidence interval (Student t).
struct Interval {
  double mean = 0;
  double half_width = 0;
};
Interval mean_interval(const std::vector<double>& values);

/// The paired difference of two policies' per-episode figures on the same episodes:
/// mean_interval of a[i] - b[i]. Precondition: a.size() == b.size().
struct PairedDifference {
  Interval difference;
  /// "better" when the whole 95% interval lies above zero, "worse" below it, else "tie".
  const char* verdict() const;
};
PairedDifference paired_difference(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace parapilot::agent
