// Simulated cluster: N ranks of a training job, impersonated from the simulator, speaking the
// same bus protocol as real workers (Telemetry every step; PlanPrepare -> background staging ->
// PlanReady; PlanCommit -> switch at the iteration boundary -> Ack; PlanAbort), so the deploy
// agent can be driven at 1024+ ranks without GPUs.
//
// It plays the ranks of the job a deploy agent serves, so it takes the agent's own description
// of that job (agent/deploy/job.h: the scenario, the planner, the wire mapping of layouts)
// rather than a second one.
//
// Ranks step in lockstep (one driver thread, as a synchronous job does). Per step each rank
// reports compute-only time (the true per-GPU speed from the scenario's hidden dynamics, plus
// injected slowdowns and noise), its inter-node collective (bytes, and time = wait for the last
// arrival + transfer at its node's true bandwidth), queue depth and per-layer gradient norms.
//
// Each rank's side of the protocol is a transport::PlanBook, and the boundary follows its commit
// rule: the newest plan committed on some live rank, switched to only when every live rank
// holds it; otherwise nobody switches and every rank answers PlanReady{ok=false}. The ranks
// hold no training state: what they test is the agent's side of the protocol (what it sends,
// when it commits or aborts, what it believes the job runs). That a switch loses no step and
// applies none twice, with real parameters and optimizer state moved between ranks, is tested
// on the live workers (tests/live/switch_test.cc) and the PyTorch client (tests/python).
//
// When the agent goes away, ranks keep training on the last committed layout, drop any plan not
// yet committed, and their clients reconnect in the background.
//
// Thread-safety: step()/run() from one thread at a time; the other members from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "env/job.h"
#include "transport/bus.h"

namespace parapilot::env {


struct SlowdownInjection {
  uint32_t rank = 0;
  double factor = 3;  ///< computes this many times slower...
  uint64_t from_step = 0;
  uint64_t to_step = UINT64_MAX;  ///< ...in steps [from_step, to_step).
};

struct SimClusterOptions {
  std::string scenario = "straggler";  ///< family name or scenario .toml (as for make_job).
  int ranks = 16;                      ///< = GPUs of the job; a multiple of 8.
  uint64_t seed = 1;
  std::string initial_layout = "planned";
  double step_ms = 20;          ///< wall time per step (pacing); 0: as fast as possible.
  int steps_per_interval = 10;  ///< the scenario's hidden conditions advance every this many steps.
  bool use_truth = true;        ///< false: nominal cluster plus the injections only.
  std::vector<SlowdownInjection> slowdowns;
  double telemetry_noise = 0.02;  ///< lognormal sigma on reported times.
  uint32_t stage_steps = 2;       ///< steps of background staging before PlanReady.
  int grad_layers = 2;  ///< per-layer gradient statistics per telemetry sample.
  /// Transport: the in-process hub when given, else TCP to agent_address:agent_port.
  transport::InProcHub* hub = nullptr;
  std::string agent_address = "127.0.0.1";
  uint16_t agent_port = 0;
  transport::Secret secret;
  size_t io_threads = 2;
  std::function<void(const std::string&)> log;  ///< protocol events, one line each.
};

struct SimClusterReport {
  uint64_t steps = 0;          ///< steps run (every live rank is at this step).
  int commits = 0;             ///< switches applied.
  int aborts = 0;              ///< plans dropped on PlanAbort.
  int missed_commits = 0;      ///< commits not held by every rank at the boundary.
  Strategy layout;             ///< the layout the job runs now.
  double sim_seconds = 0;      ///< simulated job time (cost model under the true conditions).
  double tokens = 0;
  std::vector<double> tokens_per_s_by_step;  ///< true throughput of each step.
  std::vector<uint64_t> commit_steps;
  uint64_t telemetry_sent = 0;
  int live_ranks = 0;
  int connected_ranks = 0;
  int ranks_holding_plans = 0;  ///< live ranks holding a plan (staged or committed) not yet run.
};

class SimulatedCluster {
 public:
  /// Builds the job and one bus client per rank: kInvalidArgument naming the option at fault
  /// (a rank count, a scenario of another size, a start layout, an agent address).
  static StatusOr<std::unique_ptr<SimulatedCluster>> start(SimClusterOptions options);
  ~SimulatedCluster();
  SimulatedCluster(const SimulatedCluster&) = delete;
  SimulatedCluster& operator=(const SimulatedCluster&) = delete;

  const Job& job() const { return *job_; }
  /// Waits until every live rank's client is connected.
  bool wait_connected(std::chrono::milliseconds timeout) const;
  /// One lockstep iteration of every live rank (control messages are handled at its boundary).
  void step();
  /// Steps until `steps` more were run or *stop is set (paced by step_ms).
  void run(uint64_t steps, const std::atomic<bool>* stop = nullptr);
  /// The rank's process dies: its connection closes and it stops training; the rest continue.
  void kill_rank(uint32_t rank);
  /// Fault injection: the rank dies as soon as it receives a PlanPrepare.
  void kill_on_prepare(uint32_t rank);
  /// Fault injection: the rank answers PlanPrepare with PlanReady{ok=false}.
  void refuse_prepare(uint32_t rank);
  /// Fault injection: the rank never receives PlanCommit. It staged the plan, so it switches
  /// with the others at the boundary.
  void drop_commit(uint32_t rank);
  /// Fault injection: the rank loses its staged plan before the commit reaches it (as a rank
  /// whose connection to the agent blipped does): at the boundary nobody switches.
  void lose_staged(uint32_t rank);
  /// Stops every client (the job ends).
  void stop();

  SimClusterReport report() const;
  uint64_t current_step() const;


 private:
  SimulatedCluster();
  void build(SimClusterOptions options);  // throws InputError; start() turns it into a Status
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<const Job> job_;
};

/// Runs a simulated cluster until `stop` is set or `max_steps` (> 0) were run; the library
/// entry point of `parapilot simcluster` (and of `parapilot launch --simulated`). start()'s
/// Status when the options are bad.
StatusOr<SimClusterReport> run_simulated_cluster(const SimClusterOptions& options,
                                                 const std::atomic<bool>& stop,
                                                 uint64_t max_steps = 0);

}  // namespace parapilot::env
