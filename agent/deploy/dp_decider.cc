#include "agent/deploy/dp_decider.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <numeric>
#include <cassert>

#include "env/monitor/robust_stats.h"

namespace parapilot::agent::deploy {

namespace {

// Largest-remainder rounding of `exact` (summing to total) with every entry at least 1.
std::vector<int> round_counts(const std::vector<double>& exact, int total) {
  const int n = static_cast<int>(exact.size());
  std::vector<int> counts(n);
  for (int r = 0; r < n; ++r) counts[r] = std::max(1, static_cast<int>(std::floor(exact[r])));
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return exact[a] - std::floor(exact[a]) > exact[b] - std::floor(exact[b]);
  });
  int sum = std::accumulate(counts.begin(), counts.end(), 0);
  for (int i = 0; sum < total; ++i, ++sum) ++counts[order[i % n]];
  while (sum > total) {
    const auto it = std::max_element(counts.begin(), counts.end());
    --*it;
    --sum;
  }
  return counts;
}

// Median and robust standard error of the median-like centre.
std::pair<double, double> centre(const std::vector<double>& v) {
  if (v.empty()) return {0, 0};
  const double m = monitor::median(v);
  const double se = 1.4826 * monitor::mad(v, m) / std::sqrt(static_cast<double>(v.size()));
  return {m, se};
}

__attribute__((format(printf, 1, 2))) std::string fmt(const char* format, ...) {
  char text[256];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

}  // namespace

const char* to_string(DataParallelDecision::Kind kind) {
  switch (kind) {
    case DataParallelDecision::Kind::keep:
      return "keep";
    case DataParallelDecision::Kind::rebalance:
      return "rebalance";
    case DataParallelDecision::Kind::revert:
      return "revert";
  }
  return "?";
}

std::string counts_text(const std::vector<int>& counts) {
  std::string out;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(counts[i]);
  }
  return out;
}

std::vector<int> even_counts(int ranks, int global_batch) {
  return round_counts(std::vector<double>(ranks, static_cast<double>(global_batch) / ranks),
                      global_batch);
}

std::vector<int> balanced_counts(const std::vector<double>& per_sample_ms,
                                 const std::vector<double>& fixed_ms, int global_batch,
                                 bool fixed_apart) {
  const int n = static_cast<int>(per_sample_ms.size());
  auto fixed = [&](int r) {
    return !fixed_apart && r < static_cast<int>(fixed_ms.size()) ? fixed_ms[r] : 0.0;
  };
  // Samples rank r can take within a step of T ms (at least 1).
  auto take = [&](int r, double t) { return std::max(1.0, (t - fixed(r)) / per_sample_ms[r]); };
  auto total = [&](double t) {
    double sum = 0;
    for (int r = 0; r < n; ++r) sum += take(r, t);
    return sum;
  };
  double lo = 0, hi = 0;
  for (int r = 0; r < n; ++r) hi = std::max(hi, fixed(r) + per_sample_ms[r] * global_batch);
  for (int i = 0; i < 100 && hi - lo > 1e-9 * std::max(1.0, hi); ++i) {
    const double mid = 0.5 * (lo + hi);
    (total(mid) < global_batch ? lo : hi) = mid;
  }
  std::vector<double> exact(n);
  double sum = 0;
  for (int r = 0; r < n; ++r) sum += exact[r] = take(r, hi);
  for (double& e : exact) e *= global_batch / sum;  // the floor of 1 may overshoot slightly
  return round_counts(exact, global_batch);
}

double predicted_step_ms(const std::vector<double>& per_sample_ms,
                         const std::vector<double>& fixed_ms, const std::vector<int>& counts,
                         bool fixed_apart) {
  double worst = 0, worst_fixed = 0;
  for (size_t r = 0; r < per_sample_ms.size() && r < counts.size(); ++r) {
    const double f = r < fixed_ms.size() ? fixed_ms[r] : 0.0;
    worst = std::max(worst, (fixed_apart ? 0.0 : f) + per_sample_ms[r] * counts[r]);
    worst_fixed = std::max(worst_fixed, f);
  }
  return fixed_apart ? worst + worst_fixed : worst;
}

DataParallelDecider::DataParallelDecider(DataParallelOptions options)
    : o_(options), cooldown_(options.cooldown_intervals) {
  // Preconditions: the agent checks a JobInfo's world size and batch, and deploy its flags,
  // before a decider is made.
  assert(o_.ranks >= 1 && o_.global_batch >= o_.ranks);
  assert(o_.verify_steps >= 1 && o_.settle_steps >= 0 && o_.min_gain >= 1 && o_.equal_band >= 0 &&
         o_.noise_k >= 0 && o_.max_revert_bound >= o_.revert_margin && o_.late_fraction >= 0);
  counts_ = even_counts(o_.ranks, o_.global_batch);
  previous_counts_ = counts_;
}

void DataParallelDecider::observe_step(uint64_t step, double step_ms) {
  if (step_ms <= 0 || step < static_cast<uint64_t>(o_.warmup_steps)) return;
  steps_.emplace_back(step, step_ms);
  while (steps_.size() > 256) steps_.pop_front();
}

std::vector<double> DataParallelDecider::steps_since(uint64_t first) const {
  std::vector<double> out;
  for (const auto& [step, ms] : steps_) {
    if (step >= first) out.push_back(ms);
  }
  return out;
}

// The switch being verified, once its steps are in: reverted when it (or the switches since the
// fastest shares measured) made steps slower beyond noise, else held.
DataParallelDecision DataParallelDecider::judge_last_switch(DataParallelDecision d, double now_ms,
                                                            double now_se) {
  const std::vector<double> after = steps_since(verify_from_);
  if (static_cast<int>(after.size()) < o_.verify_steps) {
    d.reason = fmt("measuring the last switch: %.0f of %.0f steps",
                   static_cast<double>(after.size()), static_cast<double>(o_.verify_steps));
    return d;
  }
  verifying_ = false;
  const double bound = revert_bound(before_ms_, before_se_, now_se);
  const double best_bound = revert_bound(best_ms_, best_se_, now_se);
  // Judged against the shares just left, and against the fastest shares measured since the
  // job last changed: switches that each stay within noise of the one before must not add up
  // to a job slower than it was.
  const bool worse_than_before = before_ms_ > 0 && now_ms > before_ms_ * (1 + bound);
  const bool worse_than_best = best_ms_ > 0 && best_counts_ != previous_counts_ &&
                               now_ms > best_ms_ * (1 + best_bound);
  if (worse_than_before || worse_than_best) {
    d.kind = DataParallelDecision::Kind::revert;
    const bool to_best = worse_than_best && best_ms_ < before_ms_;
    d.counts = to_best ? best_counts_ : previous_counts_;
    d.reason = to_best
                   ? fmt("the switches since the fastest shares measured made steps slower: "
                         "%.1f ms now vs %.1f ms on %s (+%.0f%%, beyond the noise bound of "
                         "%.0f%%)",
                         now_ms, best_ms_, counts_text(best_counts_).c_str(),
                         100 * (now_ms / best_ms_ - 1), 100 * best_bound)
                   : fmt("the last switch made steps slower: %.1f ms after vs %.1f ms before "
                         "(+%.0f%%, beyond the noise bound of %.0f%%)",
                         now_ms, before_ms_, 100 * (now_ms / before_ms_ - 1), 100 * bound);
    cooldown_ = std::min(o_.max_backoff_intervals, std::max(1, cooldown_ * 2));
    since_switch_ = 0;
    return d;
  }
  cooldown_ = o_.cooldown_intervals;
  judged_ms_ = now_ms;
  judged_se_ = now_se;
  if (best_ms_ <= 0 || now_ms < best_ms_) remember_best(now_ms, now_se);
  d.reason =
      fmt("the last switch held: %.1f ms per step after vs %.1f ms before", now_ms, before_ms_);
  return d;
}

// Each rank's compute per sample (and its standard error), and its fixed part per step when the
// ranks report one; `missing` lists the ranks with no measurement yet or on a lost GPU.
DataParallelDecider::RankLevels DataParallelDecider::rank_levels(const monitor::Beliefs& b) const {
  RankLevels levels{std::vector<double>(o_.ranks, 0.0), std::vector<double>(o_.ranks, 0.0),
                    std::vector<double>(o_.ranks, 0.0), {}};
  std::vector<double>& per_sample = levels.per_sample;
  std::vector<double>& fixed = levels.fixed;
  std::vector<double>& se = levels.se;
  std::string& missing = levels.missing;
  for (int r = 0; r < o_.ranks; ++r) {
    const double level = r < static_cast<int>(b.rank_compute_ms.size()) ? b.rank_compute_ms[r] : 0;
    const bool lost = !b.conditions.gpu_failed.empty() && b.conditions.gpu_failed[r];
    if (level <= 0 || lost) {
      if (!missing.empty()) missing += ',';
      missing += std::to_string(r);
      continue;
    }
    const double level_se = r < static_cast<int>(b.rank_compute_se_ms.size())
                                ? std::max(0.0, b.rank_compute_se_ms[r])
                                : 0.0;
    if (b.compute_per_sample) {
      per_sample[r] = level;
      se[r] = level_se;
      fixed[r] = r < static_cast<int>(b.rank_fixed_ms.size()) ? b.rank_fixed_ms[r] : 0.0;
    } else {
      per_sample[r] = level / counts_[r];
      se[r] = level_se / counts_[r];
    }
  }
  return levels;
}

// With every rank measured: the balanced shares, and a rebalance when its predicted gain clears
// the bar, the ranks' arrival order agrees and enough decisions in a row confirm it.
DataParallelDecision DataParallelDecider::plan_rebalance(DataParallelDecision d,
                                                         const monitor::Beliefs& b,
                                                         RankLevels levels, double now_ms,
                                                         double now_se) {
  std::vector<double>& per_sample = levels.per_sample;
  std::vector<double>& fixed = levels.fixed;
  const std::vector<double>& se = levels.se;
  const double median_ms = monitor::median(per_sample);
  const double median_fixed = monitor::median(fixed);
  const double median_se = monitor::median(se);
  const std::vector<double> measured_ms = per_sample, measured_fixed = fixed;
  // The rank named in the reason: the slowest for the current shares, or, once a target is
  // known, the one it takes the most work from.
  auto evidence_of = [&](int r) {
    return fmt("rank %d computes %.3f ms per sample + %.1f ms per step vs the median %.3f + %.1f",
               r, measured_ms[r], measured_fixed[r], median_ms, median_fixed);
  };
  std::vector<double> step_of(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) step_of[r] = fixed[r] + per_sample[r] * counts_[r];
  std::string evidence =
      evidence_of(static_cast<int>(std::max_element(step_of.begin(), step_of.end()) - step_of.begin()));
  // Noise-level differences are no differences: per-sample times within the band of the median
  // or within noise_k standard errors of it, and fixed parts within the band of a median rank's
  // step.
  const double typical_step = median_fixed + median_ms * o_.global_batch / o_.ranks;
  for (int r = 0; r < o_.ranks; ++r) {
    double& c = per_sample[r];
    const bool in_band = c < median_ms * (1 + o_.equal_band) && c * (1 + o_.equal_band) > median_ms;
    const bool in_noise = std::abs(c - median_ms) <= o_.noise_k * std::hypot(se[r], median_se);
    if (in_band || in_noise) c = median_ms;
    if (std::abs(fixed[r] - median_fixed) < o_.equal_band * typical_step) fixed[r] = median_fixed;
  }
  const bool apart = b.fixed_apart;
  const std::vector<int> target = balanced_counts(per_sample, fixed, o_.global_batch, apart);
  // The ranks the target takes work from: the move a confirmation must see again.
  std::vector<int> shed;
  int most_shed = -1;
  for (int r = 0; r < o_.ranks; ++r) {
    if (target[r] >= counts_[r]) continue;
    shed.push_back(r);
    if (most_shed < 0 || counts_[r] - target[r] > counts_[most_shed] - target[most_shed]) {
      most_shed = r;
    }
  }
  if (most_shed >= 0) evidence = evidence_of(most_shed);
  d.predicted_now_ms = predicted_step_ms(per_sample, fixed, counts_, apart);
  d.predicted_new_ms = predicted_step_ms(per_sample, fixed, target, apart);
  // The switch costs about one step (the boundary agreement and re-learning the levels),
  // amortised over the decisions it will stand for at least.
  const double amortise_steps = static_cast<double>(o_.verify_steps) * (cooldown_ + 1);
  d.predicted_gain =
      d.predicted_new_ms > 0
          ? d.predicted_now_ms / (d.predicted_new_ms + d.predicted_now_ms / amortise_steps)
          : 1.0;
  if (target == counts_) {
    wanted_ = 0;
    d.reason = "shares already balanced; " + evidence;
    return d;
  }
  if (d.predicted_gain < o_.min_gain) {
    wanted_ = 0;
    d.reason =
        fmt("predicted gain %.2fx is below %.2fx; ", d.predicted_gain, o_.min_gain) + evidence;
    return d;
  }
  // Arrival order must agree with the model: one of the ranks the model says hold the step up
  // must be among those arriving last at the collectives (waiting least), and no work may move
  // onto a rank arriving last. A wait the ranks could not measure inflates a rank's compute but
  // not its arrival, so a healthy rank charged with a peer's wait is not unloaded.
  if (const std::string why = arrival_disagrees(b, per_sample, fixed, target); !why.empty()) {
    wanted_ = 0;
    d.reason = why + "; " + evidence;
    return d;
  }
  // A confirmation is the same move again: work taken from the same ranks. Another move starts
  // the count afresh (the asymmetry wandered: load, not a slow rank).
  if (shed != wanted_from_) wanted_ = 0;
  wanted_from_ = shed;
  if (++wanted_ < o_.confirm_decisions) {
    d.reason = fmt("predicted gain %.2fx in %d of %d decisions in a row; ", d.predicted_gain,
                   wanted_, o_.confirm_decisions) +
               evidence;
    return d;
  }
  wanted_ = 0;
  d.kind = DataParallelDecision::Kind::rebalance;
  d.counts = target;
  d.reason = evidence + fmt("; predicted step %.1f -> %.1f ms of compute", d.predicted_now_ms,
                            d.predicted_new_ms);
  pending_before_ms_ = now_ms;
  pending_before_se_ = now_se;
  since_switch_ = 0;
  return d;
}

DataParallelDecision DataParallelDecider::decide(const monitor::Beliefs& b, bool staging) {
  DataParallelDecision d;
  ++since_switch_;
  // The shares in force, as the ranks report them (a job may start on its own shares).
  if (static_cast<int>(b.rank_samples.size()) == o_.ranks) {
    std::vector<int> seen(o_.ranks);
    int sum = 0;
    for (int r = 0; r < o_.ranks; ++r) sum += seen[r] = static_cast<int>(b.rank_samples[r]);
    if (sum == o_.global_batch && *std::min_element(seen.begin(), seen.end()) >= 1 && !verifying_ &&
        !staging) {
      counts_ = seen;
    }
  }
  std::vector<double> recent = steps_since(verifying_ ? verify_from_ : 0);
  if (static_cast<int>(recent.size()) > o_.verify_steps) {
    recent.erase(recent.begin(), recent.end() - o_.verify_steps);
  }
  const auto [now_ms, now_se] = centre(recent);
  d.current_step_ms = now_ms;
  d.counts = counts_;
  if (staging) {
    d.reason = "a switch is in flight";
    return d;
  }
  if (verifying_) return judge_last_switch(std::move(d), now_ms, now_se);
  if (since_switch_ <= cooldown_) {
    d.reason = fmt("cool-down: %.0f of %.0f decisions since the last switch",
                   static_cast<double>(since_switch_), static_cast<double>(cooldown_));
    return d;
  }
  if (static_cast<int>(steps_.size()) < o_.verify_steps) {
    d.reason = fmt("measuring the job: %.0f of %.0f steps after its first %.0f",
                   static_cast<double>(steps_.size()), static_cast<double>(o_.verify_steps),
                   static_cast<double>(o_.warmup_steps));
    return d;
  }
  track_best(now_ms, now_se);
  RankLevels levels = rank_levels(b);
  if (!levels.missing.empty()) {
    d.reason = "no compute measurement yet from rank(s) " + levels.missing;
    return d;
  }
  return plan_rebalance(std::move(d), b, std::move(levels), now_ms, now_se);
}

std::string DataParallelDecider::arrival_disagrees(const monitor::Beliefs& b,
                                                   const std::vector<double>& per_sample,
                                                   const std::vector<double>& fixed,
                                                   const std::vector<int>& target) const {
  if (static_cast<int>(b.rank_wait_ms.size()) != o_.ranks) return "";
  std::vector<double> waits = b.rank_wait_ms;
  if (*std::min_element(waits.begin(), waits.end()) < 0) return "";  // not measured everywhere
  const double least = *std::min_element(waits.begin(), waits.end());
  const double mid = monitor::median(waits);
  // Arriving last: waiting least, or within a quarter of the way from the least to the median.
  auto late = [&](int r) { return waits[r] <= least + o_.late_fraction * (mid - least); };
  std::vector<double> step_of(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) {
    step_of[r] = (b.fixed_apart ? 0.0 : fixed[r]) + per_sample[r] * counts_[r];
  }
  const double slowest = *std::max_element(step_of.begin(), step_of.end());
  bool confirmed = false;
  int model_slowest = 0, arrives_last = 0;
  for (int r = 0; r < o_.ranks; ++r) {
    if (step_of[r] > step_of[model_slowest]) model_slowest = r;
    if (waits[r] < waits[arrives_last]) arrives_last = r;
    confirmed |= late(r) && step_of[r] >= (1 - o_.equal_band / 2) * slowest;
  }
  if (!confirmed) {
    return fmt("not confirmed by arrival order: the model's slowest rank %d waits %.1f ms in "
               "the collectives a step, rank %d arrives last (waits %.1f ms; median %.1f)",
               model_slowest, waits[model_slowest], arrives_last, least, mid);
  }
  for (int r = 0; r < o_.ranks; ++r) {
    if (late(r) && target[r] > counts_[r]) {
      return fmt("would move work onto rank %d, which arrives last at the collectives (waits "
                 "%.1f ms a step; median %.1f)",
                 r, waits[r], mid);
    }
  }
  return "";
}

double DataParallelDecider::revert_bound(double reference_ms, double reference_se,
                                         double now_se) const {
  const double noise = reference_ms > 0 ? 3 * std::hypot(reference_se, now_se) / reference_ms
                                        : o_.revert_margin;
  // The noise bound is capped: ten steps' spread on a loaded machine can be wide, and a
  // regression past the cap is reverted however noisy the job (undoing a switch costs little).
  return std::min(o_.max_revert_bound, std::max(o_.revert_margin, noise));
}

void DataParallelDecider::remember_best(double ms, double se) {
  best_counts_ = counts_;
  best_ms_ = ms;
  best_se_ = se;
}

void DataParallelDecider::track_best(double now_ms, double now_se) {
  if (now_ms <= 0) return;
  if (best_ms_ <= 0 || counts_ == best_counts_) {
    remember_best(now_ms, now_se);  // the fastest shares, re-measured as they run now
  } else if (judged_ms_ > 0 && now_ms > judged_ms_ * (1 + revert_bound(judged_ms_, judged_se_,
                                                                       now_se))) {
    // The shares in force got slower without a switch: the job changed (a rank slowed), and
    // what other shares measured before says nothing of them now.
    remember_best(now_ms, now_se);
  }
  judged_ms_ = now_ms;
  judged_se_ = now_se;
}

void DataParallelDecider::committed(const std::vector<int>& counts, uint64_t switch_at_step,
                                    bool revert) {
  if (!revert) {
    previous_counts_ = counts_;
    verifying_ = true;
    verify_from_ = switch_at_step + static_cast<uint64_t>(o_.settle_steps);
    before_ms_ = pending_before_ms_;
    before_se_ = pending_before_se_;
  } else {
    verifying_ = false;
    previous_counts_ = counts;
  }
  judged_ms_ = judged_se_ = 0;  // the new shares are measured afresh
  counts_ = counts;
  since_switch_ = 0;
}

void DataParallelDecider::aborted() { since_switch_ = 0; }

}  // namespace parapilot::agent::deploy
