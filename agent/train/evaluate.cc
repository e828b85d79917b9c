#include "agent/train/evaluate.h"

#include <cassert>
#include <cmath>

#include "env/observation.h"
#include "core/error.h"

namespace parapilot::agent {

StatusOr<EpisodeStats> run_episode(env::Env& env, policy::Policy& policy, uint64_t seed) {
  EpisodeStats stats;
  policy.begin_episode();
  auto first = env.reset(seed, policy.reset_options());
  if (!first.ok()) return first.status();
  env::Observation obs = std::move(*first);
  double reward_sum = 0;
  int steps = 0;
  while (true) {
    const policy::InputReport inputs = policy.check_inputs(obs);
    for (int i : inputs.clipped) ++stats.clipped_inputs[env::input_name(i)];
    for (int i : inputs.unseen) ++stats.unseen_inputs[env::input_name(i)];
    const env::StepResult r = env.step(policy.act(obs));
    stats.tokens += r.info.tokens;
    stats.tokens_per_s_by_interval.push_back(r.info.tokens_per_s);
    stats.migrations += r.info.migration_committed;
    stats.restarts += r.info.restarted;
    reward_sum += r.reward;
    ++steps;
    obs = r.observation;
    if (r.terminated || r.truncated) break;
  }
  stats.throughput_tokens_per_s = stats.tokens / (steps * env.interval_s());
  stats.mean_reward = reward_sum / steps;
  return stats;
}

StatusOr<EpisodeStats> run_oracle(env::Env& env, uint64_t seed) {
  if (auto first = env.reset(seed); !first.ok()) return first.status();
  const auto oracle = env.oracle();
  if (!oracle) return Status::invalid_argument("env " + env.id() + " has no hindsight oracle");
  EpisodeStats stats;
  for (double tokens : oracle->tokens_per_interval) {
    stats.tokens += tokens;
    stats.tokens_per_s_by_interval.push_back(tokens / env.interval_s());
  }
  stats.migrations = oracle->migrations;
  stats.truth_changed = oracle->truth_changed;
  stats.throughput_tokens_per_s =
      stats.tokens / (static_cast<double>(oracle->tokens_per_interval.size()) * env.interval_s());
  return stats;
}

std::optional<GapByChange> gap_by_change(const EpisodeStats& episode, const EpisodeStats& oracle) {
  const std::vector<double>& p = episode.tokens_per_s_by_interval;
  const std::vector<double>& o = oracle.tokens_per_s_by_interval;
  assert(p.size() == o.size());
  if (oracle.truth_changed.size() != o.size()) return std::nullopt;
  double total = 0;
  for (double x : o) total += x;
  GapByChange gap;
  if (total <= 0) return gap;
  for (size_t t = 0; t < o.size(); ++t) {
    const double share = (o[t] - p[t]) / total;
    if (t > 0 && oracle.truth_changed[t - 1]) {
      gap.next += share;
    } else if (oracle.truth_changed[t]) {
      gap.onset += share;
    } else {
      gap.later += share;
    }
  }
  return gap;
}

const char* PairedDifference::verdict() const {
  if (difference.mean - difference.half_width > 0) return "better";
  if (difference.mean + difference.half_width < 0) return "worse";
  return "tie";
}

PairedDifference paired_difference(const std::vector<double>& a, const std::vector<double>& b) {
  assert(a.size() == b.size());
  std::vector<double> d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return {mean_interval(d)};
}

Interval mean_interval(const std::vector<double>& values) {
  Interval out;
  const size_t n = values.size();
  if (n == 0) return out;
  for (double v : values) out.mean += v;
  out.mean /= static_cast<double>(n);
  if (n < 2) return out;
  double var = 0;
  for (double v : values) var += (v - out.mean) * (v - out.mean);
  var /= static_cast<double>(n - 1);
  // Two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom, then normal.
  static const double t975[] = {12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262,
                                2.228,  2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101,
                                2.093,  2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052,
                                2.048,  2.045, 2.042};
  const size_t dof = n - 1;
  const double t = dof <= 30 ? t975[dof - 1] : 1.96;
  out.half_width = t * std::sqrt(var / static_cast<double>(n));
  return out;
}

}  // namespace parapilot::agent
