#include "transport/plan_executor.h"

#include <algorithm>
#include <cmath>


namespace parapilot::transport {

namespace {
double ms_between(PlanExecutor::Clock::time_point a, PlanExecutor::Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
}  // namespace

PlanExecutor::PlanExecutor(PlanExecutorOptions options, Send send, Done on_done)
    : o_(options), send_(std::move(send)), done_(std::move(on_done)) {
  // Ids from the wall clock (microseconds): a restarted agent never reuses a recent id.
  next_plan_id_ = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count());
}

StatusOr<uint64_t> PlanExecutor::prepare(PlanPrepare plan, const std::set<uint32_t>& ranks,
                                         Clock::time_point now) {
  std::lock_guard lock(mutex_);
  if (phase_ != Phase::idle)
    return Status::rejected("a switch is in flight (plan " + std::to_string(plan_id_) + ")");
  if (ranks.empty()) return Status::invalid_argument("a switch needs at least one rank");
  phase_ = Phase::preparing;
  plan_id_ = next_plan_id_++;
  members_ = ranks;
  waiting_ = ranks;
  started_ = now;
  deadline_ = now + std::chrono::milliseconds(o_.prepare_deadline_ms);
  plan.plan_id = plan_id_;
  plan.deadline_ms = o_.prepare_deadline_ms;
  send_(plan);
  return plan_id_;
}

void PlanExecutor::finish(PlanEnd end, std::string reason, Clock::time_point now,
                               std::optional<PlanOutcome>& out) {
  const bool committed = end == PlanEnd::committed || end == PlanEnd::acks_missing;
  PlanOutcome r;
  r.plan_id = plan_id_;
  r.committed = committed;
  r.end = end;
  r.reason = std::move(reason);
  r.switch_at_step = switch_at_;
  r.prepare_ms = phase_ == Phase::committing ? ms_between(started_, prepared_) : 0.0;
  r.total_ms = ms_between(started_, now);
  if (!committed) {
    PlanAbort a;
    a.plan_id = plan_id_;
    a.reason = r.reason.substr(0, kMaxTextBytes);
    send_(a);
  }
  phase_ = Phase::idle;
  waiting_.clear();
  members_.clear();
  out = std::move(r);
}

void PlanExecutor::on_ready(const PlanReady& ready, uint64_t newest_step,
                                 Clock::time_point now, double step_wall_ms) {
  std::optional<PlanOutcome> out;
  {
    std::lock_guard lock(mutex_);
    if (phase_ == Phase::idle || ready.plan_id != plan_id_ || !members_.count(ready.rank)) return;
    if (!ready.ok) {
      const std::string why = "rank " + std::to_string(ready.rank) + ": " + ready.detail;
      if (phase_ == Phase::committing)
        finish(PlanEnd::missed, "commit missed, nobody switched (" + why + ")", now, out);
      else
        finish(PlanEnd::refused, why, now, out);
    } else if (phase_ == Phase::preparing) {
      waiting_.erase(ready.rank);
      if (waiting_.empty()) {
        phase_ = Phase::committing;
        prepared_ = now;
        uint64_t margin = o_.commit_margin_steps;
        if (step_wall_ms > 0) {
          margin = std::max<uint64_t>(
              margin, static_cast<uint64_t>(std::ceil(o_.commit_lead_ms / step_wall_ms)));
        }
        switch_at_ = std::max<uint64_t>(newest_step + 1 + margin, o_.min_switch_step);
        waiting_ = members_;
        deadline_ = now + std::chrono::milliseconds(o_.ack_timeout_ms);
        send_(PlanCommit{plan_id_, switch_at_});
      }
    }
  }
  if (out && done_) done_(*out);
}

void PlanExecutor::on_ack(const Ack& ack, Clock::time_point now) {
  std::optional<PlanOutcome> out;
  {
    std::lock_guard lock(mutex_);
    if (phase_ != Phase::committing || ack.acked != MessageType::plan_commit ||
        ack.id != plan_id_) {
      return;
    }
    waiting_.erase(ack.rank);
    if (waiting_.empty()) finish(PlanEnd::committed, "", now, out);
  }
  if (out && done_) done_(*out);
}

void PlanExecutor::on_rank_lost(uint32_t rank, Clock::time_point now) {
  std::optional<PlanOutcome> out;
  {
    std::lock_guard lock(mutex_);
    if (phase_ == Phase::idle || !members_.count(rank)) return;
    if (phase_ == Phase::preparing) {
      finish(PlanEnd::rank_lost, "rank " + std::to_string(rank) + " lost while staging", now,
             out);
    } else {
      members_.erase(rank);
      waiting_.erase(rank);
      if (waiting_.empty()) {
        finish(PlanEnd::committed, "rank " + std::to_string(rank) + " lost after the commit",
               now, out);
      }
    }
  }
  if (out && done_) done_(*out);
}

void PlanExecutor::tick(Clock::time_point now) {
  std::optional<PlanOutcome> out;
  {
    std::lock_guard lock(mutex_);
    if (phase_ == Phase::idle || now < deadline_) return;
    std::string missing;
    for (uint32_t r : waiting_) {
      if (missing.size() > 200) {
        missing += " ...";
        break;
      }
      if (!missing.empty()) missing.push_back(',');
      missing.append(std::to_string(r));
    }
    if (phase_ == Phase::preparing) {
      finish(PlanEnd::timed_out, "timeout waiting for PlanReady from ranks " + missing, now,
             out);
    } else {
      finish(PlanEnd::acks_missing, "no Ack from ranks " + missing, now, out);
    }
  }
  if (out && done_) done_(*out);
}

bool PlanExecutor::busy() const {
  std::lock_guard lock(mutex_);
  return phase_ != Phase::idle;
}

double PlanExecutor::staging_elapsed_s(Clock::time_point now) const {
  std::lock_guard lock(mutex_);
  return phase_ == Phase::idle ? 0.0 : ms_between(started_, now) / 1000.0;
}

std::optional<uint64_t> PlanExecutor::plan_in_flight() const {
  std::lock_guard lock(mutex_);
  if (phase_ == Phase::idle) return std::nullopt;
  return plan_id_;
}

}  // namespace parapilot::transport
