// The simulator env: a training run of `horizon` decision intervals on a cluster whose true
// conditions evolve per the scenario and stay hidden. Each interval's training steps report
// per-rank telemetry (env/sim/step_telemetry.h: noisy, sometimes missing, delivered late per
// the scenario's telemetry model); the deploy agent's Monitor (env/monitor/monitor.h) turns it
// into the beliefs the agent sees. The agent gets up to kMaxCandidates layouts from the planner
// and keeps its layout or switches. Switching costs what it costs on the real links: the new
// layout is staged in the background (training continues, slowed), then a switch pause.
// Reward = tokens processed in the interval / tokens the best layout under the true conditions
// would have processed (docs/observation.md); where the scenario models gradient
// compressibility, tokens count at the layout's convergence efficiency (docs/scenarios.md).
//
// Not thread-safe (one episode at a time); deterministic for (scenario, seed).
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>

#include "env/env.h"
#include "env/monitor/monitor.h"
#include "env/observation.h"
#include "env/sim/planning_view.h"
#include "env/sim/scenario.h"
#include "env/sim/step_telemetry.h"
#include "env/trace/telemetry.h"
#include "strategy/planner.h"

namespace parapilot::env {

// Its planning view (PlanningView, a private base: planning_view() is the only way to it) shows
// the episode's beliefs, candidates and present workload, and the scenario's dynamics.
class SimEnv : public Env, private PlanningView {
 public:
  SimEnv(Scenario scenario, std::string id);
  // Replays recorded reality instead of generating it: every episode uses these true
  // conditions (the seed still drives telemetry noise). Sets the horizon to their length.
  // `follows_scenario`: the recording is a draw of the scenario's dynamics (a generated truth,
  // perhaps edited to ask what if), so planning_view() offers them; a trace's conditions are
  // not, and its env has no planning view.
  SimEnv(Scenario scenario, std::string id, Truth recorded, bool follows_scenario = false);

  std::string id() const override { return id_; }
  int horizon() const override { return scenario_.horizon; }
  double interval_s() const override { return scenario_.interval_s; }
  StatusOr<Observation> reset(uint64_t seed, const ResetOptions& options = {}) override;
  StepResult step(int action) override;
  std::optional<OracleResult> oracle() override;
  std::vector<std::pair<int, std::string>> events() const override { return truth_.events; }
  const PlanningView* planning_view() const override;

  // Appends, from the next step on, one telemetry sample per pipeline position (replica,
  // stage; a tensor-parallel group reports as one rank, at its slowest GPU's pace) per
  // interval: one representative training step under the true conditions, in the recording
  // format of env/trace/telemetry.h. nullptr stops recording. The sink must outlive the env's
  // use of it.
  void record_telemetry(std::vector<trace::TelemetrySample>* sink) { recording_ = sink; }

  const Scenario& scenario() const override { return scenario_; }
  // The running layout, at the current interval's global batch.
  const Strategy& current_layout() const override { return current_; }
  const Truth& truth() const { return truth_; }
  /// What the monitor believes now (empty vectors: nominal), from the telemetry delivered so far.
  const Conditions& beliefs() const override { return belief_; }
  /// The deploy agent's view at the current interval, as deploy gets it: the monitor's beliefs
  /// as it reported them (before beliefs() drops nominal entries; default-constructed with
  /// exact beliefs), and the seconds of staging left for the switch in progress (nullopt when
  /// none is). Tests hold deploy's decision path to the simulator's with them.
  const monitor::Beliefs& monitor_beliefs() const { return monitor_beliefs_; }
  std::optional<double> staging_left_s() const {
    return target_ ? std::optional<double>(staging_left_s_) : std::nullopt;
  }

  // Tokens per second that count in interval t (of the episode since the last reset) for a
  // layout run at that interval's global batch under the true conditions: the cost model's
  // throughput times the convergence efficiency of its gradient compression
  // (docs/scenarios.md); 0 when it crashes (failed GPU, out of memory) or cannot run the batch.
  // The reward's numerator and the oracle's currency.
  double true_tokens_per_s(const Strategy& s, int t);

 private:
  // PlanningView (env/sim/planning_view.h); scenario(), beliefs() and current_layout() above.
  int interval() const override { return t_; }
  std::optional<int> intervals_left() const override;
  const std::vector<Candidate>& candidates() const override { return candidates_; }
  double tokens_per_s(const Strategy& s, const Conditions& c) const override;

  const Planner& planner_for(int seq_len);
  // Tokens per second that count for `s` under `c` at a workload: the cost model's throughput
  // (run at `batch`) times the convergence efficiency under gradient regime `regime` (-1: no
  // compression modelled); 0 when it cannot run. true_tokens_per_s and the planning view's.
  double tokens_per_s_at(const Strategy& s, const Conditions& c, const CostModel& cost,
                         int batch, int regime) const;
  double best_tokens_per_s(int t);
  // Plans for interval-t's workload (sequence length, global batch) under conditions c with
  // gradient statistics g (empty: no compression).
  // Served from plan_cache_ when the same request was planned before (exactly the planner's
  // result).
  PlanResult plan(const Conditions& c, int seq_len, int global_batch, const GradientStats& g,
                  const std::optional<Strategy>& current, int top_k = kMaxCandidates + 1);
  // The planner's search for plan() (an empty result when nothing can run).
  PlanResult search(const Conditions& c, int seq_len, int global_batch, const GradientStats& g,
                    const std::optional<Strategy>& current, int top_k);
  // The gradient statistics of interval t (empty when compression is not modelled), and what
  // the monitor has measured of them at the current interval (one telemetry delay late).
  const GradientStats& true_gradients(int t) const;
  const GradientStats& measured_gradients() const;
  int measured_regime() const;
  // Runs the interval's training steps' telemetry (StepTelemetry) into the delivery queue.
  void emit_telemetry(int t);
  // Delivers what is due to the monitor and takes its beliefs.
  void observe_telemetry();
  void replan_if_needed(bool force);
  Observation observation();

  Scenario scenario_;
  std::string id_;
  int global_batch_ = 0;
  std::map<int, std::unique_ptr<Planner>> planners_;  // by sequence length
  // best_tokens_per_s by interval_key: exact, so shared by every episode of this env.
  static constexpr size_t kBestCacheEntries = 1 << 14;
  std::map<std::string, double> best_cache_;
  // plan() by its request (workload, top_k, the running layout's kernel settings, gradient
  // statistics and conditions, exactly): shared by every episode of this env, bounded in size.
  static constexpr size_t kPlanCacheEntries = 512;
  std::unordered_map<std::string, PlanResult> plan_cache_;
  Truth truth_;
  std::optional<Truth> recorded_;
  bool follows_scenario_ = true;  // the truth is a draw of the scenario's dynamics
  std::mt19937_64 rng_;
  int t_ = 0;
  Strategy current_;          // the running layout, at this interval's global batch
  Strategy chosen_;           // the same layout as planned (a ramp rebatches from it)
  Strategy initial_;          // this episode's start layout
  Strategy planned_initial_;  // the best plan for the nominal cluster
  Strategy uniform_dp_;       // pure data parallel, equal shares
  std::optional<Strategy> target_;
  double staging_left_s_ = 0;
  double pause_left_s_ = 0;  // of the last committed switch's pause, for the next interval
  int last_migration_ = -1;
  std::unique_ptr<monitor::Monitor> monitor_;  // the deploy agent's estimator, fed telemetry
  monitor::Beliefs monitor_beliefs_;            // its last report (monitor_beliefs())
  std::optional<StepTelemetry> telemetry_;     // of telemetry_layout_
  Strategy telemetry_layout_;
  std::deque<std::pair<int, std::vector<monitor::StepSample>>> in_flight_;  // by interval
  std::vector<monitor::StepSample> spare_samples_;  // a delivered interval's buffer
  uint64_t clock_ns_ = 0;
  Conditions belief_;          // what the monitor believes now
  Conditions belief_at_plan_;  // beliefs the candidates were planned under
  int seq_len_at_plan_ = 0;
  int batch_at_plan_ = 0;
  int regime_at_plan_ = -1;
  double previous_min_speed_ = 1, previous_min_bw_ = 1;
  ObservationHistory history_;
  double missing_fraction_ = 0;
  int telemetry_age_ = 0;
  bool run_length_known_ = true;  // this episode's job declared its length
  std::vector<Candidate> candidates_;
  std::optional<CostBreakdown> current_belief_cost_;
  std::vector<trace::TelemetrySample>* recording_ = nullptr;
  void record_interval(int t);
};

// The registry's factories (env/registry.cc): "sim:FAMILY(gpus=N,horizon=H)" or
// "sim:PATH.toml(horizon=H)", and "trace:PATH(meta=M,model=...,gpu=...,steps_per_interval=...,
// interval_s=...)" replaying a per-op trace or a telemetry recording as the hidden conditions.
// kInvalidArgument naming the bad parameter or file.
StatusOr<std::unique_ptr<Env>> make_sim_env(const EnvId& id);
StatusOr<std::unique_ptr<Env>> make_trace_env(const EnvId& id);

}  // namespace parapilot::env
