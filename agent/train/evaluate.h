// Running policies through episodes and summarising them against the hindsight oracle.
//
// Pure functions over an Env they are given; not thread-safe with respect to that env.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
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
  /// The oracle's episodes only: OracleResult::truth_changed (empty when the env does not say).
  std::vector<bool> truth_changed;
  /// Policy inputs read at the normaliser's clip, and outside training's range
  /// (Policy::check_inputs), summed over the episode's decisions, by input (env::input_name);
  /// empty for rules and the oracle.
  std::map<std::string, int> clipped_inputs, unseen_inputs;
};

// Runs one episode of `policy` on `env` from `seed`. Errors: the episode could not start
// (env::Env::reset).
StatusOr<EpisodeStats> run_episode(env::Env& env, policy::Policy& policy, uint64_t seed);
// The oracle's episode from `seed`; kInvalidArgument naming the env when it has no oracle (a
// live job cannot see its future); the reset's error when the episode could not start.
StatusOr<EpisodeStats> run_oracle(env::Env& env, uint64_t seed);

/// Where an episode fell short of the oracle's on the same seed: the oracle's tokens less the
/// policy's, summed over three kinds of interval, each as a share of the oracle's tokens in the
/// episode. `onset`: an interval whose truth changed (OracleResult::truth_changed) after an
/// interval whose truth did not, so that a causal policy picked the layout it runs on without
/// any sign of the change; `next`: the interval after one whose truth changed, the first a
/// policy can have switched for from telemetry of the change (a change that starts within an
/// interval shows in part there and in full in the next: that one counts here); `later`: the
/// rest. The three sum to 1 - the episode's score; an interval's share can be negative (the
/// oracle paid for a switch there). nullopt when the oracle's episode does not say when the
/// truth changed. Precondition: both episodes have the same number of intervals.
struct GapByChange {
  double onset = 0, next = 0, later = 0;
};
std::optional<GapByChange> gap_by_change(const EpisodeStats& episode, const EpisodeStats& oracle);

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
