#include "strategy/planner.h"

#include <algorithm>

#include "strategy/migration_cost.h"
#include "strategy/planner_search.h"

namespace parapilot {

using planner_internal::Holdings;
using planner_internal::holdings_of;
using planner_internal::migration_from;
using planner_internal::Search;

Planner::Planner(ModelSpec model, ClusterSpec cluster, PlannerOptions options)
    : model_(std::move(model)),
      cluster_(std::move(cluster)),
      options_(options),
      cost_(model_, cluster_),
      block_cache_(std::make_shared<BlockCostCache>()) {
  const ClusterTopology& topo = cost_.topology();
  ModelSpec probe_model = model_;
  probe_model.layers = 3;
  for (size_t k = 0; k < topo.types.size(); ++k) {
    const ClusterTopology::Node* node = nullptr;
    for (const auto& n : topo.nodes) {
      if (n.type == static_cast<int>(k)) {
        node = &n;
        break;
      }
    }
    ClusterSpec probe;
    probe.name = "probe";
    NodeGroup g;
    g.count = 1;
    // Room for two stages of any width (a stage's tp x cp GPUs may fill whole nodes).
    g.gpus_per_node = 2 * topo.num_gpus();
    g.gpu = topo.types[k];
    g.intra_node_GBps = node->intra_GBps;
    g.inter_node_Gbps = node->inter_GBps * 8.0;
    probe.groups.push_back(g);
    probe.intra_node_latency_us = cluster_.intra_node_latency_us;
    probe.inter_node_latency_us = cluster_.inter_node_latency_us;
    probe.intra_node_efficiency = cluster_.intra_node_efficiency;
    probe.inter_node_efficiency = cluster_.inter_node_efficiency;
    probes_.emplace_back(probe_model, probe);
  }
}

PlanResult Planner::plan(const PlanRequest& request) const {
  PlanRequest resolved = request;
  SearchSpace& space = resolved.space;
  if (space.global_batch == 0 && space.global_batch_max == 0) {
    space.global_batch =
        request.current ? request.current->global_batch : default_global_batch(cluster_.num_gpus());
  }
  // Vectors that hold only nominal values say nothing: emptied, they take the cost model's
  // fast paths in every evaluation of the search (the same conditions).
  Conditions& c = resolved.conditions;
  auto nominal = [](const std::vector<double>& v) {
    return std::all_of(v.begin(), v.end(), [](double x) { return x == 1.0; });
  };
  if (nominal(c.gpu_speed)) c.gpu_speed.clear();
  if (nominal(c.node_inter_bw)) c.node_inter_bw.clear();
  if (nominal(c.node_intra_bw)) c.node_intra_bw.clear();
  if (std::find(c.gpu_failed.begin(), c.gpu_failed.end(), true) == c.gpu_failed.end()) {
    c.gpu_failed.clear();
  }
  Search search(model_, cost_, probes_, *block_cache_, resolved);
  PlanResult result = search.run();
  if (request.current) price_migrations(*request.current, result.candidates, request.conditions);
  return result;
}

void Planner::price_migrations(const Strategy& from, std::vector<Candidate>& candidates,
                               const Conditions& c) const {
  // The running layout's holdings are kept from the previous call while the layout and what
  // they depend on (the model's depth, the cluster's size) stay the same: a job replans far
  // more often than it switches layouts.
  thread_local Holdings before;
  thread_local Strategy held_layout;
  thread_local int held_layers = -1, held_gpus = -1;
  const int gpus = cost_.topology().num_gpus();
  if (!(held_layers == model_.layers && held_gpus == gpus && held_layout == from)) {
    holdings_of(from, model_, gpus, before);
    held_layout = from;
    held_layers = model_.layers;
    held_gpus = gpus;
  }
  for (Candidate& cand : candidates) {
    const Migration m = migration_from(before, from, cand.strategy, c, model_, cost_.topology(),
                                       options_.switch_pause_s);
    cand.migration_bytes = m.max_bytes;
    cand.migration_s = m.time_s;
  }
}

Migration Planner::migration(const Strategy& from, const Strategy& to, const Conditions& c) const {
  thread_local Holdings before;
  holdings_of(from, model_, cost_.topology().num_gpus(), before);
  return migration_from(before, from, to, c, model_, cost_.topology(), options_.switch_pause_s);
}

}  // namespace parapilot
