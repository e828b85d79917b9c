// DataParallelEnv: a learned job whose split a policy decides, step by step, as `parapilot
// deploy` decides it for a PyTorch job it learned from its ranks' telemetry: a data-parallel
// job's shares of the global batch, or a pipeline's blocks per stage. The hidden truth is a
// SplitJobSim (env/dp/split_sim.h: DataParallelJobSim, env/dp/job_sim.h, or PipelineJobSim,
// env/pp/pipeline_sim.h); its telemetry goes through the deploy agent's Monitor (configured as
// the agent configures it for a learned job) and the decision core, DataParallelDecider
// (env/dp/decider.h) with the split model deploy would use, which builds the observation and
// applies its guardrail to the action.
//
// Registered as "dp": dp:FAMILY(ranks=N,horizon=H,decision_steps=K). Families: straggler (one
// rank's compute fail-slows), comm (all-reduce fail-slows, noise and hiccups only: the right
// answer is to keep), flap (a rank slow and normal in turns), mixed (ranks of a slower second
// GPU type plus events of every kind), random (each episode draws its family and its job).
// ranks: drawn per episode in 4-64 when not given; H = 60 decisions; K = 10 steps per decision.
// And as "pp": pp:FAMILY(stages=S,horizon=H,decision_steps=K), the same families over the
// stages of a pipeline (comm: its exposed transfers slow down); stages drawn in 2-16 when not
// given.
//
// An episode: reset runs one interval of K steps on the even split and returns the first
// observation; each step(action) hands the action to the decider, commits a rebalance or revert
// at the interval's first step (which pays the switch pause), runs K steps, feeds every rank's
// sample to the monitor and every step's wall time to the decider, and observes.
// reward = sum of the interval's best step times (the same steps on the best split under the
// true speeds, no pause) / sum of its wall times: <= 1 up to noise. StepInfo counts samples:
// tokens = K x global batch x interval_s / the interval's wall time, best_tokens the same on the
// best split; interval_s = K nominal steps (even split, no fail-slow, no noise).
// oracle(): the same episode (same noise) taking, each interval, the split that is best under
// the truth of its steps (knowing them in advance), paying the pause for each change.
//
// Not thread-safe (one episode at a time); deterministic for (id, seed).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "env/dp/decider.h"
#include "env/dp/job_sim.h"
#include "env/dp/split_sim.h"
#include "env/env.h"
#include "env/monitor/monitor.h"
#include "env/registry.h"

namespace parapilot::env::dp {

struct DataParallelEnvOptions {
  bool pipeline = false;         ///< a pipeline's blocks per stage (pp:), not batch shares
  std::optional<Family> family;  ///< nullopt: random (drawn per episode)
  int ranks = 0;                 ///< ranks or stages; 0: drawn per episode (4-64; 2-16 stages)
  int horizon = 60;              ///< decisions per episode, >= 1
  int decision_steps = 10;       ///< steps per decision, >= 1
};

class DataParallelEnv : public Env {
 public:
  /// Precondition (asserted): ranks >= 0, horizon and decision_steps >= 1. `id`: the id it
  /// was made from, returned by id().
  DataParallelEnv(DataParallelEnvOptions options, std::string id);
  ~DataParallelEnv() override;

  std::string id() const override { return id_; }
  int horizon() const override { return o_.horizon; }
  /// K nominal steps of the current episode's job (before the first reset: 1).
  double interval_s() const override { return interval_s_; }
  /// Never fails. Every episode starts on even shares, as the clients do (`options` is not
  /// read: a data-parallel job has no planned layout).
  StatusOr<Observation> reset(uint64_t seed, const ResetOptions& options = {}) override;
  /// Precondition: reset succeeded and the episode is not over.
  StepResult step(int action) override;
  std::optional<OracleResult> oracle() override;
  /// Fail-slow onsets: (decision interval, description).
  std::vector<std::pair<int, std::string>> events() const override;

  /// The episode's truth (for tests and diagnostics; a policy never reads it).
  const SplitJobSim& job_sim() const { return *sim_; }
  Family family() const { return family_; }

 private:
  // Runs one decision interval of K steps, `commit` (if any) at its first; returns the sums of
  // wall and best step times.
  std::pair<double, double> run_interval(const DataParallelDecision* commit);
  double tokens(double wall_ms) const;
  // The episode's job from step 0 (reset's, and the oracle's replay of it).
  std::unique_ptr<SplitJobSim> make_sim() const;

  DataParallelEnvOptions o_;
  std::string id_;
  uint64_t seed_ = 0;
  Family family_ = Family::straggler;
  Episode episode_;
  int stages_ = 0;  // a pipeline's, drawn per episode when not given
  std::unique_ptr<SplitJobSim> sim_;
  std::unique_ptr<monitor::Monitor> monitor_;
  std::unique_ptr<DataParallelDecider> decider_;
  std::vector<monitor::StepSample> batch_;  // one interval's samples, ingested together
  double interval_s_ = 1;
  int t_ = 0;
};

/// The "dp" factory the registry holds. kInvalidArgument naming a bad family or parameter.
StatusOr<std::unique_ptr<Env>> make_dp_env(const EnvId& id);
/// The "pp" factory the registry holds. kInvalidArgument naming a bad family or parameter.
StatusOr<std::unique_ptr<Env>> make_pp_env(const EnvId& id);

}  // namespace parapilot::env::dp
