// A layout switch of a running job (libtorch), double-buffered: the new layout's state is
// staged off the training path, then installed at the committed boundary.
//
//  - Staging (stage_layout, on a LayoutStager thread while training continues): the new
//    layout's LayoutState (its DP, TP and pipeline groups, stage model, optimizer, gradient
//    reduction) built over a c10d::PrefixStore keyed by the plan id, so its rendezvous never
//    meets the running layout's groups; a transfer group over the whole world (Gloo
//    point-to-point, also under the plan's prefix); and the transfer plan (transfer_plan.h).
//    Nothing of the running state is read: an abort drops the staged copy and the old layout
//    is untouched.
//  - At the committed boundary (move_state, on the training thread, every rank at the same
//    step): every parameter and Adam state piece of the new shards is copied locally or
//    received from its one source over the transfer group, exactly once; the caller then swaps
//    in the new LayoutState. The state moves here, not in the background: it is the state
//    after the last step before the boundary, so nothing can change after the copy.
//
// Thread-safety: LayoutStager's members may be called from any thread; stage_layout and
// move_state use only the objects passed to them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/status.h"
#include "env/live/layout_state.h"
#include "env/live/transfer_plan.h"

namespace parapilot::live {

/// What a rank staged for one plan.
struct StagedLayout {
  std::uint64_t plan_id = 0;
  LiveLayout from, to;
  std::unique_ptr<LayoutState> state;      ///< the new layout, parameters not yet moved.
  std::unique_ptr<PointToPoint> transfer;  ///< the world, for the move (group rank = rank).
  std::vector<TransferPiece> plan;         ///< transfer_plan(from, to).
  double staged_ms = 0;                    ///< wall time of staging.
};

/// Builds plan_id's staged copy of `to` for `rank` (the job runs `from`): groups over
/// PrefixStore("parapilot/switch/<plan_id>/", store). Every rank of the job must stage the
/// plan (a group's construction is a rendezvous). kCollectiveFailed when a rendezvous fails or
/// times out (a rank that refused the plan never joins: options.groups.timeout_s bounds it);
/// kUnavailable when `cancelled` becomes true first (checked while waiting `delay`, a test hook
/// that makes staging slow).
StatusOr<StagedLayout> stage_layout(std::uint64_t plan_id, const LiveLayout& from,
                                    const LiveLayout& to, int rank, Collectives& world,
                                    c10::intrusive_ptr<c10d::Store> store,
                                    const LayoutStateOptions& options,
                                    std::chrono::milliseconds delay,
                                    const std::function<bool()>& cancelled);

/// What one switch cost this rank.
struct SwitchStats {
  double move_ms = 0;            ///< copying and transferring the state.
  std::uint64_t bytes_sent = 0;  ///< to other ranks (parameters and optimizer state).
  std::uint64_t bytes_received = 0;
  std::uint64_t bytes_local = 0;  ///< copied within this rank.
};

/// Moves `from`'s parameters and optimizer state (Adam: exp_avg, exp_avg_sq and the step; SGD
/// has none) into `to.state` by `to.plan` (recomputed first when `from` no longer runs
/// `to.from`). Every rank of the world must call it at the same boundary. A failed transfer:
/// kCollectiveFailed (the new state is then unusable; the old one is untouched).
StatusOr<SwitchStats> move_state(LayoutState& from, StagedLayout& to, int rank,
                                 const ModelConfig& model);

/// Staging threads, one per plan being staged, and the staged copies they made.
class LayoutStager {
 public:
  using Stage = std::function<StatusOr<StagedLayout>(const std::function<bool()>& cancelled)>;
  /// Runs `stage` on a new thread for plan_id (an exception it throws becomes kInternal); when
  /// it returns, keeps its result (on success)
  /// and then calls done(status). A plan already staging or staged is left as it is.
  void start(std::uint64_t plan_id, Stage stage, std::function<void(const Status&)> done);
  /// The staged copy of plan_id (joining its thread), or null when it is not staged (still
  /// staging, failed, or dropped).
  std::unique_ptr<StagedLayout> take(std::uint64_t plan_id);
  /// Cancels and drops every plan for which keep(plan_id) is false (aborted, refused, missed or
  /// forgotten by the plan book); their threads end on their own (at most the group timeout)
  /// and are joined later. Finished threads are joined here. Returns the plans dropped now.
  std::vector<std::uint64_t> keep_only(const std::function<bool(std::uint64_t)>& keep);
  /// Plans staging or staged.
  std::size_t size() const;
  /// Cancels everything and joins every thread.
  ~LayoutStager();

 private:
  struct Entry {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> cancelled;
    std::shared_ptr<std::atomic<bool>> finished;
    std::unique_ptr<StagedLayout> staged;  ///< set by the thread under mu_.
  };
  mutable std::mutex mu_;
  std::map<std::uint64_t, Entry> plans_;
  std::vector<Entry> dropped_;
};

}  // namespace parapilot::live
