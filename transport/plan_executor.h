// Plan executor: the agent's side of the two-phase layout switch (docs/architecture.md, "The
// switch protocol"): PlanPrepare to every live rank -> each stages the new layout in the
// background while training continues -> PlanReady from every rank -> PlanCommit at an iteration
// boundary a few steps ahead -> Ack from every rank. A PlanReady{ok=false}, a rank lost before
// the commit, or the prepare deadline passing -> PlanAbort: everyone stays on the old layout.
// After the commit, a rank reporting that it missed the commit (PlanReady{ok=false} for the
// committed plan: the ranks' boundary check found the commit not held by every rank, so none
// switched) ends the plan as aborted too.
//
// Plan ids start from the clock so that an agent restarted mid-run never reuses a stale id.
//
// Thread-safety: every member function may be called from any thread. `send` is called under the
// executor's lock (so messages leave in protocol order); `on_done` is called outside it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "core/status.h"
#include "transport/messages.h"

namespace parapilot::transport {

struct PlanExecutorOptions {
  uint32_t prepare_deadline_ms = 30000;  ///< every PlanReady must arrive within this.
  uint32_t commit_margin_steps = 3;      ///< switch_at_step = newest step + 1 + at least this...
  uint32_t commit_lead_ms = 500;         ///< ...and at least this much wall time of steps ahead.
  uint64_t min_switch_step = 0;          ///< switch_at_step is at least this (0: no floor).
  uint32_t ack_timeout_ms = 30000;       ///< after the commit; a missing Ack is reported.
};

/// How a switch ended.
enum class PlanEnd {
  committed,     ///< every member acked (or was lost after the commit).
  acks_missing,  ///< committed; some Ack did not arrive in time (reason names the ranks).
  refused,       ///< a member answered PlanReady{ok=false} before the commit.
  timed_out,     ///< not every member answered PlanReady in time.
  rank_lost,     ///< a member left before the commit.
  missed,        ///< after the commit, the ranks found the plan not held by every rank.
};

struct PlanOutcome {
  uint64_t plan_id = 0;
  bool committed = false;  ///< end is committed or acks_missing: the ranks switched.
  PlanEnd end = PlanEnd::committed;
  std::string reason;  ///< why aborted, or notes (missing acks) when committed.
  uint64_t switch_at_step = 0;
  double prepare_ms = 0;  ///< PlanPrepare -> last PlanReady.
  double total_ms = 0;    ///< PlanPrepare -> last Ack (or abort).
};

class PlanExecutor {
 public:
  using Clock = std::chrono::steady_clock;
  using Send = std::function<void(const Message&)>;  ///< broadcast to every rank.
  using Done = std::function<void(const PlanOutcome&)>;

  PlanExecutor(PlanExecutorOptions options, Send send, Done on_done);

  /// Starts a switch of `ranks` to `plan` (its layout and layout_name; the executor sets its
  /// plan_id and deadline_ms) and returns the plan id. Nothing is sent on an error: kRejected
  /// while a switch is in flight (naming its plan id), kInvalidArgument when `ranks` is empty.
  StatusOr<uint64_t> prepare(PlanPrepare plan, const std::set<uint32_t>& ranks,
                             Clock::time_point now);
  /// `step_wall_ms`: the job's current wall time per step (0: unknown), for commit_lead_ms.
  void on_ready(const PlanReady& ready, uint64_t newest_step, Clock::time_point now,
                double step_wall_ms = 0);
  void on_ack(const Ack& ack, Clock::time_point now);
  void on_rank_lost(uint32_t rank, Clock::time_point now);
  /// Checks deadlines.
  void tick(Clock::time_point now);

  bool busy() const;
  /// Seconds since PlanPrepare while preparing (for the observation's staging features).
  double staging_elapsed_s(Clock::time_point now) const;
  std::optional<uint64_t> plan_in_flight() const;

 private:
  enum class Phase { idle, preparing, committing };
  void finish(PlanEnd end, std::string reason, Clock::time_point now,
              std::optional<PlanOutcome>& out);

  PlanExecutorOptions o_;
  Send send_;
  Done done_;
  mutable std::mutex mutex_;
  Phase phase_ = Phase::idle;
  uint64_t next_plan_id_;
  uint64_t plan_id_ = 0;
  std::set<uint32_t> waiting_;  // ranks whose PlanReady / Ack is outstanding
  std::set<uint32_t> members_;  // ranks in this plan
  uint64_t switch_at_ = 0;
  Clock::time_point started_, prepared_, deadline_;
};

}  // namespace parapilot::transport
