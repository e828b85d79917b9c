// The stream threads of a worker's layout switches (layout_switch.h), one per plan being
// staged, and what the training thread does for them at each step.
//
// A plan's life on one rank:
//   1. start(): a thread builds the new layout (StagedLayout) beside training.
//   2. at_boundary(), the first boundary after the build: the training thread sends this
//      rank's snapshot of the pieces its peers take from it. The thread receives the peers'
//      snapshots, then calls ready(OK) (the worker's PlanReady).
//   3. Every step after: after_reduction() sends the step's reduced gradients of the same
//      pieces; release() (after a world collective later in the step, when every rank has
//      sent them) lets the thread receive them and apply them to its staged pieces.
//   4. take() at the committed boundary: waits until the thread applied every step before it
//      and hands over the staged copy. Or keep_only() drops the plan (aborted, refused, the
//      agent lost): its thread ends, and the running state was never written.
// A plan staged against another layout than the one running when its snapshot is due (the job
// switched to another plan first) is not streamed: take() returns it without its streamed
// pieces, and move_state sends them at the boundary. A failed build or receive calls
// ready(status) instead (the worker refuses the plan).
//
// A thread blocked on a peer that dropped the plan before it (aborts reach ranks at different
// boundaries) ends at the transfer group's timeout; training never waits for it, and the
// destructor joins it.
//
// Thread-safety: every member may be called from any thread; at_boundary, after_reduction,
// release and take are the training thread's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/status.h"
#include "env/live/layout_switch.h"

namespace parapilot::live {

class LayoutStager {
 public:
  using Build = std::function<StatusOr<StagedLayout>(const std::function<bool()>& cancelled)>;
  /// For the worker of world rank `rank`; `stream` false: no plan is streamed (every moved
  /// piece goes at the boundary, --switch-transfer at-boundary).
  LayoutStager(int rank, bool stream) : rank_(rank), stream_(stream) {}
  /// Starts plan_id's thread: build() (an exception it throws becomes kInternal), then
  /// streaming as above; ready(status) once, unless the plan was dropped first. A plan already
  /// known is left as it is.
  void start(std::uint64_t plan_id, Build build, std::function<void(const Status&)> ready);
  /// At the boundary before `step` (after any switch made there): sends the snapshot of every
  /// plan built since the last boundary. Returns the bytes started; a failed send's status.
  StatusOr<std::uint64_t> at_boundary(LayoutState& running, std::uint64_t step);
  /// After `step`'s gradient reduction, before the optimizer steps: sends the step's
  /// gradients for every streaming plan. Returns the bytes started; a failed send's status.
  StatusOr<std::uint64_t> after_reduction(LayoutState& running, std::uint64_t step);
  /// After a world collective of `step` that follows every rank's after_reduction(step).
  void release(std::uint64_t step);
  /// At the committed boundary before step `boundary`: plan_id's staged copy, its streamed
  /// pieces current through step boundary - 1 (incoming null when not streamed). Null when it
  /// is not staged here (still building, failed, dropped). A failed receive's status.
  StatusOr<std::unique_ptr<StagedLayout>> take(std::uint64_t plan_id, std::uint64_t boundary);
  /// Cancels and drops every plan for which keep(plan_id) is false; finished threads of dropped
  /// plans are joined here. Returns the plans dropped now.
  std::vector<std::uint64_t> keep_only(const std::function<bool(std::uint64_t)>& keep);
  /// Cancels everything and joins every thread.
  ~LayoutStager();

 private:
  struct Plan;
  void run(std::shared_ptr<Plan> plan, Build build, std::function<void(const Status&)> ready);

  const int rank_;
  const bool stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t released_ = 0;  ///< steps whose gradients every rank has sent: [0, released_).
  std::map<std::uint64_t, std::shared_ptr<Plan>> plans_;
  std::vector<std::shared_ptr<Plan>> dropped_;
};

}  // namespace parapilot::live
