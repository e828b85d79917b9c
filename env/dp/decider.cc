#include "env/dp/decider.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <tuple>

#include "env/dp/shares.h"
#include "env/dp/shares_model.h"
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

constexpr auto fmt = reason_text;

std::unique_ptr<SplitModel> shares_model(const DataParallelOptions& o) {
  return std::make_unique<SharesModel>(
      SharesModelOptions{o.ranks, o.global_batch, o.equal_band, o.noise_k, o.late_fraction});
}

// The bytes `c` sends over the bytes of no compression (DataParallelOptions::compression: fp16
// alone, half of fp32's).
double byte_ratio(const Compression& c) {
  return c.kind == Compression::Kind::kFP16 ? 0.5 : 1.0;
}

// The method DataParallelOptions::compression names (none for "").
Compression method_of(const std::string& text) {
  if (text.empty()) return {};
  const std::optional<Compression> c = parse_compression(text);
  // Precondition: deploy passes fp16 (the one method whose bytes are known up front).
  assert(c && c->kind == Compression::Kind::kFP16);
  return c.value_or(Compression{});
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
    case DataParallelDecision::Kind::compress:
      return "compress";
  }
  return "?";
}

DataParallelDecider::DataParallelDecider(DataParallelOptions options)
    : DataParallelDecider(options, shares_model(options)) {}

DataParallelDecider::DataParallelDecider(DataParallelOptions options,
                                         std::unique_ptr<SplitModel> model)
    : o_(options), model_(std::move(model)), cooldown_(options.cooldown_intervals) {
  // Preconditions: the agent checks a JobInfo's world size and batch, and deploy its flags,
  // before a decider is made; the simulator draws valid jobs.
  assert(model_ && o_.ranks >= 1 && o_.global_batch >= 1 && model_->total() >= o_.ranks &&
         o_.decision_steps >= 1);
  assert(o_.verify_steps >= 1 && o_.settle_steps >= 0 && o_.equal_band >= 0 && o_.noise_k >= 0 &&
         o_.max_revert_bound >= o_.revert_margin && o_.late_fraction >= 0);
  counts_ = even_counts(o_.ranks, model_->total());
  previous_counts_ = counts_;
  method_ = method_of(o_.compression);
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
// fastest split measured) made steps slower beyond noise, else held.
void DataParallelDecider::judge_last_switch(double now_ms, double now_se) {
  DataParallelDecision& d = pending_;
  const std::vector<double> after = steps_since(verify_from_);
  if (static_cast<int>(after.size()) < o_.verify_steps) {
    d.reason = fmt("measuring the last switch: %.0f of %.0f steps",
                   static_cast<double>(after.size()), static_cast<double>(o_.verify_steps));
    return;
  }
  verifying_ = false;
  if (link_.slow != link_slow_at_switch_ && compression_ == previous_compression_) {
    // The gradient all-reduce's link changed while the switch was measured (the monitor's
    // slow_link or link_restored): the steps before it say nothing of the job now.
    cooldown_ = o_.cooldown_intervals;
    judged_ms_ = now_ms;
    judged_se_ = now_se;
    remember_best(now_ms, now_se);
    d.reason = fmt("the last switch is not judged: the gradient all-reduce's link %s while it "
                   "was measured (%.1f ms per step after vs %.1f ms before)",
                   link_.slow ? "slowed" : "recovered", now_ms, before_ms_);
    return;
  }
  const double bound = revert_bound(before_ms_, before_se_, now_se);
  const double best_bound = revert_bound(best_ms_, best_se_, now_se);
  // Judged against the split just left, and against the fastest split measured since the
  // job last changed: switches that each stay within noise of the one before must not add up
  // to a job slower than it was.
  const bool worse_than_before = before_ms_ > 0 && now_ms > before_ms_ * (1 + bound);
  const bool worse_than_best =
      best_ms_ > 0 &&
      (best_counts_ != previous_counts_ || !(best_compression_ == previous_compression_)) &&
      now_ms > best_ms_ * (1 + best_bound);
  if (worse_than_before || worse_than_best) {
    forced_ = true;
    d.kind = DataParallelDecision::Kind::revert;
    const bool to_best = worse_than_best && best_ms_ < before_ms_;
    d.counts = to_best ? best_counts_ : previous_counts_;
    d.compression = to_best ? best_compression_ : previous_compression_;
    d.reason = to_best
                   ? fmt("the switches since the fastest %s measured made steps slower: "
                         "%.1f ms now vs %.1f ms on %s (+%.0f%%, beyond the noise bound of "
                         "%.0f%%)",
                         model_->noun(), now_ms, best_ms_, counts_text(best_counts_).c_str(),
                         100 * (now_ms / best_ms_ - 1), 100 * best_bound)
                   : fmt("the last switch made steps slower: %.1f ms after vs %.1f ms before "
                         "(+%.0f%%, beyond the noise bound of %.0f%%)",
                         now_ms, before_ms_, 100 * (now_ms / before_ms_ - 1), 100 * bound);
    cooldown_ = std::min(o_.max_backoff_intervals, std::max(1, cooldown_ * 2));
    since_switch_ = 0;
    return;
  }
  if (!(compression_ == previous_compression_)) {
    if (compression_ == Compression{}) {
      // The way back held: what the method's own work added to the wait.
      method_wait_ms_ = std::max(
          0.0, off_from_wait_ms_ - link_.wait_ms * byte_ratio(previous_compression_));
    } else {
      compressed_wait_ms_ = link_.wait_ms;
    }
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

// The candidates of the fitted model (every rank measured): its proposals and the fastest split
// measured, best predicted first, none equal to the split in force.
void DataParallelDecider::make_offers() {
  const double now_pred = model_->predict_ms(counts_);
  pending_.predicted_now_ms = now_pred;
  auto offer = [&](std::vector<int> counts, const char* what, const Compression& c) {
    if (counts == counts_ && c == compression_) return;
    for (const Offer& o : offers_) {
      if (o.counts == counts && o.compression == c) return;
    }
    const double ms = model_->predict_ms(counts);
    offers_.push_back({std::move(counts), ms, what, c});
  };
  for (SplitModel::Proposal& p : model_->proposals(counts_)) {
    offer(std::move(p.split), p.what, compression_);
  }
  if (!best_counts_.empty()) offer(best_counts_, "the fastest measured", best_compression_);
  const bool with_link = offer_compression(now_pred);
  std::stable_sort(offers_.begin(), offers_.end(),
                   [](const Offer& a, const Offer& c) { return a.predicted_ms < c.predicted_ms; });
  if (static_cast<int>(offers_.size()) > kMaxCandidates) offers_.resize(kMaxCandidates);

  // The ranks the best offer takes work from (the condition features follow them).
  shed_.clear();
  if (!offers_.empty()) {
    for (int r = 0; r < o_.ranks; ++r) {
      if (counts_[r] - offers_.front().counts[r] > 0) shed_.push_back(r);
    }
  }
  evidence_ = model_->evidence(counts_, offers_.empty() ? nullptr : &offers_.front().counts);
  if (with_link) {
    evidence_ += fmt("; gradient all-reduce: exposed wait %.1f ms for %.0f KB a step%s%s",
                     link_.wait_ms, link_.bytes / 1e3, link_.slow ? ", the link believed slow" : "",
                     compression_ == Compression{}
                         ? ""
                         : fmt(", %s in force (its cost %.2f ms of compute; %.1f ms of "
                               "wait when its switch held)",
                               to_string(compression_).c_str(), method_cost_ms_,
                               compressed_wait_ms_)
                               .c_str());
    if (method_wait_ms_ > 0) {
      evidence_ += fmt("; %s adds %.1f ms of wait itself (measured)", to_string(method_).c_str(),
                       method_wait_ms_);
    }
  }
  const char* unit = with_link ? "ms of compute and exposed wait" : "ms of compute";
  pending_.reason =
      offers_.empty()
          ? std::string(model_->noun()) + " already balanced; " + evidence_
          : fmt("best candidate %s (%s%s%s) predicted %.1f -> %.1f %s; ", offers_.front().what,
                counts_text(offers_.front().counts).c_str(), with_link ? ", " : "",
                with_link ? to_string(offers_.front().compression).c_str() : "",
                pending_.predicted_now_ms, offers_.front().predicted_ms, unit) +
                evidence_;
}

bool DataParallelDecider::offer_compression(double now_pred) {
  const bool in_force = !(compression_ == Compression{});
  if (link_.bytes <= 0 || (!in_force && (method_ == Compression{} || !link_.slow))) return false;
  // Every candidate in one unit: its compute plus the exposed wait of the bytes it sends.
  const double wait = std::max(0.0, link_.wait_ms);
  for (Offer& off : offers_) off.predicted_ms += wait * byte_ratio(off.compression) /
                                                 byte_ratio(compression_);
  pending_.predicted_now_ms = now_pred + wait;
  if (!in_force) {
    const double on_ms =
        now_pred + method_cost_ms_ + std::max(wait * byte_ratio(method_), method_wait_ms_);
    if (on_ms < pending_.predicted_now_ms) {
      offers_.push_back({counts_, on_ms, "compression", method_});
    }
    return true;
  }
  // What the job computed without the method, and the method's cost, as measured.
  method_cost_ms_ = std::max(0.0, now_pred - uncompressed_compute_);
  if (uncompressed_bytes_ > 0) {
    double back_wait = wait * std::max(1.0, uncompressed_bytes_ / link_.bytes);
    if (compressed_wait_ms_ > 0 && compressed_wait_ms_ - wait > link_.noise_ms &&
        reference_bw_ > 0) {
      // The link got faster: the uncompressed bytes at its bandwidth while normal.
      back_wait = std::min(back_wait, uncompressed_bytes_ / reference_bw_ / 1e3);
    }
    const double off_ms = std::max(0.0, now_pred - method_cost_ms_) + back_wait;
    if (off_ms < pending_.predicted_now_ms) {
      offers_.push_back({counts_, off_ms, "no compression", Compression{}});
    }
  }
  return true;
}

Observation DataParallelDecider::build(const monitor::Beliefs& b, bool offers) {
  Conditions c;
  c.gpu_speed = model_->speeds();
  c.gpu_failed = b.conditions.gpu_failed;
  c.gpu_failed.resize(o_.ranks, false);
  const double wait_ms = offers ? model_->exposed_wait_ms() : 0.0;
  // The current split's step: the model's when every rank is measured, else the measured one.
  double now_ms = offers ? pending_.predicted_now_ms : 0.0;
  if (now_ms <= 0) now_ms = now_ms_ > 0 ? now_ms_ : 1.0;
  const double step_s = (now_ms_ > 0 ? now_ms_ : now_ms) / 1000;
  std::vector<Candidate> candidates;
  for (const Offer& off : offers_) {
    Candidate cand;
    cand.strategy = model_->layout(off.counts);
    cand.strategy.compression = off.compression;
    cand.cost = step_cost(off.predicted_ms, o_.global_batch, wait_ms);
    cand.migration_s = model_->staged_s(counts_, off.counts, step_s);
    candidates.push_back(std::move(cand));
  }
  Strategy current = model_->layout(counts_);
  current.compression = compression_;
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
  in.staging_slowdown = model_->staging_slowdown();
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
  // The split in force, as the ranks report it (a job may start on its own split).
  if (std::vector<int> seen = model_->reported(b); static_cast<int>(seen.size()) == o_.ranks) {
    int sum = 0;
    for (int r = 0; r < o_.ranks; ++r) sum += seen[r];
    if (sum == model_->total() && *std::min_element(seen.begin(), seen.end()) >= 1 &&
        !verifying_ && !staging) {
      counts_ = std::move(seen);
    }
  }
  std::vector<double> recent = steps_since(verifying_ ? verify_from_ : 0);
  if (static_cast<int>(recent.size()) > o_.verify_steps) {
    recent.erase(recent.begin(), recent.end() - o_.verify_steps);
  }
  std::tie(now_ms_, now_se_) = centre(recent);
  pending_.current_step_ms = now_ms_;
  pending_.counts = counts_;
  pending_.compression = compression_;
  link_ = {b.slow_link, b.dp_link_ms, b.dp_bytes, b.dp_noise_ms, b.dp_reference};
  std::string why = guard(now_ms_, now_se_, staging);
  const std::string missing = model_->fit(b, counts_);
  if (why.empty()) {
    track_best(now_ms_, now_se_);
    if (!missing.empty()) {
      why = "no compute measurement yet from rank(s) " + missing;
    } else {
      make_offers();
    }
  }
  if (!why.empty()) pending_.reason = why;
  staging_ = staging;
  return build(b, why.empty());
}

DataParallelDecision DataParallelDecider::decide(int action) {
  assert(observed_);  // precondition
  observed_ = false;
  DataParallelDecision d = pending_;
  d.action = action;
  if (forced_ || action < 1 || action > static_cast<int>(offers_.size())) {
    if (!forced_ && !offers_.empty()) {
      d.reason = "the policy keeps the " + std::string(model_->noun()) + ": " + d.reason;
    }
    return d;
  }
  const Offer& chosen = offers_[action - 1];
  if (chosen.counts != counts_) {
    if (const std::string why = model_->disagrees(counts_, chosen.counts); !why.empty()) {
      d.reason = "guardrail: " + why + "; " + evidence_;
      return d;
    }
  }
  d.counts = chosen.counts;
  d.compression = chosen.compression;
  d.predicted_new_ms = chosen.predicted_ms;
  if (!(chosen.compression == compression_)) {
    d.kind = DataParallelDecision::Kind::compress;
    d.reason = evidence_ + fmt("; %s %s: predicted step %.1f -> %.1f ms of compute and exposed "
                               "wait",
                               chosen.what, to_string(chosen.compression).c_str(),
                               d.predicted_now_ms, d.predicted_new_ms);
    if (compression_ == Compression{}) {
      // What the job computes and sends without the method, for the way back.
      uncompressed_compute_ = model_->predict_ms(counts_);
      uncompressed_bytes_ = link_.bytes;
      reference_bw_ = link_.reference;
      compressed_wait_ms_ = 0;  // measured when the switch holds
    } else if (chosen.compression == Compression{}) {
      off_from_wait_ms_ = link_.wait_ms;
    }
  } else {
    d.kind = DataParallelDecision::Kind::rebalance;
    d.reason = evidence_ + fmt("; %s %s: predicted step %.1f -> %.1f ms of compute",
                               chosen.what, model_->noun(), d.predicted_now_ms,
                               d.predicted_new_ms);
  }
  pending_before_ms_ = now_ms_;
  pending_before_se_ = now_se_;
  since_switch_ = 0;
  return d;
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
  best_compression_ = compression_;
  best_ms_ = ms;
  best_se_ = se;
}

void DataParallelDecider::track_best(double now_ms, double now_se) {
  if (now_ms <= 0) return;
  if (best_ms_ <= 0 || (counts_ == best_counts_ && compression_ == best_compression_)) {
    remember_best(now_ms, now_se);  // the fastest split, re-measured as they run now
  } else if (judged_ms_ > 0 && now_ms > judged_ms_ * (1 + revert_bound(judged_ms_, judged_se_,
                                                                       now_se))) {
    // The split in force got slower without a switch: the job changed (a rank slowed), and
    // what other splits measured before says nothing of them now.
    remember_best(now_ms, now_se);
  }
  judged_ms_ = now_ms;
  judged_se_ = now_se;
}

void DataParallelDecider::committed(const std::vector<int>& counts, uint64_t switch_at_step,
                                    bool revert, const Compression& compression) {
  if (!revert) {
    previous_counts_ = counts_;
    previous_compression_ = compression_;
    verifying_ = true;
    verify_from_ = switch_at_step + static_cast<uint64_t>(o_.settle_steps);
    link_slow_at_switch_ = link_.slow;
    before_ms_ = pending_before_ms_;
    before_se_ = pending_before_se_;
  } else {
    verifying_ = false;
    previous_counts_ = counts;
    previous_compression_ = compression;
  }
  compression_ = compression;
  judged_ms_ = judged_se_ = 0;  // the new split are measured afresh
  counts_ = counts;
  since_switch_ = 0;
  last_switch_decision_ = decisions_;
}

void DataParallelDecider::aborted() { since_switch_ = 0; }

}  // namespace parapilot::env::dp
