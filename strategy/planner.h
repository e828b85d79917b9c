// Planner: given a model, a cluster and what the monitor currently believes about it (GPU
// speeds, link bandwidths, failed GPUs, gradient statistics), returns a short, diverse list of
// the fastest feasible hybrid-parallel layouts, each with its predicted cost and the cost of
// migrating to it from the current layout. Algorithm and formats: docs/planner.md.
//
// A Planner is built once per (model, cluster) and is immutable afterwards: plan() is const,
// keeps its scratch on the stack or in the call, and is safe to call concurrently from many
// threads (the RL loop does). It is meant to run online, in milliseconds.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "strategy/cluster.h"
#include "strategy/cost_model.h"
#include "strategy/model.h"
#include "strategy/space.h"
#include "strategy/strategy.h"

namespace parapilot {

struct PlanRequest {
  Conditions conditions;            // default: nominal cluster
  GradientStats gradients;          // default: unknown (no compression chosen)
  SearchSpace space;                // default: every legal layout
  // The running layout, when there is one (must be legal). The candidates depend on it only
  // through its kernel settings (attention, fp8, tp_comm_overlap, overlap_param_gather,
  // overlap_grad_reduce), which every candidate takes; it sets their migration costs and
  // PlanResult::current, which equal migration() and CostModel::evaluate() of it.
  std::optional<Strategy> current;
  int top_k = 5;                    // how many diverse candidates to return (>= 1)
  // ZeRO-1's parameter all-gather cannot be compressed; a plain all-reduce can. When true, the
  // gradients admit top-k or PowerSGD for some block and the space allows ZeRO 0 next to other
  // stages, the search also ranks each family's best ZeRO-0 layout among the ZeRO-0 layouts
  // alone (max(top_k, zero0_top_k) of them), compresses those leaders too and returns the
  // faster variant of each family: the same candidates as merging a search of the whole space
  // with one restricted to ZeRO 0 (docs/planner.md).
  bool zero0_variants = true;
  int zero0_top_k = 0;
};

struct Candidate {
  Strategy strategy;
  CostBreakdown cost;
  double migration_bytes = 0;  // largest amount of state one GPU must receive to switch
  double migration_s = 0;      // estimated switch time (transfers + the switch pause); 0 if same
};

struct PlanResult {
  // Best first by predicted throughput (tokens/s); all feasible and fitting in memory. Diverse:
  // no two share (tp, pp, dp, cp, sp, schedule, recompute), i.e. they differ in more than
  // microbatch size, virtual stages, ZeRO stage, stage boundaries, shares or compression.
  std::vector<Candidate> candidates;
  std::optional<Candidate> current;  // the current layout under these conditions, when given
  double search_ms = 0;              // wall time of the search
  long evaluated = 0;                // layouts evaluated through the cost model
  long pruned = 0;                   // layout families skipped by bounds before evaluation
};

// Per-GPU migration cost from one layout to another (see docs/planner.md): bytes of weights,
// gradients and optimizer state each GPU must receive, over its real links, plus the switch
// pause (PlannerOptions::switch_pause_s) for rebuilding communicators. Zero when the layouts
// hold the same state per GPU.
struct Migration {
  double max_bytes = 0;    // the most any one GPU receives
  double total_bytes = 0;  // summed over GPUs
  double time_s = 0;
};

// Default pause of a layout switch at its boundary (communicator rebuild, barrier), in seconds.
inline constexpr double kSwitchPauseS = 2.0;

struct PlannerOptions {
  // The pause every layout switch costs at its boundary, added to its transfer time in
  // Migration::time_s and Candidate::migration_s. >= 0.
  double switch_pause_s = kSwitchPauseS;
};

class Planner {
 public:
  Planner(ModelSpec model, ClusterSpec cluster, PlannerOptions options = {});

  const PlannerOptions& options() const { return options_; }

  const CostModel& cost_model() const { return cost_; }

  // Searches the space under request.conditions. Preconditions: top_k >= 1; the conditions'
  // vectors empty or sized for this cluster (per GPU, per node), speed factors > 0 (the
  // readers of conditions files check them: load_conditions). An empty candidate list means
  // no layout in the space can run: none fits in memory, or every GPU has failed.
  PlanResult plan(const PlanRequest& request) const;

  // Migration cost between two legal layouts under conditions c.
  Migration migration(const Strategy& from, const Strategy& to, const Conditions& c = {}) const;
  // Sets every candidate's migration_bytes and migration_s to migration(from, its layout, c),
  // as plan() does for PlanRequest::current (from's holdings worked out once).
  void price_migrations(const Strategy& from, std::vector<Candidate>& candidates,
                        const Conditions& c = {}) const;

 private:
  ModelSpec model_;
  ClusterSpec cluster_;
  PlannerOptions options_;
  CostModel cost_;
  // One per GPU type present: a three-block copy of the model on a single node of that type,
  // used to read per-block, embedding and logits times off the cost model.
  std::vector<CostModel> probes_;
  // Per-block, embedding and logits times read off the probes, by (GPU type, tp, microbatch,
  // sp, recompute): they do not depend on the conditions, so every plan() call shares them.
  // Guarded by its own mutex; shared by copies of this planner.
  std::shared_ptr<struct BlockCostCache> block_cache_;
};

}  // namespace parapilot
