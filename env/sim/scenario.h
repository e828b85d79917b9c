// Scenarios of the simulator: a model and cluster, a horizon of decision intervals, and the
// hidden dynamics of one family (hetero, straggler, congestion, failure, phase, mixed),
// written as TOML under experiments/scenarios/ (docs/scenarios.md).
//
// Scenario is an immutable value; generate_truth() is a pure function of (scenario, seed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strategy/cluster.h"
#include "strategy/cost_model.h"
#include "strategy/model.h"
#include "strategy/space.h"

namespace parapilot::env {

enum class Family { kHetero, kStraggler, kCongestion, kFailure, kPhase, kMixed };
const char* to_string(Family family);

struct TelemetryModel {
  double noise = 0.05;       // relative noise (lognormal sigma) of each speed / bandwidth sample
  int delay_intervals = 1;   // samples describe the interval this many steps ago
  double missing_prob = 0.05;  // chance a GPU's or node's sample is missing in an interval
};

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
  double rate_per_node_hour = 0.03;  // onset rate of congestion per node
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
  double at_fraction = 0.5;
  int seq_len_factor = 4;
};

struct Scenario {
  std::string name;
  Family family = Family::kStraggler;
  ModelSpec model;
  ClusterSpec cluster;
  int horizon = 96;         // decision intervals per episode
  double interval_s = 300;  // seconds of training per interval
  int global_batch = 0;     // 0: default_global_batch(gpus)
  double restart_s = 900;   // a crash (failed GPU, out of memory): reload and lost work
  double staging_slowdown = 0.1;  // training slows this much while a switch is staged
  TelemetryModel telemetry;
  StragglerDynamics straggler;
  CongestionDynamics congestion;
  FailureDynamics failure;
  PhaseDynamics phase;
  SearchSpace space;  // what the planner may choose from
};

// The built-in scenario of a family on `gpus` GPUs (nodes of 8; hetero and mixed use half
// a100-80g and half h800, the others a100-80g).
Scenario builtin_scenario(Family family, int gpus);
// Reads a scenario TOML ([scenario] table; docs/scenarios.md). Throws InputError.
Scenario load_scenario(const std::string& path);
// Parses a family name; throws InputError listing the families.
Family parse_family(const std::string& name);

// The hidden ground truth of one episode.
struct Truth {
  std::vector<Conditions> conditions;  // per interval: what the cluster really does
  std::vector<int> seq_len;            // per interval: the workload's sequence length
  std::vector<std::pair<int, std::string>> events;  // (interval, description)
};
Truth generate_truth(const Scenario& scenario, uint64_t seed);

}  // namespace parapilot::env
