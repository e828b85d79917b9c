// DeployAgent: the deploy daemon. Runs the bus server the job's ranks connect to, feeds their
// telemetry to the Monitor, decides once per decision interval (every `interval_steps` closed
// steps), and drives the switch protocol's agent side (transport/plan_executor.h).
//
// Two kinds of job:
// * Described: AgentOptions::job (a scenario: model, cluster, search space). The Decider plans
//   hybrid layouts with the cost model and the policy chooses. Plans that need a degree the ranks
//   announced they cannot switch (JobInfo::capabilities) are held back by a guardrail.
// * Learned (job empty): the ranks' JobInfo announcements say what the job is (world size,
//   global batch, what it can switch). Until the first one arrives the agent only listens. A
//   job that can switch batch shares (Capability DP_SHARES) is data-parallel; one that can
//   switch its pipeline (PIPELINE, without DP_SHARES) is a pipeline of world_size stages over
//   the announced layers (its blocks; docs/pytorch.md's pipeline contract). The learned-job
//   decider (env/dp/decider.h) offers candidates modelled from the job's own telemetry, in its
//   own units — batch shares (env/dp/shares_model.h) or blocks per stage
//   (env/pp/pipeline_model.h) —, the policy chooses among them, and the decider's guardrail
//   refuses switches the measurements contradict and reverts a switch that made steps slower,
//   whatever the policy. A pipeline plan is dp1-ppS with the new stage boundaries (";st=") and
//   no schedule (plan_prepare_keeping_schedule): the job keeps the one it runs, gpipe or 1f1b,
//   which JobInfo does not carry and no plan changes.
// Ranks whose JobInfo disagrees with the job (another world size, another global batch) are
// warned in the log and told why by PlanAbort{plan_id = 0, reason}; no plan is sent to a job in
// disagreement. Serves Prometheus metrics
// (decisions, migrations, aborts, detected stragglers and congested links, rejected telemetry,
// per-rank throughput, decision latency, the agent's CPU and memory) and writes one JSON line
// per decision, migration outcome and monitor event.
//
// Decision latency is measured from the arrival at the server of the telemetry sample that closed
// the interval's last step to the decision (and, for switches, to the PlanPrepare broadcast).
//
// Thread-safety: the public member functions may be called from any thread. stop() (and the
// destructor) must not be called from a log callback.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "agent/deploy/decider.h"
#include "env/dp/decider.h"
#include "env/job.h"
#include "transport/plan_executor.h"
#include "env/monitor/monitor.h"
#include "transport/bus.h"

namespace parapilot::agent::deploy {

struct AgentOptions {
  std::shared_ptr<const Job> job;     ///< empty: learn the job from the ranks' JobInfo.
  /// A learned job: cool-down, verification, noise bands (ranks and batch come from JobInfo).
  env::dp::DataParallelOptions data_parallel;
  std::string policy_path;            ///< empty: the reactive baseline. Decides for both kinds.
  PolicyLoader loader;                ///< how to load policy_path (the CLI passes the RL loader).
  /// Bus: the in-process hub when given, else TCP on listen_address:port with `secret`.
  transport::InProcHub* hub = nullptr;
  std::string listen_address = "127.0.0.1";
  uint16_t port = 0;
  transport::Secret secret;
  size_t io_threads = 2;
  bool serve_metrics = false;  ///< HTTP /metrics on metrics_address:metrics_port (0: any free).
  std::string metrics_address = "127.0.0.1";
  uint16_t metrics_port = 0;
  int interval_steps = 10;  ///< closed steps per decision.
  DeciderOptions decider;
  transport::PlanExecutorOptions migration;
  monitor::MonitorOptions monitor;  ///< ranks, gpus_per_node and peer groups are filled from the job.
  std::function<void(const std::string&)> log;  ///< JSON lines; empty: stderr.
};

/// How a switch the agent started ended: the protocol's outcome and the layout it switched to.
struct MigrationOutcome : transport::PlanOutcome {
  Strategy target;
};

struct AgentStats {
  uint64_t decisions = 0;
  uint64_t switches_decided = 0;
  uint64_t migrations_committed = 0;
  uint64_t migrations_aborted = 0;
  uint64_t reverts_committed = 0;     ///< switches back after a switch measured slower.
  uint64_t held_back = 0;             ///< policy switches the job could not run (capabilities).
  uint64_t telemetry_before_job = 0;  ///< a learned job's telemetry before its first JobInfo.
  uint64_t stragglers_detected = 0;
  uint64_t congested_links_detected = 0;
  uint64_t ranks_lost = 0;
  /// Inputs the policy read at its clip (saturated), and inputs outside the range training
  /// produced (the deployed job is not what it learned on), summed over decisions, in total and
  /// by input name (Policy::check_inputs).
  uint64_t features_clipped = 0;
  std::map<std::string, uint64_t> features_clipped_by_input;
  uint64_t features_unseen = 0;
  std::map<std::string, uint64_t> features_unseen_by_input;
  int connected_ranks = 0;
  /// The bus server's counters (TCP or the in-process hub): connections accepted,
  /// handshakes completed (one per rank when none reconnected), closed for an error, and those
  /// that waited for a handshake slot.
  transport::ServerStats bus;
  std::vector<double> decision_latency_ms;  ///< every decision (most recent 100000).
  std::vector<double> prepare_latency_ms;   ///< decisions that sent a PlanPrepare.
  std::vector<double> step_close_ms;  ///< closing sample's arrival -> step callback (monitor).
  std::vector<double>
      decide_ms;  ///< Decider::decide() alone (observation, policy, guardrails, log).
  std::vector<MigrationOutcome> outcomes;
  std::vector<monitor::MonitorEvent> events;  ///< detection events (most recent 1000).
  std::string policy;
  bool fallback = false;
  std::string fallback_reason;
};

/// The job's measured pace around the switches: the median wall time per closed step (the
/// monitor's per-step median over ranks) before the first committed switch, and from the last
/// committed switch's step on; only switches for a step the job reached count. Without one,
/// every step counts as before.
struct JobPace {
  double step_ms_before = 0;  ///< 0: no closed step there.
  double step_ms_after = 0;
  uint64_t steps_before = 0;
  uint64_t steps_after = 0;
  int global_batch = 0;  ///< samples per step (the scenario's, or the job's JobInfo); 0: unknown.
};

class DeployAgent {
 public:
  /// Starts the bus server (and the metrics endpoint). kInvalidArgument for bad options (an
  /// interval or minimum gain out of range, an unknown start layout); the transport's Status,
  /// naming the flag, when the listen address or a port cannot be used.
  static StatusOr<std::unique_ptr<DeployAgent>> start(AgentOptions options);
  ~DeployAgent();
  DeployAgent(const DeployAgent&) = delete;
  DeployAgent& operator=(const DeployAgent&) = delete;

  uint16_t port() const;
  uint16_t metrics_port() const;  ///< 0 when not serving.
  std::string metrics_text() const;
  AgentStats stats() const;
  JobPace pace() const;
  Strategy current_layout() const;
  /// The monitor; nullptr for a learned job until its first JobInfo.
  monitor::Monitor* monitor();
  Decider& decider();  ///< a described job only.
  /// Starts a switch to `target` outside the policy (operators, tests). False while one is in
  /// flight or no rank is connected.
  bool request_switch(const Strategy& target);
  /// Stops the metrics endpoint, the bus (ranks keep training and reconnect to the next agent)
  /// and the background threads. Idempotent.
  void stop();

 private:
  DeployAgent();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace parapilot::agent::deploy
