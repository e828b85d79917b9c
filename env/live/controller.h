// Controller: the in-process agent bus of a LocalCluster, used by `parapilot launch --agent
// builtin` and the live tests and benchmarks. A bus Server that
// collects the workers' telemetry and drives the plan protocol (PlanPrepare -> PlanReady ->
// PlanCommit -> Ack) for a LiveAction its caller chooses, blocking in apply() until every rank
// acked, the plan was aborted or the timeout passed; plus the measurements its callers decide
// with (elastic shares from measured compute speed; per-layer gradient statistics for the
// compression selector). No libtorch here.
//
// It is not the deploy agent (agent/deploy/agent.h, `parapilot deploy`) and decides nothing
// itself: no Monitor, policy, JobInfo handling or metrics. Its caller picks each action and when
// to apply it (launch's scripted and elastic actions, the live tests' protocol checks), which
// carry what only the C++ workers run (bucket size, microbatch, compression settings). The
// action travels as text in PlanPrepare::layout_name (encode_action), which carries what the
// wire Layout has no field for (bucket size, microbatch). The protocol itself is the deploy
// agent's: a PlanExecutor (transport/plan_executor.h) per apply(), with plan ids from the
// clock and the commit two steps past the newest step seen.
//
// Thread-safety: all members may be called from any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/status.h"
#include "env/live/action.h"
#include "env/trace/telemetry.h"
#include "transport/bus.h"

namespace parapilot::transport {
class PlanExecutor;
}

namespace parapilot::live {

struct ControllerOptions {
  int world_size = 1;
  transport::Secret secret;  ///< >= 16 bytes.
  std::uint16_t port = 0;    ///< 0 = any free port on 127.0.0.1.
};

/// A switch every rank committed and acknowledged.
struct AppliedPlan {
  std::uint64_t plan_id = 0;
  std::uint64_t switch_at_step = 0;  ///< the first step on the new plan.
};

class Controller {
 public:
  /// Starts the bus server; the transport's Status when it cannot listen.
  static StatusOr<std::unique_ptr<Controller>> start(ControllerOptions options);
  ~Controller();
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  std::uint16_t port() const;
  /// Ranks connected now.
  int connected_ranks() const;
  /// Waits until `n` ranks are connected.
  bool wait_for_ranks(int n, std::chrono::milliseconds timeout);
  /// Runs the plan protocol for `action` on all ranks: prepare, wait for every PlanReady, commit
  /// two steps past the newest step seen or at `not_before_step`, whichever is later, wait for
  /// every rank's Ack.
  /// A rank's refusal: kRejected; no PlanReady from every rank in time: kUnavailable; in both
  /// cases PlanAbort was sent and the job keeps its plan. Committed but not acknowledged by
  /// every rank in time: kUnavailable.
  StatusOr<AppliedPlan> apply(const LiveAction& action, std::chrono::milliseconds timeout,
                              std::uint64_t not_before_step = 0);
  /// Waits until every rank has published telemetry for a step >= `step` (or a rank left).
  bool wait_for_step(std::uint64_t step, std::chrono::milliseconds timeout);
  /// Newest step of which every connected rank has published telemetry (0 before any).
  std::uint64_t completed_step() const;
  /// Telemetry received since the last call, in arrival order.
  std::vector<transport::Telemetry> take_telemetry();
  /// Every telemetry sample so far as telemetry-CSV rows (times relative to the first sample).
  std::vector<trace::TelemetrySample> recorded() const;
  /// Asks every worker to stop at the next iteration boundary (Shutdown).
  void request_stop(const std::string& reason);
  /// What happened: ranks leaving (with the reason), worker shutdown messages, refused plans.
  std::vector<std::string> events() const;
  /// Ranks that left the bus without saying they finished.
  std::vector<int> lost_ranks() const;

 private:
  explicit Controller(ControllerOptions options);
  Status listen();
  void on_message(transport::PeerId peer, transport::Message&& m);
  ControllerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<transport::PeerId, int> rank_of_;
  std::map<int, std::uint64_t> last_step_;
  std::vector<transport::Telemetry> pending_;
  std::vector<trace::TelemetrySample> recorded_;
  std::uint64_t t0_ns_ = 0;
  std::vector<std::string> events_;
  std::vector<int> finished_, lost_;
  // The switch in flight (apply() runs one at a time); called outside mu_.
  std::shared_ptr<transport::PlanExecutor> executor_;
  std::unique_ptr<transport::Server> server_;
};

/// Shares proportional to each rank's measured speed (microbatches per compute second) over the
/// given telemetry; ranks without samples get the mean speed. Empty telemetry: uniform.
std::vector<double> elastic_shares(const std::vector<transport::Telemetry>& telemetry, int world);
/// Per-layer gradient summary over the telemetry (mean norm, max |g|, total non-finite).
std::vector<LayerGradSummary> grad_summary(const std::vector<transport::Telemetry>& telemetry,
                                           std::size_t layers);
/// Steps per second over steps [from, to] of a recording: the number of steps divided by the
/// time from the earliest start to the latest end among those steps' rows (0 when none).
double measured_steps_per_s(const std::vector<trace::TelemetrySample>& rows, std::int64_t from,
                            std::int64_t to);
/// A random secret of 32 hex characters.
transport::Secret random_secret();

}  // namespace parapilot::live
