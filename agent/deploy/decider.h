// Decider: once per decision interval, builds the policy's observation from the monitor's
// beliefs and the planner's candidates, runs the policy, applies guardrails and returns the
// decision with a one-line structured (JSON) log record: the evidence, the candidates, the
// choice, the predicted gain and the migration cost.
//
// Planning runs ahead of decisions: update_beliefs() re-plans (on a background thread unless
// DeciderOptions::async_planning is false) when beliefs moved by the simulator's thresholds,
// the failed set changed or the layout changed; decide() only reads the latest plan, so its
// latency does not include the search.
//
// Guardrails: never a candidate predicted not to fit in memory (or using a lost GPU); a
// cool-down between migrations; no new switch while one is being staged; candidates planned for
// another current layout, or under beliefs that have moved since, are ignored until the re-plan
// finishes.
//
// Thread-safety: every member function may be called from any thread (internal mutexes).
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "policy/baselines.h"
#include "env/job.h"
#include "env/monitor/monitor.h"
#include "env/observation.h"

namespace parapilot::agent::deploy {

/// Makes a policy::Policy from a checkpoint path, or says why it cannot (the file is missing,
/// unreadable or of another feature schema). The RL loader lives outside this torch-free
/// library and is injected by the CLI (parapilot::policy::load_policy).
using PolicyLoader =
    std::function<StatusOr<std::unique_ptr<policy::Policy>>(const std::string& path)>;

struct LoadedPolicy {
  std::unique_ptr<policy::Policy> policy;  ///< never null
  /// OK: `policy` is the one asked for. Otherwise why the reactive baseline stands in for it.
  Status fallback;
};

/// The policy at `path` through `loader`; the reactive baseline when `path` is empty (not a
/// fallback), or — a fallback, with the reason — when there is no loader or it fails.
LoadedPolicy load_policy_or_reactive(const std::string& path, const PolicyLoader& loader);

/// The guardrails on a switch to `target` (its planned cost and its cost under the current
/// beliefs): OK when allowed, else kRejected saying why not (staging, cool-down, memory, lost
/// GPU, not representable on the bus).
Status guardrail_for(const Candidate& target, const CostBreakdown& under_beliefs, bool staging,
                     int intervals_since_commit, int cooldown_intervals);

struct DeciderOptions {
  int cooldown_intervals = 2;  ///< decisions to wait after a committed switch.
  int horizon = 0;             ///< normalises time features; 0: the scenario's horizon.
  int run_intervals = 0;       ///< planned length of the run in decisions; 0: unknown.
  double interval_s = 0;       ///< seconds per decision interval; 0: the scenario's.
  /// Training steps per decision interval (decide() is called at each interval's last step):
  /// telemetry age is measured as the simulator measures it, in intervals from the one holding
  /// the monitor's newest closed step to the decision. 0: one step per interval.
  int interval_steps = 0;
  bool async_planning = true;
  std::string initial_layout = "planned";
};

struct Decision {
  int interval = 0;
  uint64_t step = 0;
  int action = 0;         ///< what was done: 0 keep, k: switch to candidates[k-1].
  int policy_action = 0;  ///< what the policy asked for.
  std::string guardrail;  ///< why the policy's choice was overridden; empty when it was not.
  std::optional<Candidate> target;
  double predicted_gain = 1;  ///< target tokens/s over the current layout's, under beliefs.
  double migration_s = 0;
  std::vector<Candidate> candidates;
  env::Observation observation;
  /// Inputs the policy read at its clip or never saw in training (Policy::check_inputs).
  policy::InputReport inputs;
  /// The decision's log record (event "decision"): the evidence, beliefs, current layout,
  /// candidates, the policy's action and the choice. The agent adds its own fields and writes
  /// it as one line.
  nlohmann::json record;
};

class Decider {
 public:
  /// Precondition (asserted): policy.policy is set.
  /// `policy.policy` must not be null; each decision line says whether it is a fallback.
  Decider(std::shared_ptr<const Job> job, LoadedPolicy policy, DeciderOptions options = {});
  ~Decider();
  Decider(const Decider&) = delete;
  Decider& operator=(const Decider&) = delete;

  /// Fresh beliefs (cheap; call as often as they change). Re-plans when they moved enough.
  void update_beliefs(const monitor::Beliefs& beliefs);
  /// Decides for one interval ending at `step`. `staging_left_s` > 0 while a switch is staged.
  /// `evidence` (e.g. the monitor's recent events) goes into the log line.
  Decision decide(uint64_t step, bool staging, double staging_left_s,
                  const std::vector<std::string>& evidence = {});
  /// A switch to `s` was committed (resets the cool-down and re-plans from the new layout).
  void committed(const Strategy& s);
  /// Waits until no re-plan is pending or running (tests, benchmarks).
  void wait_for_plan();

  Strategy current() const;
  std::string policy_name() const;
  /// Planner searches run so far, and the last one's wall time.
  long plans() const;
  double last_plan_ms() const;

 private:
  struct Snapshot {
    Strategy current;
    std::vector<Candidate> candidates;
    Conditions beliefs;
  };
  void plan_now(const Conditions& beliefs, const Strategy& current);
  void planner_loop();

  std::shared_ptr<const Job> job_;
  std::unique_ptr<policy::Policy> policy_;
  bool fallback_;  // the reactive baseline stands in for the policy asked for
  DeciderOptions o_;

  mutable std::mutex mutex_;  // guards everything below
  Strategy current_;
  monitor::Beliefs beliefs_;
  bool have_beliefs_ = false;
  std::shared_ptr<const Snapshot> snapshot_;
  Conditions planned_beliefs_;
  bool plan_requested_ = false;
  bool planning_ = false;
  bool stopping_ = false;
  int interval_ = 0;
  int last_migration_ = -1;
  int since_commit_ = 1 << 20;
  double previous_min_speed_ = 1, previous_min_bw_ = 1;
  env::ObservationHistory history_;  ///< condition_age and condition_loss, as the simulator.
  long plans_ = 0;
  double last_plan_ms_ = 0;
  std::condition_variable cv_;
  std::mutex policy_mutex_;  // the policy is not thread-safe
  std::thread planner_;
};

}  // namespace parapilot::agent::deploy
