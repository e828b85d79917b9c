// Scenarios of the simulator: a model and cluster, a horizon of decision intervals, and the
// hidden dynamics of one family (hetero, straggler, congestion, failure, phase, mixed, failslow),
// written as TOML under experiments/scenarios/ (docs/scenarios.md).
//
// Scenario is an immutable value; generate_truth() is a pure function of (scenario, seed).
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/status.h"
#include "strategy/cluster.h"
#include "strategy/cost_model.h"
#include "strategy/model.h"
#include "strategy/planner.h"
#include "strategy/space.h"

namespace parapilot::env {

enum class Family { kHetero, kStraggler, kCongestion, kFailure, kPhase, kMixed, kFailSlow };
const char* to_string(Family family);

struct TelemetryModel {
  double noise = 0.05;         // lognormal sigma of each reported time (compute, transfer)
  int delay_intervals = 1;     // an interval's telemetry arrives this many intervals after it began
  double missing_prob = 0.05;  // chance a rank's sample of a step is missing
  int steps_per_interval = 4;  // training steps reported per interval (the monitor's samples)
  // The agent believes the true conditions of the interval just run (failures as they happen)
  // instead of the monitor's estimate from the telemetry: a perfect estimator, for measuring
  // what estimation costs a policy. No real job has it.
  bool exact_beliefs = false;
};
/// A `beliefs` setting (scenario files, sim env ids): "monitor" -> false, "exact" -> true
/// (TelemetryModel::exact_beliefs); nullopt for anything else.
std::optional<bool> parse_exact_beliefs(const std::string& value);

struct StragglerDynamics {
  double rate_per_gpu_hour = 0.01;  // onset rate of slowdowns per GPU
  double slowdown_min = 1.2;        // a slowed GPU computes this many times slower, or up to
  double slowdown_max = 4.0;
  double transient_fraction = 0.6;  // share of slowdowns lasting seconds to minutes
  double transient_s_min = 30, transient_s_max = 600;
  double persistent_median_h = 1.5;  // lognormal median of the others' duration (hours)
  double persistent_sigma = 1.0;     // lognormal sigma: heavy tail up to ~10 hours
};

struct CongestionDynamics {
  double rate_per_node_hour = 0.03;        // onset rate of congestion per node
  double factor_min = 2, factor_max = 10;  // bandwidth divided by this much
  double duration_median_s = 1200;
  double duration_sigma = 1.0;
};

struct FailureDynamics {
  double rate_per_node_hour = 0.01;  // node or GPU losses
  double node_fraction = 0.3;        // share of failures that take the whole node
  double repair_median_s = 3600;     // lognormal median time until it returns
  double repair_sigma = 0.7;
};

struct PhaseDynamics {
  // At this fraction of the run the sequence length is multiplied (a long-context stage).
  double at_fraction = 0.75;
  int seq_len_factor = 4;

  // Global-batch ramp: the run starts at batch_start_fraction of the scenario's global batch
  // (rounded down to a multiple of the GPU count, never below one sample per GPU) and reaches
  // it in batch_ramp_steps equal steps, the last at batch_ramp_fraction of the run.
  // batch_start_fraction = 1 turns the ramp off.
  double batch_start_fraction = 0.25;
  double batch_ramp_fraction = 0.25;
  int batch_ramp_steps = 3;

  // Gradient compressibility. When `compression` is on, the monitor measures per-block
  // gradient statistics (top-k's and PowerSGD's relative error) and the planner may offer
  // compressed layouts whose error stays within error_budget, the error the run tolerates.
  // From decay_at_fraction of the run (the learning-rate decay) the gradients compress
  // better: the errors drop from *_before to *_after. Tokens of a layout whose compression
  // error exceeds the budget count at convergence_efficiency() (docs/scenarios.md).
  bool compression = true;
  double decay_at_fraction = 0.5;
  double topk_ratio = 0.01;  // the fraction of entries the monitor's top-k statistic keeps
  int powersgd_rank = 4;     // the rank the monitor's low-rank statistic uses
  double topk_error_before = 0.30, topk_error_after = 0.05;
  double powersgd_error_before = 0.25, powersgd_error_after = 0.04;
  double error_budget = 0.10;
  double convergence_penalty = 2.0;  // progress lost per unit of error above the budget
};

// One kind of fail-slow (the failslow family; docs/scenarios.md): onsets at `rate` per node-hour
// (communication) or per GPU-hour (compute), each slowing by a factor drawn uniformly in
// [factor_min, factor_max] for a lognormal duration of mean `mean_s` and sigma `sigma`
// (median mean_s * exp(-sigma^2 / 2)), capped at kMaxPersistentSlowdownS. It ends on its own.
struct FailSlowKind {
  double rate = 0;
  double factor_min = 1, factor_max = 1;
  double mean_s = 600;
  double sigma = 1.5;
};

// Fail-slows as production clusters see them (Greyhound/FALCON, ATC'25; docs/scenarios.md):
// communication fail-slows (a node's network bandwidth divided by the factor) are the more
// common, mean ~24 min; compute fail-slows (a GPU that many times slower) rarer, mean ~10 min;
// durations from under a minute to ~10 h. A `flap_fraction` share of them flap: slow and normal
// alternate in phases of flap_intervals_min..flap_intervals_max decision intervals (uniform)
// until the event ends. Rates default to 0: only the failslow family (or a file) turns them on.
struct FailSlowDynamics {
  FailSlowKind communication{0, 2, 8, 24 * 60, 1.5};  // rate per node-hour; bandwidth divided
  FailSlowKind compute{0, 1.3, 3, 10 * 60, 1.5};      // rate per GPU-hour; compute slower
  double flap_fraction = 0.3;
  int flap_intervals_min = 2, flap_intervals_max = 5;
};

// Defaults a scenario starts from, also what the reactive rule assumes of the job it runs
// (policy/baselines.h): one place for both.
inline constexpr double kDefaultIntervalS = 300;        // seconds of training per interval
inline constexpr double kDefaultStagingSlowdown = 0.1;  // slowdown while a switch is staged

struct Scenario {
  std::string name;
  Family family = Family::kStraggler;
  ModelSpec model;
  ClusterSpec cluster;
  int horizon = 96;               // decision intervals per episode
  double interval_s = kDefaultIntervalS;  // seconds of training per interval
  int global_batch = 0;           // 0: default_global_batch(gpus)
  double restart_s = 900;         // a crash (failed GPU, out of memory): reload and lost work
  double staging_slowdown = kDefaultStagingSlowdown;  // while a switch is staged
  // The pause a committed layout switch costs at its boundary: the planner's migration
  // estimate, the simulator's switch and the observation's payback all charge it. >= 0.
  double switch_pause_s = kSwitchPauseS;
  // Chance an episode's job declares its planned length (deploy: --total-steps); otherwise the
  // policy sees the run's length as unknown, as deploy does when no length is given.
  double run_length_known_prob = 0.75;
  TelemetryModel telemetry;
  StragglerDynamics straggler;
  CongestionDynamics congestion;
  FailureDynamics failure;
  PhaseDynamics phase;
  FailSlowDynamics failslow;
  SearchSpace space;  // what the planner may choose from
};

// The decision timing and switch pause the failslow family fits to a scenario's model and
// cluster (docs/scenarios.md, "failslow"), from the planner's best layout for the nominal
// cluster at the scenario's global batch:
//   interval_s     = kFailSlowStepsPerInterval training steps of it;
//   switch_pause_s = kLivePauseFixedS + the weights, gradients and optimizer state one of its
//                    GPUs holds / kHostToDeviceGBps: the live pause grows with the bytes a rank
//                    holds under the new layout (docs/results.md, "The pause against a
//                    restart"); on GPUs the staged state waits in host memory, since the running
//                    layout fills the GPU, and crosses PCIe at the boundary.
// Staging (bytes moved over the network) is the planner's migration estimate, unchanged.
// kInvalidArgument when no layout of the scenario's space fits its cluster.
struct FailSlowTiming {
  double step_s = 0;
  double state_bytes = 0;  // held by the GPU holding the most
  double interval_s = 0;
  double switch_pause_s = 0;
};
inline constexpr int kFailSlowStepsPerInterval = 5;
inline constexpr double kLivePauseFixedS = 0.005;  // live pause with nothing to copy: 4-6 ms
inline constexpr double kHostToDeviceGBps = 25;    // PCIe 4.0 x16, achieved
StatusOr<FailSlowTiming> failslow_timing(const Scenario& scenario);

// The built-in scenario of a family on `gpus` GPUs (nodes of 8; hetero and mixed use half
// a100-80g and half h800, the others a100-80g); failslow's interval and switch pause are
// fitted to its model and cluster (failslow_timing). Throws InputError for a `gpus` that is not
// a multiple of 8.
Scenario builtin_scenario(Family family, int gpus);
// Reads a scenario TOML ([scenario] table; docs/scenarios.md): kInvalidArgument naming the
// file, line and key at fault. A failslow file that names its own model, cluster, global batch
// or [space] is timed for them (failslow_timing) unless it sets interval_s, switch_pause_s or
// telemetry.steps_per_interval itself.
StatusOr<Scenario> load_scenario(const std::string& path);
// Parses a family name: kInvalidArgument listing the families.
StatusOr<Family> parse_family(const std::string& name);

// The hidden ground truth of one episode. Recorded truths may leave global_batch and the
// gradient fields empty: the scenario's batch throughout, and no compression modelled.
struct Truth {
  std::vector<Conditions> conditions;  // per interval: what the cluster really does
  std::vector<int> seq_len;            // per interval: the workload's sequence length
  std::vector<int> global_batch;       // per interval: sequences per iteration
  // The gradient statistics of each regime (before and after the learning-rate decay) with
  // the run's error budget; empty when compression is not modelled.
  std::vector<GradientStats> gradient_regimes;
  std::vector<int> gradient_regime;                 // per interval: index into gradient_regimes
  std::vector<std::pair<int, std::string>> events;  // (interval, description)
};
Truth generate_truth(const Scenario& scenario, uint64_t seed);

// The draws of one condition of the scenario's dynamics, in the order generate_truth makes them
// (after the condition's place and start); env/sim/futures.h samples futures with the same.
/// A straggler's slowdown: a GPU computes `factor` times slower for `duration_s`.
struct SlowdownDraw {
  double factor = 1;
  bool transient = false;  // seconds to minutes; otherwise persistent (lognormal, capped)
  double duration_s = 0;
};
SlowdownDraw draw_slowdown(const StragglerDynamics& d, std::mt19937_64& rng);
/// A congestion: a node's network bandwidth divided by `factor` for `duration_s`.
struct CongestionDraw {
  double factor = 1;
  double duration_s = 0;
};
CongestionDraw draw_congestion(const CongestionDynamics& d, std::mt19937_64& rng);
/// A fail-slow of one kind: slowed by `factor` for `duration_s`, flapping or not (its phases
/// are drawn where it is placed, as it is laid out).
struct FailSlowDraw {
  double factor = 1;
  double duration_s = 0;
  bool flapping = false;
};
FailSlowDraw draw_failslow(const FailSlowKind& kind, double flap_fraction, std::mt19937_64& rng);
/// Lays a fail-slow that starts at `start_s` out as add_slowdown does, up to the end of `extra`
/// (one entry per interval of `interval_s`): throughout, or, flapping, slow and nominal in turn
/// from slow, each phase flap_intervals_min..flap_intervals_max intervals long (drawn from
/// `rng`, one draw per phase begun).
void add_failslow(std::vector<double>& extra, double interval_s, double start_s,
                  const FailSlowDraw& draw, const FailSlowDynamics& d, std::mt19937_64& rng);
/// Seconds until a lost GPU or node returns.
double draw_repair_s(const FailureDynamics& d, std::mt19937_64& rng);
/// A persistent slowdown lasts at most this long.
inline constexpr double kMaxPersistentSlowdownS = 10 * 3600.0;

/// How a slowdown of [start_s, end_s) by `factor_minus_one` (factor - 1) shows per interval:
/// added to extra[i] of every interval it overlaps, weighted by the overlap (an interval spent
/// partly slowed takes proportionally longer). Interval i spans [i, i + 1) * interval_s.
void add_slowdown(std::vector<double>& extra, double interval_s, double start_s, double end_s,
                  double factor_minus_one);

// The global batch of a scenario before any ramp: its global_batch, else
// default_global_batch(gpus).
int final_global_batch(const Scenario& scenario);

// How `remaining_s` seconds of an interval pass while a switch is staged, in the simulator's
// switch model: the transfer runs for `staged_s` (the old layout at 1 - staging_slowdown of its
// speed), taking it off `staging_left_s`; when it ends with time left, the switch pause
// (`pause_s`, the scenario's switch_pause_s) commits the new layout, which runs the `rest_s`
// after it. A pause longer than what is left of the interval goes on into the next ones
// (`pause_left_s`; run_pause). Without a commit `rest_s` is what the old layout runs unslowed
// (0 while staging lasts the whole interval).
struct StagedInterval {
  double staged_s = 0;
  bool committed = false;
  double rest_s = 0;
  double pause_left_s = 0;  // of a committed switch's pause, what the interval had no room for
};
StagedInterval stage_switch(double& staging_left_s, double remaining_s, double pause_s);
// The start of an interval of `remaining_s` seconds still in a committed switch's pause: the
// job stands still for min(pause_left_s, remaining_s), taken off `pause_left_s`; returns the
// seconds left to train.
double run_pause(double& pause_left_s, double remaining_s);

// Relative gradient error of one block sent with compression `c`, under statistics `g`
// (measured at g.topk_ratio and g.powersgd_rank). Other top-k ratios follow the power law
// through the measured point (kept energy = ratio^alpha), other ranks error ∝ 1 / rank;
// fp16 costs g.fp16_error, no compression 0.
double compression_error(const Compression& c, const GradientStats& g, int layer);

// The share of a layout's tokens that counts as training progress under statistics `g`:
// 1 - penalty * (mean over the model's blocks of max(0, error - g.error_budget)), at least 0.
// 1 for a layout that compresses nothing beyond the budget.
double convergence_efficiency(const Strategy& s, int layers, const GradientStats& g,
                              double penalty);

}  // namespace parapilot::env
