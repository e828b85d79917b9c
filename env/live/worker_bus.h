// The worker's side of the bus: connects to the agent (a transport TCP Server), publishes
// telemetry, and keeps the plans the agent prepares and commits in the rank's plan book
// (transport/plan_book.h, the one rank-side implementation of the switch protocol) until the
// training loop's boundary applies or drops them. No libtorch here.
//
// Plan protocol (docs/architecture.md, "The switch protocol"): PlanPrepare -> the job's
// read_plan checks it and the action is staged (at once, or, for an action the job stages in
// the background such as a layout change, when its stager says so) -> PlanReady{ok, detail} ->
// PlanCommit -> at each boundary the ranks agree (committed_at reduced with MAX, then holds with
// AND; see transport/plan_book.h) and all switch (applied: Ack) or none does (missed). PlanAbort
// drops a plan before its commit; losing the agent drops the plans it did not commit. Shutdown asks
// the job to stop at the next boundary.
//
// Thread-safety: all members may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "env/live/action.h"
#include "transport/bus.h"
#include "transport/plan_book.h"

namespace parapilot::live {

class WorkerBus {
 public:
  /// Connects in the background to "host:port" with the secret read from `secret_file`:
  /// kInvalidArgument (or the secret reader's Status) naming the flag on a bad address or
  /// secret file.
  /// `read_plan` turns a PlanPrepare into the action this job will apply (action_from_plan plus
  /// the job's own checks), or the Status saying why the job cannot run it; such a plan is
  /// answered PlanReady{ok = false, detail = the Status's message}.
  /// `job` is announced to the agent first on every (re)connection.
  using PlanReader = std::function<StatusOr<LiveAction>(const transport::PlanPrepare&)>;
  /// `stage_async`, when set, is called (on the bus thread; it must not block) for a read plan
  /// whose action changes the layout: it starts staging and calls done(Status) when staging
  /// ended, from any thread. The plan is staging from the call and held (PlanReady{ok}) only
  /// after done(OK); done(error) refuses it (PlanReady{ok = false, the message}) unless it was
  /// dropped meanwhile. Other plans are staged at once.
  using Done = std::function<void(const Status&)>;
  using StageAsync = std::function<void(std::uint64_t plan_id, const LiveAction&, Done done)>;
  static StatusOr<std::unique_ptr<WorkerBus>> connect(const std::string& agent,
                                                      const std::string& secret_file, int rank,
                                                      PlanReader read_plan, transport::JobInfo job,
                                                      StageAsync stage_async = {});
  ~WorkerBus();
  WorkerBus(const WorkerBus&) = delete;
  WorkerBus& operator=(const WorkerBus&) = delete;

  bool connected() const;
  /// Waits up to `timeout_ms` for the connection.
  bool wait_connected(int timeout_ms) const;
  void send(const transport::Message& m);
  /// Flushes queued messages (up to timeout_ms).
  void flush(int timeout_ms);

  /// Boundary agreement 1 (transport::PlanBook::committed_at): the newest plan > after_id
  /// committed here for a switch at or before `step` (0: none).
  std::uint64_t committed_at(std::uint64_t step, std::uint64_t after_id) const;
  /// Boundary agreement 2: this rank has plan_id staged.
  bool holds(std::uint64_t plan_id) const;
  /// Every rank holds plan_id: its action, acked to the agent (nullopt when not held here).
  std::optional<LiveAction> applied(std::uint64_t plan_id);
  /// Some rank does not hold plan_id: nobody switches; the agent is told (PlanReady{ok=false}).
  void missed(std::uint64_t plan_id, const std::string& detail);
  /// The agent asked the job to stop.
  bool stop_requested() const;
  /// plan_id is staging or held here (not refused, aborted, dropped, applied or missed).
  bool knows(std::uint64_t plan_id);

 private:
  WorkerBus(int rank, PlanReader read_plan, transport::JobInfo job);
  void on_message(transport::Message&& m);

  PlanReader read_plan_;
  StageAsync stage_async_;
  transport::JobInfo job_;
  // The announcement goes out from on_connect, which may run before client_ is assigned.
  std::atomic<transport::Client*> live_client_{nullptr};
  std::atomic<bool> announce_pending_{false};
  transport::PlanBook<LiveAction> book_;
  std::unique_ptr<transport::Client> client_;
};

}  // namespace parapilot::live
