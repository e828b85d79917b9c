// What-if analysis of a recorded per-op trace: how much faster would the job run if every op
// took its typical duration, who is to blame, why, and what layout change would help.
// The method is described in docs/trace-analysis.md.
//
// analyze_trace() is a pure function of its inputs; recorded_conditions() turns a trace into
// the per-interval, per-GPU speed factors that a trace-replay environment feeds to the cost
// model as hidden conditions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "env/trace/op_trace.h"
#include "strategy/cost_model.h"

namespace parapilot::trace {

struct AnalysisOptions {
  // Transformer layers of the whole model, for the re-partitioning remedy. 0: unknown; the
  // analysis then assumes kAssumedLayersPerStage layers on every stage and says so.
  int layers = 0;
};
inline constexpr int kAssumedLayersPerStage = 8;

struct Straggler {
  int rank = 0;
  int dp_rank = 0;
  int stage = 0;
  double slowdown = 1;       // ideal run with only this rank's ops as measured, over ideal
  double compute_ratio = 1;  // its compute per microbatch over its stage's typical
};

struct Remedy {
  std::string kind;  // "repartition-stages" | "rebalance-dp-shares" | "none"
  std::string description;
  double current_step_s = 0;    // the replayed measured step time
  double predicted_step_s = 0;  // after the change
  // repartition-stages: layers per stage now and proposed; whether the current split is assumed.
  std::vector<int> current_layers;
  std::vector<int> proposed_layers;
  bool layers_assumed = false;
  std::vector<double> current_stage_s;  // forward + backward of one microbatch, per stage
  std::vector<double> proposed_stage_s;
  // rebalance-dp-shares: microbatches per data-parallel replica now and proposed, and each
  // replica's relative speed (1 = the fastest).
  std::vector<int> current_microbatches;
  std::vector<int> proposed_microbatches;
  std::vector<double> replica_speed;
};

struct TraceAnalysis {
  JobMeta meta;
  int steps = 0;
  int microbatches = 0;        // per replica per step
  double recorded_step_s = 0;  // mean over steps, wall time as recorded
  double measured_step_s = 0;  // mean replayed step time with measured durations
  double ideal_step_s = 0;     // mean replayed step time with typical durations
  double slowdown = 1;         // measured / ideal
  // Ideal run with only that group's ops as measured, over ideal (the what-if attribution).
  std::map<int, double> stage_slowdown;
  std::map<int, double> dp_rank_slowdown;
  std::map<int, double> rank_slowdown;
  std::map<std::string, double> optype_slowdown;
  // The slowdown split into three factors whose product is `slowdown`: stage-level compute
  // differences (partitioning), worker-level ones on top, and what remains (op-to-op and
  // step-to-step variation, communication).
  double stage_factor = 1;
  double worker_factor = 1;
  double diffuse_factor = 1;
  std::string cause;  // "worker" | "stage-imbalance" | "diffuse" | "none" (slowdown < 1.02)
  std::vector<Straggler> stragglers;    // most harmful first
  std::vector<double> stage_compute_s;  // typical forward + backward per microbatch, per stage
  Remedy remedy;
};

// kInvalidArgument when the trace's steps cannot be ordered (ReplayGraph::build).
StatusOr<TraceAnalysis> analyze_trace(const OpTrace& trace, const AnalysisOptions& options = {});

// One interval of recorded reality: per-GPU speed factors (1 = the typical speed of that GPU's
// pipeline stage, 0.5 = its computes took twice as long) averaged over the interval's steps.
// GPUs are global ranks; ranks absent from the trace stay at 1.
struct ConditionsInterval {
  std::int64_t first_step = 0;
  std::int64_t last_step = 0;
  double start_s = 0;     // from the start of the first recorded step
  double duration_s = 0;  // wall time the interval covers
  Conditions conditions;
};

// Splits the recorded steps into intervals of `steps_per_interval` consecutive steps (the last
// may be shorter). Requires steps_per_interval >= 1.
std::vector<ConditionsInterval> recorded_conditions(const OpTrace& trace,
                                                    int steps_per_interval = 1);

}  // namespace parapilot::trace
