// The training distribution of scenarios (domain randomisation): every episode of the env
// "sim:random" draws its cluster, GPU generations, model, search space, dynamics, workload
// phases and telemetry from ranges grounded in published figures (docs/scenarios.md, "The
// training distribution"), so that a policy trained on it has seen clusters of every size it
// may be deployed beside rather than one scenario file.
//
// draw_scenario is a pure function of (ranges, seed). The env is not thread-safe (one env per
// thread, as every Env).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "env/env.h"
#include "env/sim/scenario.h"

namespace parapilot::env {

struct ScenarioRanges {
  int gpus_min = 16;             // clusters of whole 8-GPU nodes, log-uniform in size ...
  int gpus_max = 1024;           // ... between these
  double single_node_prob = 0.15;  // or one node of 2, 4 or 8 GPUs (a small job)
  int horizon = 96;              // every draw's decision intervals (fixed: episodes batch alike)
  bool exact_beliefs = false;    // every draw's TelemetryModel::exact_beliefs
};

// One draw of the distribution. The drawn model and search space need not fit the cluster;
// the env below redraws until one does.
Scenario draw_scenario(const ScenarioRanges& ranges, uint64_t seed);

// "sim:random(gpus_min=16,gpus_max=1024,horizon=96)": at each reset(seed) a scenario is drawn
// from seed (redrawn, deterministically, until its model fits the cluster) and simulated as a
// scenario file would be. Its planning view is the running draw's.
std::unique_ptr<Env> make_distribution_env(const ScenarioRanges& ranges, std::string id);

}  // namespace parapilot::env
