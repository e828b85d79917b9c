// The Env API: environments a scheduling policy learns in and is judged in (Gymnasium
// conventions), their registry, and a vectorised runner.
//
// An Env is one mutable episode at a time: reset(seed) starts an episode, step(action) advances
// one decision interval. Envs are not thread-safe; VectorEnv steps many envs on a thread pool,
// each env only ever touched by one thread at a time, and every env is deterministic for its
// seed. Observations have a fixed size, independent of the cluster (docs/observation.md).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "env/registry.h"

namespace parapilot::env {

class PlanningView;  // env/sim/planning_view.h

inline constexpr int kStateDim = 26;
inline constexpr int kMaxCandidates = 4;
inline constexpr int kCandidateDim = 10;

// Action 0 keeps the current layout; action k in 1..kMaxCandidates switches to candidate k-1
// (only where mask[k-1] is 1; a masked action is treated as keep).
inline constexpr int kNumActions = 1 + kMaxCandidates;

struct Observation {
  std::array<float, kStateDim> state{};
  std::array<float, kMaxCandidates * kCandidateDim> candidates{};  // row k = candidate k
  std::array<uint8_t, kMaxCandidates> mask{};                      // 1 = candidate present
};

// Diagnostics of one step (never needed to act).
struct StepInfo {
  double tokens = 0;             // tokens processed in the interval
  double best_tokens = 0;        // what the best layout under the true conditions would process
  double tokens_per_s = 0;       // tokens / interval length
  bool migration_started = false;
  bool migration_committed = false;  // a new layout took over during this interval
  bool restarted = false;            // the layout crashed (failed GPU, out of memory) and restarted
  int interval = 0;
};

struct StepResult {
  Observation observation;
  double reward = 0;  // tokens / best_tokens (docs/observation.md)
  bool terminated = false;
  bool truncated = false;  // the horizon was reached
  StepInfo info;
};

struct ResetOptions {
  // The layout an episode starts on: "planned" (the best plan for the nominal cluster) or
  // "uniform-dp" (pure data parallel, equal shares).
  std::string initial_layout = "planned";
};

// A hindsight summary of one episode: the most tokens any sequence of layout switches could
// have processed per interval, knowing the whole future.
struct OracleResult {
  std::vector<double> tokens_per_interval;
  int migrations = 0;
  /// Per interval, whether the true conditions or workload (sequence length, global batch,
  /// gradient regime) differ from the interval before; interval 0 is compared with the nominal
  /// cluster at its own workload, the state every episode's first layout is planned for. The
  /// oracle may switch ahead of such a change; a causal policy learns of it only from the
  /// telemetry of the interval it happens in. Empty when the env does not say.
  std::vector<bool> truth_changed;
};

class Env {
 public:
  virtual ~Env() = default;
  virtual std::string id() const = 0;
  virtual int horizon() const = 0;
  virtual double interval_s() const = 0;
  // Starts an episode and returns its first observation. Errors: the episode could not start
  // (a live job whose workers did not come up: kUnavailable; a drawn scenario that cannot run:
  // kInvalidArgument); step() then needs a successful reset first.
  virtual StatusOr<Observation> reset(uint64_t seed, const ResetOptions& options = {}) = 0;
  virtual StepResult step(int action) = 0;
  // The hindsight oracle for the current episode; nullopt when the env cannot see its future.
  virtual std::optional<OracleResult> oracle() { return std::nullopt; }
  // What a policy that plans ahead may read of the job besides the observation: beliefs,
  // candidates and the scenario's dynamics, never the hidden truth (env/sim/planning_view.h).
  // nullptr when the env has no dynamics to sample futures from (a trace replay, a live job).
  virtual const PlanningView* planning_view() const { return nullptr; }
  // Events of the current episode for plots: (interval, description).
  virtual std::vector<std::pair<int, std::string>> events() const { return {}; }
};


// Steps N envs in parallel on `threads` worker threads. An env whose episode ends is reset at
// once: its StepResult keeps the final reward and flags, and its observation is the next
// episode's first one.
class VectorEnv {
 public:
  VectorEnv(std::vector<std::unique_ptr<Env>> envs, int threads);
  ~VectorEnv();
  VectorEnv(const VectorEnv&) = delete;
  VectorEnv& operator=(const VectorEnv&) = delete;

  int size() const { return static_cast<int>(envs_.size()); }
  // Resets env i with seed base_seed + i. The first env's error (Env::reset) when any fails.
  StatusOr<std::vector<Observation>> reset(uint64_t base_seed);
  // Steps env i with actions[i] (one action per env). The first error of an env's reset after
  // its episode ended.
  StatusOr<std::vector<StepResult>> step(const std::vector<int>& actions);
  Env& env(int i) { return *envs_[i]; }

 private:
  struct Pool;
  std::vector<std::unique_ptr<Env>> envs_;
  std::vector<uint64_t> next_seed_;
  std::unique_ptr<Pool> pool_;
};

}  // namespace parapilot::env
