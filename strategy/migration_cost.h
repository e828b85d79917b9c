// Migration cost between two layouts (Planner::migration, docs/planner.md): which layer slices
// and optimizer shards every GPU holds under a layout, and what it must receive to switch.
// Internal to strategy/: the public contract is strategy/planner.h.
#pragma once

#include <vector>

#include "strategy/cost_model.h"
#include "strategy/planner.h"

namespace parapilot {
namespace planner_internal {

// State of one GPU: per layer slot (embedding = -1, blocks 0..L-1, output = L), the fraction of
// the layer's tensor-parallel width it holds, and the fraction of that shard's optimizer state.
struct Holding {
  int first_layer, last_layer;  // inclusive, in [-1, L]
  double tp_lo, tp_hi;          // slice of the layer's parameters, in [0, 1)
  double opt_lo, opt_hi;        // slice of the optimizer state it owns (ZeRO), in [0, 1)
};

// The holdings of every GPU, flat: GPU g holds items[first[g]] .. items[first[g + 1] - 1].
struct Holdings {
  std::vector<Holding> items;
  std::vector<int> first;
};

// Fills `out` with the holdings of every GPU of a gpu_count-GPU cluster under layout s.
void holdings_of(const Strategy& s, const ModelSpec& model, int gpu_count, Holdings& out);

// Migration from a layout whose holdings are `before` to `to`; a switch adds `pause_s`.
Migration migration_from(const Holdings& before, const Strategy& from, const Strategy& to,
                         const Conditions& c, const ModelSpec& model, const ClusterTopology& topo,
                         double pause_s);

}  // namespace planner_internal
}  // namespace parapilot
