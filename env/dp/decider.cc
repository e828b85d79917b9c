#include "env/dp/decider.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <tuple>

#include "env/dp/shares.h"
#include "env/monitor/robust_stats.h"
#include "strategy/planner.h"

namespace parapilot::env::dp {

namespace {

// Median and robust standard error of the median-like centre.
std::pair<double, double> centre(const std::vector<double>& v) {
  if (v.empty()) return {0, 0};
  const double m = monitor::median(v);
  const double se = 1.4826 * monitor::mad(v, m) / std::sqrt(static_cast<double>(v.size()));
  return {m, se};
}

__attribute__((format(printf, 1, 2))) std::string fmt(const char* format, ...) {
  char text[320];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

// The layout a share vector is: pure data parallel over all ranks with these shares.
Strategy shares_strategy(const std::vector<int>& counts) {
  Strategy s;
  s.dp = static_cast<int>(counts.size());
  s.dp_shares = counts;
  return s;
}

// A predicted step as the cost model would report it: samples per second stand for tokens.
CostBreakdown step_cost(double step_ms, int global_batch, double exposed_wait_ms) {
  CostBreakdown c;
  c.feasible = c.fits_in_memory = true;
  c.iteration_time_s = step_ms / 1000;
  c.dp_comm_s = std::min(exposed_wait_ms, step_ms) / 1000;
  c.memory_capacity_gib = 1;
  c.tokens_per_s = global_batch / c.iteration_time_s;
  return c;
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

DataParallelDecider::DataParallelDecider(DataParallelOptions options)
    : o_(options), cooldown_(options.cooldown_intervals) {
  // Preconditions: the agent checks a JobInfo's world size and batch, and deploy its flags,
  // before a decider is made; the simulator draws valid jobs.
  assert(o_.ranks >= 1 && o_.global_batch >= o_.ranks && o_.decision_steps >= 1);
  assert(o_.verify_steps >= 1 && o_.settle_steps >= 0 && o_.equal_band >= 0 && o_.noise_k >= 0 &&
         o_.max_revert_bound >= o_.revert_margin && o_.late_fraction >= 0);
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
void DataParallelDecider::judge_last_switch(double now_ms, double now_se) {
  DataParallelDecision& d = pending_;
  const std::vector<double> after = steps_since(verify_from_);
  if (static_cast<int>(after.size()) < o_.verify_steps) {
    d.reason = fmt("measuring the last switch: %.0f of %.0f steps",
                   static_cast<double>(after.size()), static_cast<double>(o_.verify_steps));
    return;
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
    forced_ = true;
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
    return;
  }
  cooldown_ = o_.cooldown_intervals;
  judged_ms_ = now_ms;
  judged_se_ = now_se;
  if (best_ms_ <= 0 || now_ms < best_ms_) remember_best(now_ms, now_se);
  d.reason =
      fmt("the last switch held: %.1f ms per step after vs %.1f ms before", now_ms, before_ms_);
}

std::string DataParallelDecider::guard(double now_ms, double now_se, bool staging) {
  if (staging) return "a switch is in flight";
  if (verifying_) {
    judge_last_switch(now_ms, now_se);
    return pending_.reason;
  }
  if (since_switch_ <= cooldown_) {
    return fmt("cool-down: %.0f of %.0f decisions since the last switch",
               static_cast<double>(since_switch_), static_cast<double>(cooldown_));
  }
  if (static_cast<int>(steps_.size()) < o_.verify_steps) {
    return fmt("measuring the job: %.0f of %.0f steps after its first %.0f",
               static_cast<double>(steps_.size()), static_cast<double>(o_.verify_steps),
               static_cast<double>(o_.warmup_steps));
  }
  return "";
}

// Each rank's compute per sample (and its standard error), and its fixed part per step when the
// ranks report one; `missing` lists the ranks with no measurement yet or on a lost GPU.
DataParallelDecider::RankLevels DataParallelDecider::rank_levels(const monitor::Beliefs& b) const {
  RankLevels levels{std::vector<double>(o_.ranks, 0.0), std::vector<double>(o_.ranks, 0.0),
                    std::vector<double>(o_.ranks, 0.0), {}};
  for (int r = 0; r < o_.ranks; ++r) {
    const double level = r < static_cast<int>(b.rank_compute_ms.size()) ? b.rank_compute_ms[r] : 0;
    const bool lost = r < static_cast<int>(b.conditions.gpu_failed.size()) &&
                      b.conditions.gpu_failed[r];
    if (level <= 0 || lost) {
      if (!levels.missing.empty()) levels.missing += ',';
      levels.missing += std::to_string(r);
      continue;
    }
    const double level_se = r < static_cast<int>(b.rank_compute_se_ms.size())
                                ? std::max(0.0, b.rank_compute_se_ms[r])
                                : 0.0;
    if (b.compute_per_sample) {
      levels.per_sample[r] = level;
      levels.se[r] = level_se;
      levels.fixed[r] = r < static_cast<int>(b.rank_fixed_ms.size()) ? b.rank_fixed_ms[r] : 0.0;
    } else {
      levels.per_sample[r] = level / counts_[r];
      levels.se[r] = level_se / counts_[r];
    }
  }
  return levels;
}

void DataParallelDecider::denoise(RankLevels& levels) const {
  std::vector<double> measured, fixed_measured, se_measured;
  for (int r = 0; r < o_.ranks; ++r) {
    if (levels.per_sample[r] <= 0) continue;
    measured.push_back(levels.per_sample[r]);
    fixed_measured.push_back(levels.fixed[r]);
    se_measured.push_back(levels.se[r]);
  }
  if (measured.empty()) return;
  const double median_ms = monitor::median(measured);
  const double median_fixed = monitor::median(fixed_measured);
  const double median_se = monitor::median(se_measured);
  const double typical_step = median_fixed + median_ms * o_.global_batch / o_.ranks;
  for (int r = 0; r < o_.ranks; ++r) {
    double& c = levels.per_sample[r];
    if (c <= 0) continue;
    const bool in_band = c < median_ms * (1 + o_.equal_band) && c * (1 + o_.equal_band) > median_ms;
    const bool in_noise = std::abs(c - median_ms) <= o_.noise_k * std::hypot(levels.se[r], median_se);
    if (in_band || in_noise) c = median_ms;
    double& f = levels.fixed[r];
    if (std::abs(f - median_fixed) < o_.equal_band * typical_step) f = median_fixed;
  }
}

// The candidates for the model of `raw` (every rank measured): balanced, half-way to balanced,
// even and the fastest measured shares, best predicted first, none equal to the shares in force.
void DataParallelDecider::make_offers(const monitor::Beliefs& b, const RankLevels& raw,
                                      const RankLevels& levels) {
  model_ps_ = levels.per_sample;
  model_fixed_ = levels.fixed;
  fixed_apart_ = b.fixed_apart;
  waits_.clear();
  if (static_cast<int>(b.rank_wait_ms.size()) == o_.ranks &&
      *std::min_element(b.rank_wait_ms.begin(), b.rank_wait_ms.end()) >= 0) {
    waits_ = b.rank_wait_ms;
  }
  const double now_pred = predicted_step_ms(model_ps_, model_fixed_, counts_, fixed_apart_);
  pending_.predicted_now_ms = now_pred;
  const std::vector<int> target =
      balanced_counts(model_ps_, model_fixed_, o_.global_batch, fixed_apart_);
  std::vector<double> halfway(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) halfway[r] = 0.5 * (counts_[r] + target[r]);
  auto offer = [&](std::vector<int> counts, const char* what) {
    if (counts == counts_) return;
    for (const Offer& o : offers_) {
      if (o.counts == counts) return;
    }
    const double ms = predicted_step_ms(model_ps_, model_fixed_, counts, fixed_apart_);
    offers_.push_back({std::move(counts), ms, what});
  };
  offer(target, "balanced");
  offer(round_counts(halfway, o_.global_batch), "half-way to balanced");
  offer(even_counts(o_.ranks, o_.global_batch), "even");
  if (!best_counts_.empty()) offer(best_counts_, "the fastest measured");
  std::stable_sort(offers_.begin(), offers_.end(),
                   [](const Offer& a, const Offer& c) { return a.predicted_ms < c.predicted_ms; });
  if (static_cast<int>(offers_.size()) > kMaxCandidates) offers_.resize(kMaxCandidates);

  // The evidence names the rank the best offer takes the most work from, or the slowest rank.
  shed_.clear();
  int named = 0;
  std::vector<double> step_of(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) step_of[r] = raw.fixed[r] + raw.per_sample[r] * counts_[r];
  named = static_cast<int>(std::max_element(step_of.begin(), step_of.end()) - step_of.begin());
  if (!offers_.empty()) {
    int most = -1;
    for (int r = 0; r < o_.ranks; ++r) {
      const int give = counts_[r] - offers_.front().counts[r];
      if (give <= 0) continue;
      shed_.push_back(r);
      if (most < 0 || give > counts_[most] - offers_.front().counts[most]) most = r;
    }
    if (most >= 0) named = most;
  }
  std::vector<double> ps = raw.per_sample, fx = raw.fixed;
  evidence_ = fmt("rank %d computes %.3f ms per sample + %.1f ms per step vs the median %.3f + %.1f",
                  named, raw.per_sample[named], raw.fixed[named], monitor::median(ps),
                  monitor::median(fx));
  pending_.reason =
      offers_.empty()
          ? "shares already balanced; " + evidence_
          : fmt("best candidate %s (%s) predicted %.1f -> %.1f ms of compute; ",
                offers_.front().what, counts_text(offers_.front().counts).c_str(), now_pred,
                offers_.front().predicted_ms) +
                evidence_;
}

Observation DataParallelDecider::build(const monitor::Beliefs& b, const RankLevels& levels,
                                       bool offers) {
  std::vector<double> measured;
  for (double v : levels.per_sample) {
    if (v > 0) measured.push_back(v);
  }
  const double median_ms = measured.empty() ? 0.0 : monitor::median(measured);
  Conditions c;
  c.gpu_speed.assign(o_.ranks, 1.0);
  for (int r = 0; r < o_.ranks; ++r) {
    if (levels.per_sample[r] > 0 && median_ms > 0) {
      c.gpu_speed[r] = std::clamp(median_ms / levels.per_sample[r], 0.01, 1.5);
    }
  }
  c.gpu_failed = b.conditions.gpu_failed;
  c.gpu_failed.resize(o_.ranks, false);
  double wait_ms = 0;
  if (offers && !waits_.empty()) wait_ms = monitor::median(waits_);
  // The current shares' step: the model's when every rank is measured, else the measured one.
  double now_ms = offers ? pending_.predicted_now_ms : 0.0;
  if (now_ms <= 0) now_ms = now_ms_ > 0 ? now_ms_ : 1.0;
  const double step_s = (now_ms_ > 0 ? now_ms_ : now_ms) / 1000;
  std::vector<Candidate> candidates;
  for (const Offer& off : offers_) {
    Candidate cand;
    cand.strategy = shares_strategy(off.counts);
    cand.cost = step_cost(off.predicted_ms, o_.global_batch, wait_ms);
    cand.migration_s = step_s;  // a share change costs about one step: the boundary agreement
    candidates.push_back(std::move(cand));
  }
  const Strategy current = shares_strategy(counts_);
  ObservationInputs in;
  in.beliefs = &c;
  in.gpus = o_.ranks;
  in.nodes = 1;
  in.previous_min_speed = previous_min_speed_;
  in.missing_fraction = std::clamp(b.missing_fraction, 0.0, 1.0);
  in.current = &current;
  in.current_cost = step_cost(now_ms, o_.global_batch, wait_ms);
  in.candidates = &candidates;
  in.interval = decisions_;
  in.horizon = kHorizonDecisions;
  in.remaining_intervals = kUnknownRemaining;
  in.last_migration = last_switch_decision_;
  in.staging = staging_;
  in.interval_s = step_s * o_.decision_steps;
  in.staging_slowdown = 0;  // nothing is staged beside training: the pause is the whole cost
  in.switch_pause_s = step_s;
  Observation o = build_observation(in);
  // A condition continues only while the best offer sheds work from the same ranks.
  if (shed_ != condition_shed_) history_.reset();
  condition_shed_ = shed_;
  history_.annotate(o);
  previous_min_speed_ = feature(o, StateFeature::kMinSpeed);
  return o;
}

Observation DataParallelDecider::observe(const monitor::Beliefs& b, bool staging) {
  observed_ = true;
  forced_ = false;
  offers_.clear();
  shed_.clear();
  evidence_.clear();
  pending_ = DataParallelDecision();
  ++decisions_;
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
  std::tie(now_ms_, now_se_) = centre(recent);
  pending_.current_step_ms = now_ms_;
  pending_.counts = counts_;
  std::string why = guard(now_ms_, now_se_, staging);
  const RankLevels raw = rank_levels(b);
  RankLevels model = raw;
  denoise(model);
  if (why.empty()) {
    track_best(now_ms_, now_se_);
    if (!raw.missing.empty()) {
      why = "no compute measurement yet from rank(s) " + raw.missing;
    } else {
      make_offers(b, raw, model);
    }
  }
  if (!why.empty()) pending_.reason = why;
  staging_ = staging;
  return build(b, model, why.empty());
}

DataParallelDecision DataParallelDecider::decide(int action) {
  assert(observed_);  // precondition
  observed_ = false;
  DataParallelDecision d = pending_;
  d.action = action;
  if (forced_ || action < 1 || action > static_cast<int>(offers_.size())) {
    if (!forced_ && !offers_.empty()) d.reason = "the policy keeps the shares: " + d.reason;
    return d;
  }
  const Offer& chosen = offers_[action - 1];
  if (const std::string why = arrival_disagrees(chosen.counts); !why.empty()) {
    d.reason = "guardrail: " + why + "; " + evidence_;
    return d;
  }
  d.kind = DataParallelDecision::Kind::rebalance;
  d.counts = chosen.counts;
  d.predicted_new_ms = chosen.predicted_ms;
  d.reason = evidence_ + fmt("; %s shares: predicted step %.1f -> %.1f ms of compute",
                             chosen.what, d.predicted_now_ms, d.predicted_new_ms);
  pending_before_ms_ = now_ms_;
  pending_before_se_ = now_se_;
  since_switch_ = 0;
  return d;
}

std::string DataParallelDecider::arrival_disagrees(const std::vector<int>& target) const {
  if (waits_.empty()) return "";  // not measured everywhere
  const std::vector<double>& waits = waits_;
  const double least = *std::min_element(waits.begin(), waits.end());
  const double mid = monitor::median(waits);
  // Arriving last: waiting least, or within a quarter of the way from the least to the median.
  auto late = [&](int r) { return waits[r] <= least + o_.late_fraction * (mid - least); };
  std::vector<double> step_of(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) {
    step_of[r] = (fixed_apart_ ? 0.0 : model_fixed_[r]) + model_ps_[r] * counts_[r];
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
  last_switch_decision_ = decisions_;
}

void DataParallelDecider::aborted() { since_switch_ = 0; }

}  // namespace parapilot::env::dp
