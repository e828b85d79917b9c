// The rank's side of the switch protocol (docs/architecture.md, "The switch protocol"): the plans
// one rank holds from PlanPrepare until a boundary applies or drops them. Every C++ rank uses it
// (the worker's WorkerBus, the simulated cluster's ranks); the Python client's PlanBook
// (python/parapilot/plans.py) has the same methods and rules, and both replay the transcripts
// in tests/data/switch/.
//
// A plan is staging (stage()), staged (ready(): PlanReady{ok}), committed (PlanCommit), then
// applied at a boundary (Ack) or dropped: refused (PlanReady{ok=false}), aborted before its
// commit, the agent lost before its commit, or missed at the boundary.
//
// The commit rule, at the boundary before step `s`, in two agreements over the job's live ranks
// (each participant reduces with what it has: the worker with collectives, the simulated
// cluster with a loop):
//  1. committed_at(s, running) from every rank, reduced with MAX: P, the newest plan committed
//     on some rank for a switch at or before s (0: none, nothing more to do).
//  2. holds(P) from every rank, reduced with AND.
// Then every rank calls applied(P) and switches to its staged copy, or, when some rank does not
// hold P, every rank calls missed(P) and nobody switches. A rank that staged P but has not been
// reached by the commit yet switches with the others: the agent commits only once every rank
// answered PlanReady{ok}.
//
// Messages other than the plan protocol's and Shutdown are not its business. A PlanCommit for
// a plan this rank does not hold and a PlanAbort for a committed plan are ignored (the boundary
// agreement keeps the ranks together); PlanAbort with plan id 0 (no plan will come) carries
// only its reason.
//
// Thread-safety: every member may be called from any thread (one lock); `send` is called with
// the lock released, in the order the calls that send were made.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "transport/messages.h"

namespace parapilot::transport {

template <class Staged>
class PlanBook {
 public:
  using Send = std::function<void(const Message&)>;

  PlanBook(std::uint32_t rank, Send send) : rank_(rank), send_(std::move(send)) {}

  /// Handles one message from the agent. Returns a PlanPrepare for the caller to check and
  /// stage (then stage() and ready(), or refuse()); nullopt for everything else.
  std::optional<PlanPrepare> on_message(const Message& m) {
    std::lock_guard lock(mu_);
    if (const auto* p = std::get_if<PlanPrepare>(&m)) {
      if (p->plan_id == 0) return std::nullopt;  // not a plan id any agent sends
      return *p;
    }
    if (const auto* c = std::get_if<PlanCommit>(&m)) {
      auto it = plans_.find(c->plan_id);
      if (it != plans_.end()) {
        it->second.committed = true;
        it->second.switch_at_step = c->switch_at_step;
      }
    } else if (const auto* a = std::get_if<PlanAbort>(&m)) {
      if (a->plan_id == 0) {
        no_plans_reason_ = a->reason;
      } else if (auto it = plans_.find(a->plan_id); it != plans_.end() && !it->second.committed) {
        plans_.erase(it);
      }
    } else if (const auto* s = std::get_if<Shutdown>(&m)) {
      stop_reason_ = s->reason.empty() ? "the agent asked the job to stop" : s->reason;
    }
    return std::nullopt;
  }

  /// The caller is staging plan_id into `staged` (what the switch will install). Until ready()
  /// the plan is not held.
  void stage(std::uint64_t plan_id, Staged staged) {
    std::lock_guard lock(mu_);
    plans_.insert_or_assign(plan_id, Plan{std::move(staged), false, false, 0});
  }
  /// Staging of plan_id is complete: PlanReady{ok}. Ignored for a plan no longer staging.
  void ready(std::uint64_t plan_id) {
    {
      std::lock_guard lock(mu_);
      auto it = plans_.find(plan_id);
      if (it == plans_.end() || it->second.ready) return;
      it->second.ready = true;
    }
    send_(PlanReady{plan_id, rank_, true, ""});
  }
  /// This rank cannot run plan_id: PlanReady{ok=false, detail = why}; the plan is dropped.
  void refuse(std::uint64_t plan_id, const std::string& why) {
    {
      std::lock_guard lock(mu_);
      plans_.erase(plan_id);
    }
    send_(PlanReady{plan_id, rank_, false, why.substr(0, kMaxTextBytes)});
  }
  /// The agent's connection was lost: plans not committed are dropped (a restarted agent makes
  /// its own; a committed one may be switching on the other ranks and stays).
  void drop_uncommitted() {
    std::lock_guard lock(mu_);
    std::erase_if(plans_, [](const auto& entry) { return !entry.second.committed; });
  }

  /// Agreement 1: the newest plan id > after_id committed here with switch_at_step <= step
  /// (0: none).
  std::uint64_t committed_at(std::uint64_t step, std::uint64_t after_id) const {
    std::lock_guard lock(mu_);
    std::uint64_t best = 0;
    for (const auto& [id, p] : plans_)
      if (id > after_id && p.committed && p.switch_at_step <= step) best = id;
    return best;
  }
  /// Agreement 2: plan_id is staged here (committed or not).
  bool holds(std::uint64_t plan_id) const {
    std::lock_guard lock(mu_);
    auto it = plans_.find(plan_id);
    return it != plans_.end() && it->second.ready;
  }
  /// Every rank holds plan_id: returns its staged copy, forgets it and every older plan, and
  /// acks. nullopt when this rank does not hold it (a broken agreement: the caller's bug).
  std::optional<Staged> applied(std::uint64_t plan_id) {
    std::optional<Staged> out;
    {
      std::lock_guard lock(mu_);
      auto it = plans_.find(plan_id);
      if (it == plans_.end() || !it->second.ready) return std::nullopt;
      out = std::move(it->second.staged);
      plans_.erase(plans_.begin(), std::next(it));
    }
    send_(Ack{MessageType::plan_commit, plan_id, rank_});
    return out;
  }
  /// Some rank does not hold plan_id: nobody switches. Drops it here and answers
  /// PlanReady{ok=false, detail} so that the agent ends the plan.
  void missed(std::uint64_t plan_id, const std::string& detail) {
    {
      std::lock_guard lock(mu_);
      plans_.erase(plan_id);
    }
    send_(PlanReady{plan_id, rank_, false, detail.substr(0, kMaxTextBytes)});
  }

  /// Runs `f(plan_id, Staged&)` on every plan held or staging, oldest first, under the lock
  /// (for state staged in the background, such as a log of the steps applied since the copy).
  template <class F>
  void for_each(F&& f) {
    std::lock_guard lock(mu_);
    for (auto& [id, p] : plans_) f(id, p.staged);
  }
  /// Plans held or staging.
  std::size_t size() const {
    std::lock_guard lock(mu_);
    return plans_.size();
  }
  /// Set by Shutdown: the job should stop at its next boundary.
  std::optional<std::string> stop_reason() const {
    std::lock_guard lock(mu_);
    return stop_reason_;
  }
  /// Set by PlanAbort with plan id 0: why the agent will send no plans.
  std::optional<std::string> no_plans_reason() const {
    std::lock_guard lock(mu_);
    return no_plans_reason_;
  }

 private:
  struct Plan {
    Staged staged;
    bool ready = false;
    bool committed = false;
    std::uint64_t switch_at_step = 0;
  };
  const std::uint32_t rank_;
  const Send send_;
  mutable std::mutex mu_;
  std::map<std::uint64_t, Plan> plans_;
  std::optional<std::string> stop_reason_, no_plans_reason_;
};

}  // namespace parapilot::transport
