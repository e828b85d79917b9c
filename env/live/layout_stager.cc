#include "env/live/layout_stager.h"

#include <atomic>
#include <limits>
#include <string>

namespace parapilot::live {

struct LayoutStager::Plan {
  std::uint64_t id = 0;
  std::atomic<bool> cancelled{false};  ///< dropped (read by build() without the lock).
  // The rest under the stager's mutex.
  std::unique_ptr<StagedLayout> staged;  ///< set by the thread once built.
  bool snapshot_sent = false;            ///< this rank's snapshot is out: it streams.
  bool not_streamed = false;  ///< moved at the boundary (staged against a layout no longer
                              ///< running when its snapshot was due, or streaming off).
  bool done = false;     ///< the thread has nothing left to do (it may still be exiting).
  Status failure;        ///< a failed receive.
  std::uint64_t finish_at = std::numeric_limits<std::uint64_t>::max();  ///< set by take().
  std::uint64_t streamed_sent = 0;
  std::thread thread;
};

void LayoutStager::start(std::uint64_t plan_id, Build build,
                         std::function<void(const Status&)> ready) {
  std::lock_guard lock(mu_);
  if (plans_.count(plan_id)) return;
  auto plan = std::make_shared<Plan>();
  plan->id = plan_id;
  plans_[plan_id] = plan;
  plan->thread = std::thread(&LayoutStager::run, this, plan, std::move(build), std::move(ready));
}

void LayoutStager::run(std::shared_ptr<Plan> plan, Build build,
                       std::function<void(const Status&)> ready) {
  auto finish = [&](std::unique_lock<std::mutex>& lock) {
    plan->done = true;
    // The staged groups of a dropped plan go with this thread, outside the lock.
    std::unique_ptr<StagedLayout> gone =
        plan->cancelled ? std::move(plan->staged) : std::unique_ptr<StagedLayout>();
    cv_.notify_all();
    lock.unlock();
    gone.reset();
  };
  const std::string name = "plan " + std::to_string(plan->id);
  StatusOr<StagedLayout> made = Status::internal("staging did not run");
  try {
    made = build([&plan] { return plan->cancelled.load(); });
  } catch (const std::exception& err) {  // libtorch's errors while building the new layout
    made = Status::internal("staging " + name + ": " + err.what());
  }
  std::unique_lock lock(mu_);
  if (!made.ok() || plan->cancelled) {
    const Status st = plan->cancelled ? Status::unavailable(name + " was dropped") : made.status();
    finish(lock);
    if (!plan->cancelled) ready(st);
    return;
  }
  plan->staged = std::make_unique<StagedLayout>(std::move(*made));
  // The training thread sends this rank's snapshot at its next boundary (at_boundary).
  cv_.wait(lock, [&] { return plan->cancelled || plan->snapshot_sent || plan->not_streamed; });
  if (plan->cancelled) return finish(lock);
  StagedLayout& staged = *plan->staged;
  if (plan->not_streamed) {  // not streamed: every moved piece goes at the boundary
    finish(lock);
    ready(Status{});
    return;
  }
  staged.incoming = std::make_unique<IncomingState>(staged, rank_);
  IncomingState& in = *staged.incoming;
  lock.unlock();
  if (Status st = in.receive_snapshots(*staged.transfer); !st.ok()) {
    lock.lock();
    plan->failure = st;
    finish(lock);
    ready(Status::collective_failed(name + ": receiving the snapshot: " + st.message()));
    return;
  }
  if (!plan->cancelled) ready(Status{});
  // Each released step's gradients, applied in order, until take() or a drop.
  for (;;) {
    lock.lock();
    cv_.wait(lock, [&] {
      return plan->cancelled || plan->not_streamed || in.next_step() >= plan->finish_at ||
             in.next_step() < released_;
    });
    if (plan->cancelled || plan->not_streamed || in.next_step() >= plan->finish_at) break;
    const std::uint64_t step = in.next_step();
    lock.unlock();
    if (Status st = in.apply(*staged.transfer, step); !st.ok()) {
      lock.lock();
      plan->failure = st;
      break;
    }
  }
  finish(lock);
}

StatusOr<std::uint64_t> LayoutStager::at_boundary(LayoutState& running, std::uint64_t step) {
  std::lock_guard lock(mu_);
  std::uint64_t bytes = 0;
  for (auto& [id, plan] : plans_) {
    if (!plan->staged || plan->not_streamed || plan->cancelled) continue;
    if (!stream_ || !(running.layout() == plan->staged->from)) {
      plan->not_streamed = true;
      continue;
    }
    if (plan->snapshot_sent) continue;
    StatusOr<std::uint64_t> sent = send_snapshot(running, *plan->staged, rank_, step);
    if (!sent.ok()) return sent.status();
    plan->snapshot_sent = true;
    plan->streamed_sent += *sent;
    bytes += *sent;
  }
  cv_.notify_all();
  return bytes;
}

StatusOr<std::uint64_t> LayoutStager::after_reduction(LayoutState& running, std::uint64_t step) {
  std::lock_guard lock(mu_);
  std::uint64_t bytes = 0;
  for (auto& [id, plan] : plans_) {
    if (!plan->snapshot_sent || plan->not_streamed || plan->cancelled) continue;
    StatusOr<std::uint64_t> sent = send_gradients(running, *plan->staged, rank_, step);
    if (!sent.ok()) return sent.status();
    plan->streamed_sent += *sent;
    bytes += *sent;
  }
  return bytes;
}

void LayoutStager::release(std::uint64_t step) {
  std::lock_guard lock(mu_);
  released_ = std::max(released_, step + 1);
  cv_.notify_all();
}

StatusOr<std::unique_ptr<StagedLayout>> LayoutStager::take(std::uint64_t plan_id,
                                                           std::uint64_t boundary) {
  std::unique_lock lock(mu_);
  auto it = plans_.find(plan_id);
  if (it == plans_.end() || !it->second->staged ||
      (!it->second->snapshot_sent && !it->second->not_streamed))
    return std::unique_ptr<StagedLayout>();
  std::shared_ptr<Plan> plan = it->second;
  plan->finish_at = boundary;
  cv_.notify_all();
  cv_.wait(lock, [&] { return plan->done; });
  plans_.erase(it);
  lock.unlock();
  if (plan->thread.joinable()) plan->thread.join();
  if (!plan->failure.ok()) return plan->failure;
  std::unique_ptr<StagedLayout> staged = std::move(plan->staged);
  if (plan->not_streamed) staged->incoming.reset();
  if (staged->incoming && staged->incoming->next_step() != boundary)
    return Status::internal("plan " + std::to_string(plan_id) + ": streamed through step " +
                            std::to_string(staged->incoming->next_step()) + ", committed at " +
                            std::to_string(boundary));
  staged->streamed_sent = plan->streamed_sent;
  return staged;
}

std::vector<std::uint64_t> LayoutStager::keep_only(const std::function<bool(std::uint64_t)>& keep) {
  std::vector<std::shared_ptr<Plan>> finished;
  std::vector<std::uint64_t> dropped;
  {
    std::lock_guard lock(mu_);
    for (auto it = plans_.begin(); it != plans_.end();) {
      if (keep(it->first)) {
        ++it;
        continue;
      }
      it->second->cancelled = true;
      dropped.push_back(it->first);
      dropped_.push_back(std::move(it->second));
      it = plans_.erase(it);
    }
    cv_.notify_all();
    for (auto it = dropped_.begin(); it != dropped_.end();) {
      if ((*it)->done) {
        finished.push_back(std::move(*it));
        it = dropped_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Joined outside the lock (their staged groups went with their threads).
  for (auto& p : finished)
    if (p->thread.joinable()) p->thread.join();
  return dropped;
}

LayoutStager::~LayoutStager() {
  std::vector<std::shared_ptr<Plan>> all;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, p] : plans_) {
      p->cancelled = true;
      all.push_back(p);
    }
    plans_.clear();
    for (auto& p : dropped_) all.push_back(p);
    dropped_.clear();
    cv_.notify_all();
  }
  for (auto& p : all)
    if (p->thread.joinable()) p->thread.join();
}

}  // namespace parapilot::live
