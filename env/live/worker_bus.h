// The worker's side of the bus: connects to the agent (a transport TCP Server), publishes
// telemetry, and holds the plans the agent prepares and commits until the training loop applies
// them at an iteration boundary. No libtorch here.
//
// Plan protocol (docs/live.md): PlanPrepare{plan_id, layout (+ layout_name)} ->
// PlanReady{ok, detail} -> PlanCommit{plan_id, switch_at_step} -> the ranks agree on the step
// through a tiny max all-reduce at each boundary (so all switch at the same step even when a
// commit reaches them at different times) -> Ack{plan_commit, plan_id, rank}. PlanAbort drops
// a staged plan. Shutdown asks the job to stop at the next boundary.
//
// Thread-safety: all members may be called from any thread.
#pragma once

#include <atomic>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "env/live/action.h"
#include "transport/bus.h"

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
  static StatusOr<std::unique_ptr<WorkerBus>> connect(const std::string& agent,
                                                       const std::string& secret_file, int rank,
                                                       PlanReader read_plan,
                                                       transport::JobInfo job);
  ~WorkerBus();
  WorkerBus(const WorkerBus&) = delete;
  WorkerBus& operator=(const WorkerBus&) = delete;

  bool connected() const;
  /// Waits up to `timeout_ms` for the connection.
  bool wait_connected(int timeout_ms) const;
  void send(const transport::Message& m);
  /// Flushes queued messages (up to timeout_ms).
  void flush(int timeout_ms);

  /// The newest committed plan whose switch step is <= step, if newer than `after_id`.
  /// Returns its id (0 when none).
  std::uint64_t committed_at(std::uint64_t step, std::uint64_t after_id) const;
  /// The action of a prepared plan (nullopt when unknown or aborted).
  std::optional<LiveAction> plan(std::uint64_t plan_id) const;
  /// The agent asked the job to stop.
  bool stop_requested() const;

 private:
  WorkerBus(int rank, PlanReader read_plan, transport::JobInfo job);
  struct Plan {
    LiveAction action;
    bool committed = false;
    std::uint64_t switch_at_step = 0;
  };
  void on_message(transport::Message&& m);

  int rank_;
  PlanReader read_plan_;
  transport::JobInfo job_;
  // The announcement goes out from on_connect, which may run before client_ is assigned.
  std::atomic<transport::Client*> live_client_{nullptr};
  std::atomic<bool> announce_pending_{false};
  mutable std::mutex mu_;
  std::map<std::uint64_t, Plan> plans_;
  bool stop_ = false;
  std::unique_ptr<transport::Client> client_;
};

}  // namespace parapilot::live
