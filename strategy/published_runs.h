// Published training runs as (model, cluster, layout) triples: the calibration references of
// the cost model (tests/data/*.csv, docs/cost-model.md). Two formats:
//  - Megatron-LM SC'21 Table 1 (megatron-sc21-table1.csv): GPT models on Selene (nodes of 8
//    A100 80GB, one HDR NIC per GPU), fp16, full recompute, unfused attention, the gradient
//    reduction after the backward pass; the published figure is TFLOP/s per GPU.
//  - Hopper runs (modern-given.csv): one column per model, cluster and layout setting; the
//    published figure is the step time. They run as NVIDIA's recipes configure them: the
//    distributed optimizer with both overlaps and tensor-parallel communication overlap.
//
// Loaders return kInvalidArgument naming the file, line and column at fault; every returned layout
// is legal for its model and cluster. Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "strategy/cluster.h"
#include "strategy/cost_model.h"
#include "strategy/model.h"
#include "strategy/strategy.h"

namespace parapilot {

struct PublishedRun {
  std::string id;  // the row's name
  ModelSpec model;
  ClusterSpec cluster;
  Strategy strategy;
  double iteration_s = 0;     // published step time; 0 when the row gives TFLOP/s instead
  double tflops_per_gpu = 0;  // published model TFLOP/s per GPU; 0 when it gives the step

  // The figure the row publishes (step time or TFLOP/s per GPU), and the same figure of a
  // prediction.
  double published() const;
  double predicted(const CostBreakdown& b) const;
};

/// The rows of a calibration CSV; kInvalidArgument naming the file, line and column at fault.
StatusOr<std::vector<PublishedRun>> load_sc21_runs(const std::string& path);
StatusOr<std::vector<PublishedRun>> load_hopper_runs(const std::string& path);

}  // namespace parapilot
