// The training worker's run, phase by phase (libtorch; internal to env/live, run_worker in
// worker.h is the public entry). WorkerRun holds what one worker holds from start to exit; the
// phases below fill and use it in this order:
//
//   load_inputs       worker_start.cc      corpus, layout, the checkpoint to resume from
//   join_job          worker_start.cc      rendezvous, the world group, this rank's LayoutState
//   connect_to_agent  worker_staging.cc    the bus, and layout changes staged beside training
//   configure_plan    worker_start.cc      shares, microbatch and compression; the loss log
//   train             worker_step.cc       the step loop (boundary: worker_switch.cc;
//                                          telemetry: worker_telemetry.cc)
//   finish_training   worker_finish.cc     the gathered dump, checkpoint and run summary
//   shut_down         worker_finish.cc     the failure report, the recording, the bus's goodbye
//
// Thread-safety: the training thread owns WorkerRun; the bus and staging threads touch only
// `current`, `training_step` and `staging_steps` (and reach the world group as the stager says).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "core/status.h"
#include "env/live/checkpoint.h"
#include "env/live/collective_backends.h"
#include "env/live/collectives.h"
#include "env/live/layout.h"
#include "env/live/layout_stager.h"
#include "env/live/layout_state.h"
#include "env/live/pipeline.h"
#include "env/live/worker.h"
#include "env/live/worker_bus.h"
#include "env/trace/telemetry.h"

namespace parapilot::live {

using WorkerClock = std::chrono::steady_clock;

/// Seconds since `t0`.
double seconds_since(WorkerClock::time_point t0);
/// The wall clock in nanoseconds since the Unix epoch.
std::uint64_t wall_ns();

/// The layout the job runs, for the bus thread's checks of new plans (the training thread
/// changes it at a switch).
class CurrentLayout {
 public:
  LiveLayout get() {
    std::lock_guard lock(mu_);
    return layout_;
  }
  void set(const LiveLayout& l) {
    std::lock_guard lock(mu_);
    layout_ = l;
  }

 private:
  std::mutex mu_;
  LiveLayout layout_;
};

/// The steps at which each plan's staging began and ended (for --summary-json).
struct StagingSteps {
  std::mutex mu;
  std::map<std::uint64_t, std::pair<std::int64_t, std::int64_t>> by_plan;  // prepared, ready
};

/// One layout switch, as the run summary reports it.
struct SwitchRecord {
  std::uint64_t plan_id = 0, at_step = 0;
  std::string layout;
  double pause_ms = 0, staged_ms = 0;
  std::uint64_t bytes_sent = 0;
};

/// What one worker holds from start to exit. Members are destroyed in reverse order, which the
/// threads need: the releaser is joined, the stager (whose threads report to the bus) goes
/// before the bus, the bus before the layout state, the state before the world group.
struct WorkerRun {
  explicit WorkerRun(const WorkerOptions& options)
      : o(options), tag("worker rank " + std::to_string(options.rank)) {}
  WorkerRun(const WorkerRun&) = delete;  // the bus and stager threads hold its address
  WorkerRun& operator=(const WorkerRun&) = delete;

  /// A collective that failed ends the training loop (the others notice through their own):
  /// false, with `failure` and `exit_code` set, when `st` is not ok.
  bool collective_ok(const Status& st);

  const WorkerOptions& o;
  const WorkerClock::time_point t_start = WorkerClock::now();
  const std::uint64_t started_ns = wall_ns();
  const std::string tag;

  // load_inputs
  BackendInfo backend;  ///< o.backend's (collective_backends.h)
  std::string corpus;
  std::int64_t seq_bytes = 0;
  at::Tensor corpus_t;
  LiveLayout layout;
  std::vector<LayerShape> layers;
  std::optional<TrainingState> resumed;
  std::uint64_t first_step = 0;

  // join_job
  std::unique_ptr<Collectives> coll;
  c10::intrusive_ptr<c10d::Store> store;
  GroupOptions group_options;
  int device = 0;
  LayoutStateOptions lo;
  std::unique_ptr<LayoutState> state;
  RankCoords me;
  CurrentLayout current;

  // connect_to_agent (written by the bus and staging threads)
  std::atomic<std::uint64_t> training_step{0};
  StagingSteps staging_steps;
  std::unique_ptr<WorkerBus> bus;
  std::shared_ptr<LayoutStager> stager;
  /// Releases a replaced layout's state and groups off the training path (joined before the
  /// next switch and when training ends).
  std::thread releaser;

  // configure_plan: the current plan. Shares and per-layer compression are per replica and per
  // full-model tensor.
  std::vector<double> shares;
  int microbatch = 0;
  GradientSync* gsync = nullptr;
  std::vector<Compression> full_compression;  ///< of the whole model (model_layers order).
  double topk_ratio = 0;
  int powersgd_rank = 0;
  std::int64_t bucket_bytes = 0;
  StageModel* model = nullptr;
  std::vector<at::Tensor> params;  ///< handles of the tensors
  torch::optim::Optimizer* opt = nullptr;
  /// The last stage's first TP rank reports its replica's loss into the world's sum.
  bool reports_loss = false;
  std::vector<SwitchRecord> switches;
  bool switched_this_step = false;
  std::vector<trace::TelemetrySample> recorded;
  std::ofstream loss_log;

  // train
  int exit_code = kWorkerOk;
  std::uint64_t plan_id = 0;
  std::uint64_t commit_said = 0;  ///< the newest committed plan the log has named
  std::uint64_t step = 0;
  /// Rank 0's step ends (seconds since the worker started, and the wall clock of the first and
  /// the last), for --summary-json.
  std::vector<double> step_end_times;
  std::uint64_t first_step_end_ns = 0, last_step_end_ns = 0;
  double train_start_s = 0;
  double tokens = 0;
  std::uint64_t total_dp_bytes = 0;
  double last_loss = 0;
  std::string failure;
  /// --link-cut-at-step: due at this boundary (set once its agreement is done), and what was
  /// cut once it was ("links to its peers cut at step N (injected fault)"; empty before).
  bool link_cut_due = false;
  std::string links_cut;
};

/// Reads the corpus, the layout and the checkpoint to resume from (before the rendezvous, so
/// that a bad one fails every rank alike and none waits for the others); rank 0 creates the
/// --save-state folder. Throws InputError on bad input.
void load_inputs(WorkerRun& run);
/// The rendezvous, the world group and this rank's LayoutState (with the resumed checkpoint
/// installed). Returns an exit code when the job cannot be joined (the reason printed).
std::optional<int> join_job(WorkerRun& run);
/// With --agent: connects the bus, whose thread checks new plans and stages layout changes off
/// the training path (layout_stager.h). Throws InputError when the agent cannot be reached.
void connect_to_agent(WorkerRun& run);
/// The starting plan (shares, microbatch, compression) and rank 0's loss log. Throws
/// InputError on a bad --shares or --compression or an unwritable log.
void configure_plan(WorkerRun& run);
/// The step loop, until the step or time budget, a stop from the agent or a failed collective.
/// May throw (c10::Error, std::exception): run_or_throw turns that into an exit code.
void train(WorkerRun& run);
/// Step 1 of a step, the boundary (`now_s`: seconds since the worker started): agree on
/// stopping and the plan, and apply it (a layout switch included). The boundary's wall time in
/// ms, or nullopt when training ends here.
std::optional<double> cross_boundary(WorkerRun& run, double now_s);
/// After training: the gathered dump, the checkpoint and the run summary (every rank takes
/// part).
void finish_training(WorkerRun& run);
/// The ports of the job's store and the agent's bus, which cut_peer_links (link_cut.h) keeps.
std::vector<int> store_and_bus_ports(const WorkerOptions& o);
/// Reports a failure (after a failed collective, this rank's connections to its peers are shut
/// down first, so that a peer blocked on it fails at once and joins the census), writes the
/// recording, says goodbye on the bus and returns the exit code.
int shut_down(WorkerRun& run);

/// What one step's telemetry is built from (worker_telemetry.cc), under the names the step
/// gives them.
struct StepTelemetry {
  const WorkerOptions& o;
  std::uint64_t step;
  std::uint64_t step_start_ns;
  std::uint64_t step_end_ns;
  const SyncStats& sync;
  double loss_ms;
  const StatusOr<PipelineStepStats>& passes;
  double compute_ms;
  double tp_ms;
  TensorParallelGroup* tp;
  std::uint64_t tp_bytes_before;
  std::uint32_t tp_calls_before;
  const std::unique_ptr<LayoutState>& state;
  double control_ms;
  int mine;
  int total_mb;
  double last_loss;
  std::uint64_t plan_id;
  bool switched_this_step;
  const std::vector<SwitchRecord>& switches;
  const LiveLayout& layout;
  const RankCoords& me;
  int microbatch;
  std::vector<transport::LayerGradStat>& layer_stats;
  const std::unique_ptr<WorkerBus>& bus;

  /// Builds the step's telemetry and sends it on the bus.
  void send();
};

}  // namespace parapilot::live
