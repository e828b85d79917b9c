// A layout switch of a running job (libtorch), double-buffered: the new layout is built and the
// state it needs from other ranks is streamed to it while training continues on the old one;
// at the committed boundary the staged copy is installed.
//
//  - Staging (stage_layout, on the plan's stream thread, layout_stager.h): the new layout's
//    LayoutState (its DP, TP and pipeline groups, stage model, optimizer, gradient reduction)
//    built over a c10d::PrefixStore keyed by the plan id, so its rendezvous never meets the
//    running layout's groups; a transfer group over the whole world (Gloo point-to-point, also
//    under the plan's prefix); and the transfer plan (transfer_plan.h).
//  - Streaming (send_snapshot and send_gradients on the training thread; IncomingState on the
//    stream thread). At its first boundary after the new layout is built, every rank sends each
//    peer a snapshot of the pieces that peer takes from it: parameters, Adam's exp_avg and
//    exp_avg_sq, and Adam's step count. After every later step's gradient reduction it sends
//    that step's reduced gradients of the same pieces (a third of the snapshot's bytes). The
//    receiver applies each step's gradients to its staged pieces with a second instance of the
//    job's own optimizer (make_optimizer), so the staged pieces follow the holder's state step
//    by step: the same elementwise update on the same inputs. The sends are asynchronous on the
//    transfer group; nothing of the running state is written, so an abort drops the staged
//    copy and the old layout is untouched.
//  - At the committed boundary (move_state, the training thread, every rank at the same step):
//    pieces a rank keeps are copied locally from its running state; pieces streamed to it are
//    copied from the staged copy, which by then has every step's update up to the boundary.
//    Without a staged copy (--switch-transfer at-boundary, or a plan staged against a layout
//    the job no longer ran when its snapshot was due) every moved piece is sent at the
//    boundary instead. Which of the two a switch takes depends only on the flag and on layouts
//    every rank agreed on, so all ranks take the same one.
//  - Error feedback (the compressors' residuals and PowerSGD's bases, feedback_state.h) is
//    never streamed: a residual does not follow from the streamed gradients (top-k's choice
//    and PowerSGD's projection depend on the whole tensor and the DP group). It moves at the
//    committed boundary, in move_state, through one world all-reduce into the new layout's
//    replicas (gather_feedback with one slot per new replica, install_feedback).
//
// Thread-safety: the functions use only the objects passed to them. While a plan streams, its
// transfer group's sends are started by the training thread only and its receives made by the
// stream thread only; the boundary move runs after the stream thread ended.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/status.h"
#include "env/live/layout_state.h"
#include "env/live/transfer_plan.h"

namespace parapilot::live {

class IncomingState;

/// What a rank staged for one plan.
struct StagedLayout {
  std::uint64_t plan_id = 0;
  LiveLayout from, to;
  std::unique_ptr<LayoutState> state;       ///< the new layout, parameters not yet moved.
  std::unique_ptr<PointToPoint> transfer;   ///< the world, for the move (group rank = rank).
  std::vector<TransferPiece> plan;          ///< transfer_plan(from, to).
  std::unique_ptr<IncomingState> incoming;  ///< the streamed pieces; null: move them at the boundary.
  double staged_ms = 0;                     ///< wall time of building the new layout.
  std::uint64_t streamed_sent = 0;          ///< bytes this rank streamed to others before the boundary.
  StagedLayout();
  StagedLayout(StagedLayout&&) noexcept;
  StagedLayout& operator=(StagedLayout&&) noexcept;
  ~StagedLayout();
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

/// The pieces `to` streams to this rank (those it takes from other ranks), staged and kept
/// current. Used by one thread at a time (the stream thread, then the training thread at the
/// boundary).
class IncomingState {
 public:
  /// For the pieces of `staged.plan` whose target is `rank` and source another rank.
  IncomingState(const StagedLayout& staged, int rank);
  ~IncomingState();
  /// Receives every source's snapshot (blocking, in source order, at most the group's timeout
  /// each). The failed receive's status.
  Status receive_snapshots(PointToPoint& transfer);
  /// Receives step's reduced gradients from every source whose snapshot is of this step or an
  /// earlier one, and applies them. Steps in increasing order, each once.
  Status apply(PointToPoint& transfer, std::uint64_t step);
  /// The next step to apply: every source's staged pieces hold its state at the boundary
  /// before this step (the oldest snapshot's step until apply() runs; 0 without sources).
  std::uint64_t next_step() const { return next_step_; }
  /// Copies the staged pieces into `to`'s parameters and, when `adam_state`, into its Adam
  /// state (which must exist). Returns the bytes copied.
  std::uint64_t install(LayoutState& to, bool adam_state);

 private:
  struct Source;
  LayoutStateOptions options_;
  std::vector<std::unique_ptr<Source>> sources_;
  std::uint64_t next_step_ = 0;
};

/// Starts sending every peer the snapshot of the pieces it takes from this rank under
/// `staged.plan` (parameters, Adam state when the optimizer has stepped), taken from `running`
/// at the boundary before `step`. Asynchronous: the copies sent are this call's own.
/// Precondition: running.layout() == staged.from. Returns the bytes started.
StatusOr<std::uint64_t> send_snapshot(LayoutState& running, StagedLayout& staged, int rank,
                                      std::uint64_t step);
/// Starts sending every peer `step`'s reduced gradients of the same pieces (call after the
/// gradient reduction, before the optimizer steps). Returns the bytes started.
StatusOr<std::uint64_t> send_gradients(LayoutState& running, StagedLayout& staged, int rank,
                                       std::uint64_t step);

/// What one switch cost this rank.
struct SwitchStats {
  double move_ms = 0;            ///< installing the new state (the part of the pause it adds).
  bool streamed = false;         ///< moved pieces came from the streamed copy.
  std::uint64_t bytes_sent = 0;  ///< to other ranks at the boundary (parameters and state).
  std::uint64_t bytes_received = 0;
  std::uint64_t bytes_local = 0;  ///< copied within this rank.
  /// Bytes of the error feedback's all-reduce (this rank's buffer; 0 when nothing was owed).
  std::uint64_t feedback_bytes = 0;
};

/// Moves `from`'s parameters and optimizer state (Adam: exp_avg, exp_avg_sq and the step; SGD
/// has none) into `to.state` by `to.plan`: local pieces copied; the others installed from
/// `to.incoming` when it is set and `from` runs `to.from` (the caller's contract: incoming
/// applied every step before this boundary, on every rank alike), sent now otherwise (the plan
/// recomputed first when `from` no longer runs `to.from`). Then what `from`'s compressors owe
/// goes to `to.state`'s over `job` (the world's collectives): summed over the old replicas, new replica
/// d gets the old replicas d' with d' % to.dp == d (feedback_state.h). Every rank of the world
/// must call it at the same boundary. A failed transfer or all-reduce: kCollectiveFailed (the
/// new state is then unusable; the old one is untouched).
StatusOr<SwitchStats> move_state(LayoutState& from, StagedLayout& to, int rank,
                                 const ModelConfig& model, Collectives& job);

}  // namespace parapilot::live
