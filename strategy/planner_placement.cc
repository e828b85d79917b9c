// Search: tensor-parallel groups of usable GPUs, their placement into replicas and pipeline
// stages (packed and spread), and the links between neighbouring stages (docs/planner.md).
#include "strategy/planner_search.h"

#include <algorithm>
#include <cassert>
#include <cmath>

namespace parapilot {
namespace planner_internal {

// One p2p message between two GPUs of a node.
double Search::nvlink_s(int node, double bytes) const {
  const double bw = topo_.nodes[node].intra_GBps * 1e9 * topo_.intra_efficiency * c_.intra(node);
  return topo_.intra_latency_s + bytes / bw;
}

double Search::network_link_s(int slower, double bytes) const {
  const double bw =
      topo_.nodes[slower].inter_GBps * c_.inter(slower) * 1e9 * topo_.inter_efficiency;
  return topo_.inter_latency_s + bytes / bw;
}

void Search::make_groups(int tp, int cp) {
  const int unit = tp * cp;  // GPUs of one stage
  if (scratch_.groups.size() <= static_cast<size_t>(unit)) {
    scratch_.groups.resize(unit + 1);
    scratch_.flat_gpus.resize(unit + 1);
    scratch_.speed_order.resize(unit + 1);
    scratch_.speed_order_keys.resize(unit + 1);
  }
  std::vector<Group>& groups = scratch_.groups[unit];
  std::vector<int>& flat_gpus = scratch_.flat_gpus[unit];
  groups.clear();
  flat_gpus.clear();
  std::vector<int>& usable = scratch_.usable;
  std::vector<int>& usable_first = scratch_.usable_first;
  std::vector<double>& inverse_speed = scratch_.inverse_speed;
  std::vector<double>& node_link_speed = scratch_.node_link_speed;
  if (!gpus_ready_) {  // what every (tp, cp) shares
    inverse_speed.resize(topo_.num_gpus());
    for (int gpu = 0; gpu < topo_.num_gpus(); ++gpu) inverse_speed[gpu] = 1.0 / c_.speed(gpu);
    node_link_speed.resize(topo_.nodes.size());
    for (int n = 0; n < topo_.num_nodes(); ++n) {
      node_link_speed[n] = topo_.nodes[n].intra_GBps * c_.intra(n);
    }
    usable.clear();
    usable_first.assign(1, 0);
    for (const auto& node : topo_.nodes) {
      for (int gpu = node.first_gpu; gpu < node.first_gpu + node.gpus; ++gpu) {
        if (!c_.failed(gpu)) usable.push_back(gpu);
      }
      usable_first.push_back(static_cast<int>(usable.size()));
    }
    gpus_ready_ = true;
  }
  // A stage wider than a node takes whole slices of `slice` GPUs (a multiple of tp, so every
  // tensor-parallel group stays in one node) from `span` nodes of one GPU type, in node order:
  // its context-parallel ring then crosses nodes.
  int max_node = 1;
  for (const auto& node : topo_.nodes) max_node = std::max(max_node, node.gpus);
  const int slice = unit <= max_node ? unit : max_node;
  const int span = unit / slice;
  assert(unit % slice == 0 && slice % tp == 0);  // the caller's precondition
  // The groups' GPUs are written to flat_gpus[0, filled): at most every usable GPU.
  flat_gpus.resize(usable.size());
  int filled = 0;
  int members = 0;  // slices of the group being built
  Group building;
  double slowest_link = kInf;
  for (int n = 0; n < topo_.num_nodes(); ++n) {
    const auto& node = topo_.nodes[n];
    // The node's NVLink speed, and its seconds per byte for a ring step: over NVLink for a
    // stage inside the node, else over the network.
    const double link = node_link_speed[n];
    const double ring_s_per_byte =
        span == 1 ? 1.0 / (node.intra_GBps * 1e9 * topo_.intra_efficiency * c_.intra(n))
                  : 1.0 / (node.inter_GBps * c_.inter(n) * 1e9 * topo_.inter_efficiency);
    for (int i = usable_first[n]; i + slice <= usable_first[n + 1]; i += slice) {
      if (members > 0 && node.type != building.type) {  // a group has one GPU type: start again
        filled = building.first;
        members = 0;
      }
      if (members == 0) {
        building = Group{};
        building.first = filled;
        building.node = n;
        building.first_node = n;
        building.type = node.type;
        building.slow = 0;
        slowest_link = kInf;
      }
      // Its tensor-parallel collectives run at its slowest node's NVLink.
      if (link < slowest_link) {
        slowest_link = link;
        building.node = n;
      }
      for (int t = 0; t < slice; ++t) {
        flat_gpus[filled++] = usable[i + t];
        building.slow = std::max(building.slow, inverse_speed[usable[i + t]]);
      }
      if (span == 1) {
        building.ring_latency_s = topo_.intra_latency_s;
        building.ring_s_per_byte = ring_s_per_byte;
      } else {
        building.ring_latency_s = topo_.inter_latency_s;
        building.ring_s_per_byte = std::max(building.ring_s_per_byte, ring_s_per_byte);
      }
      if (++members == span) {
        groups.push_back(building);
        members = 0;
      }
    }
  }
  flat_gpus.resize(members > 0 ? building.first : filled);
  // One block time per GPU type (negative: not looked up yet).
  std::vector<double>& type_block_s = scratch_.type_block_s;
  type_block_s.assign(topo_.types.size(), -1.0);
  for (auto& g : groups) {
    double& block_s = type_block_s[g.type];
    if (block_s < 0) block_s = block_costs(g.type, tp, cp, 1, false, Recompute::kNone).block_s;
    g.speed_proxy = 1.0 / (block_s * g.slow);
  }
  // The order depends on the sequence of speeds alone: the same speeds as the last sort for
  // this tp (on this thread) give the same order.
  std::vector<int>& order = scratch_.speed_order[unit];
  std::vector<double>& keys = scratch_.speed_order_keys[unit];
  bool same = keys.size() == groups.size() && order.size() == groups.size();
  for (size_t i = 0; i < groups.size() && same; ++i) same = keys[i] == groups[i].speed_proxy;
  if (same) return;
  keys.resize(groups.size());
  for (size_t i = 0; i < groups.size(); ++i) keys[i] = groups[i].speed_proxy;
  speed_order(keys, order);
}

void speed_order(const std::vector<double>& speed, std::vector<int>& order) {
  const size_t n = speed.size();
  order.resize(n);
  // Groups come in stretches of equal speed (a node type at nominal speed): the stretches,
  // (speed, first index, length), in index order.
  struct Stretch {
    double speed;
    int first, length;
  };
  thread_local std::vector<Stretch> stretches;
  stretches.clear();
  bool by_value = true;
  for (size_t i = 0; i < n; ++i) {
    by_value = by_value && speed[i] >= 0;  // neither negative nor NaN
    if (i > 0 && speed[i] == speed[i - 1]) {
      ++stretches.back().length;
    } else {
      stretches.push_back({speed[i], static_cast<int>(i), 1});
    }
  }
  auto faster = [](double a, double b) { return a > b * (1 + 1e-12); };
  if (by_value) {
    std::stable_sort(stretches.begin(), stretches.end(),
                     [](const Stretch& a, const Stretch& b) { return a.speed > b.speed; });
    // On speeds >= 0, `faster` is irreflexive, and when every two neighbouring distinct speeds
    // (in descending order) are `faster` than one another, so is every faster speed than every
    // slower one (x * (1 + 1e-12) is monotonic in x): `faster` is then exactly `>`, and the
    // stable sort by it is the speeds descending, ties by index, which is the stretches
    // descending (stable) read out in turn.
    for (size_t k = 1; k < stretches.size() && by_value; ++k) {
      const double a = stretches[k - 1].speed, b = stretches[k].speed;
      by_value = a == b || faster(a, b);
    }
  }
  if (by_value) {
    size_t at = 0;
    for (const Stretch& s : stretches) {
      for (int i = 0; i < s.length; ++i) order[at++] = s.first + i;
    }
    return;
  }
  // Speeds within the tolerance of one another: the comparison is not an order, and what the
  // sort makes of it depends on the sort itself.
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return faster(speed[a], speed[b]); });
}

// The next placement of this search, its per-slot vectors sized for dp * pp slots.
Placement& Search::new_placement(int tp, int cp, int pp, int dp) {
  std::vector<Placement>& pool = scratch_.placements;
  if (placement_count_ == pool.size()) pool.emplace_back();
  Placement& pl = pool[placement_count_++];
  const size_t used = static_cast<size_t>(dp) * pp;
  pl.dp = dp;
  pl.pp = pp;
  pl.tp = tp;
  pl.cp = cp;
  pl.group.resize(used);
  pl.type.resize(used);
  pl.slow.resize(used);
  pl.slot_link.resize(used);
  pl.link_node.clear();
  pl.types_used = 0;
  pl.detailed = false;
  return pl;
}

void Search::add_placements(int tp, int cp, int pp, int dp) {
  const int used = dp * pp;
  const std::vector<int>& order = scratch_.speed_order[tp * cp];
  const std::vector<Group>& groups = scratch_.groups[tp * cp];

  // Per-slot type, slowness and NVLink speed class of a placement whose groups are set, and
  // its runs of like replicas, in one pass.
  auto finish = [&](Placement& pl) {
    std::vector<double>& link_speed = scratch_.link_speed;
    link_speed.clear();
    // Each node's class in this placement, looked up once: valid where its stamp is this
    // placement's. A class is the index of its speed among the placement's distinct speeds, in
    // the order the slots first show them.
    std::vector<int>& node_link = scratch_.node_link;
    std::vector<unsigned long>& node_link_stamp = scratch_.node_link_stamp;
    node_link.resize(topo_.nodes.size());
    node_link_stamp.resize(topo_.nodes.size(), 0);
    const unsigned long stamp = ++scratch_.link_stamp;
    unsigned types_used = 0;
    pl.like_replica.resize(pl.dp);
    // Raw pointers: stores through the vectors' elements would otherwise make the compiler
    // reload every vector's data pointer slot by slot.
    const Group* group_of = groups.data();
    const int* group = pl.group.data();
    int* type = pl.type.data();
    double* slow = pl.slow.data();
    int* slot_link = pl.slot_link.data();
    int* link_of_node = node_link.data();
    unsigned long* link_stamp = node_link_stamp.data();
    // Local copies, which those stores cannot touch either.
    const int stages = pp, replicas = pl.dp;
    const bool ring = cp > 1;
    for (int r = 0; r < replicas; ++r) {
      bool same = r > 0;  // so far, slot for slot like replica r - 1
      const int end = (r + 1) * stages;
      for (int slot = r * stages; slot < end; ++slot) {
        const Group& g = group_of[group[slot]];
        type[slot] = g.type;
        slow[slot] = g.slow;
        const int node = g.node;
        if (link_stamp[node] != stamp) {
          const double speed = scratch_.node_link_speed[node];
          size_t i = 0;
          while (i < link_speed.size() && link_speed[i] != speed) ++i;
          if (i == link_speed.size()) {
            link_speed.push_back(speed);
            pl.link_node.push_back(node);
          }
          link_of_node[node] = static_cast<int>(i);
          link_stamp[node] = stamp;
        }
        slot_link[slot] = link_of_node[node];
        if (same) {
          const int b = slot - stages;
          same = g.type == type[b] && g.slow == slow[b] && slot_link[slot] == slot_link[b];
          if (same && ring) {
            const Group& gb = group_of[group[b]];
            same = g.ring_latency_s == gb.ring_latency_s && g.ring_s_per_byte == gb.ring_s_per_byte;
          }
        }
      }
      pl.like_replica[r] = same ? pl.like_replica[r - 1] : r;
      // A like replica has the previous one's types slot for slot.
      for (int slot = r * stages; slot < end && !same; ++slot) {
        if (type[slot] < 8) types_used |= 1u << type[slot];
      }
    }
    pl.types_used |= types_used;
  };

  // Packed: replicas of similar speed (slow groups together; elastic shares absorb the rest).
  std::vector<int>& chosen = scratch_.chosen;
  if (space_.mixed_types_in_pipeline) {
    chosen.assign(order.begin(), order.begin() + used);
  } else {
    // Whole replicas per GPU type, fastest groups of each type first.
    std::vector<std::vector<int>>& by_type = scratch_.by_type;
    by_type.resize(topo_.types.size());
    for (auto& list : by_type) list.clear();
    for (int g : order) by_type[groups[g].type].push_back(g);
    std::vector<int>& replicas = scratch_.replicas;
    replicas.assign(by_type.size(), 0);
    int total = 0;
    for (size_t k = 0; k < by_type.size(); ++k) {
      replicas[k] = static_cast<int>(by_type[k].size()) / pp;
      total += replicas[k];
    }
    if (total < dp) return;
    // Drop whole replicas of the slowest groups until dp remain.
    for (int excess = total - dp; excess > 0; --excess) {
      int worst = -1;
      double worst_speed = kInf;
      for (size_t k = 0; k < by_type.size(); ++k) {
        if (replicas[k] == 0) continue;
        const double speed = groups[by_type[k][replicas[k] * pp - 1]].speed_proxy;
        if (speed < worst_speed) {
          worst_speed = speed;
          worst = static_cast<int>(k);
        }
      }
      --replicas[worst];
    }
    chosen.clear();
    for (size_t k = 0; k < by_type.size(); ++k) {
      chosen.insert(chosen.end(), by_type[k].begin(), by_type[k].begin() + replicas[k] * pp);
    }
  }
  {
    Placement& pl = new_placement(tp, cp, pp, dp);
    std::copy(chosen.begin(), chosen.begin() + used, pl.group.begin());
    for (int r = 0; r < dp && pp > 1; ++r) {
      // Node order inside a replica.
      std::sort(pl.group.begin() + r * pp, pl.group.begin() + (r + 1) * pp);
    }
    finish(pl);
  }
  // Spread: every replica gets the same mix, stage p from the p-th speed tier (unless the
  // groups' speeds are uniform).
  auto uniform = [&]() {
    for (int i = 1; i < used; ++i) {
      const double ratio = groups[chosen[i]].speed_proxy / groups[chosen[0]].speed_proxy;
      if (!(std::abs(ratio - 1.0) < 1e-9)) return false;
    }
    return true;
  };
  if (dp > 1 && pp > 1 && space_.mixed_types_in_pipeline && !uniform()) {
    Placement& pl = new_placement(tp, cp, pp, dp);
    for (int r = 0; r < dp; ++r) {
      for (int p = 0; p < pp; ++p) pl.group[r * pp + p] = chosen[p * dp + r];
    }
    finish(pl);
  }
}

// A placement with its point-to-point links and GPU list, computed on first use.
const Placement& Search::detailed(int placement_index) {
  Placement& pl = scratch_.placements[placement_index];
  if (pl.detailed) return pl;
  const int dp = pl.dp, pp = pl.pp, unit = pl.tp * pl.cp, used = dp * pp;
  const std::vector<Group>& groups = scratch_.groups[unit];
  const std::vector<int>& flat_gpus = scratch_.flat_gpus[unit];
  for (auto* v :
       {&pl.next_latency_s, &pl.next_s_per_byte, &pl.prev_latency_s, &pl.prev_s_per_byte}) {
    v->resize(used);
  }
  std::vector<double>& intra_latency_s = scratch_.intra_latency_s;
  std::vector<double>& intra_s_per_byte = scratch_.intra_s_per_byte;
  std::vector<double>& inter_latency_s = scratch_.inter_latency_s;
  std::vector<double>& inter_s_per_byte = scratch_.inter_s_per_byte;
  std::vector<double>& inter_GBps = scratch_.inter_GBps;
  if (!links_ready_) {
    const int nodes = topo_.num_nodes();
    for (auto* v :
         {&intra_latency_s, &intra_s_per_byte, &inter_latency_s, &inter_s_per_byte, &inter_GBps}) {
      v->resize(nodes);
    }
    for (int n = 0; n < nodes; ++n) {
      intra_latency_s[n] = nvlink_s(n, 0.0);
      intra_s_per_byte[n] = nvlink_s(n, 1.0) - intra_latency_s[n];
      inter_latency_s[n] = network_link_s(n, 0.0);
      inter_s_per_byte[n] = network_link_s(n, 1.0) - inter_latency_s[n];
      inter_GBps[n] = topo_.nodes[n].inter_GBps * c_.inter(n);
    }
    links_ready_ = true;
  }
  // The link between the first GPUs of two slots' groups: latency and seconds per byte. Across
  // nodes it runs at the slower end's bandwidth (the first node on a tie, std::min's choice).
  // It is symmetric: either way round the same node is picked, or on a tie two nodes of equal
  // bandwidth, whose figures are equal.
  // Raw pointers: see add_placements' finish.
  const Group* group_of = groups.data();
  const int* group = pl.group.data();
  const double* intra_latency = intra_latency_s.data();
  const double* intra_per_byte = intra_s_per_byte.data();
  const double* inter_latency = inter_latency_s.data();
  const double* inter_per_byte = inter_s_per_byte.data();
  const double* speed = inter_GBps.data();
  auto link = [&](int slot, int other, double& latency_s, double& s_per_byte) {
    const int na = group_of[group[slot]].first_node;
    const int nb = group_of[group[other]].first_node;
    if (na == nb) {
      latency_s = intra_latency[na];
      s_per_byte = intra_per_byte[na];
    } else {
      const int slower = speed[nb] < speed[na] ? nb : na;
      latency_s = inter_latency[slower];
      s_per_byte = inter_per_byte[slower];
    }
  };
  // Each slot's link to its successor in the (cyclic) pipeline; by symmetry, the link of a slot
  // to its predecessor is its predecessor's link to its successor.
  double* next_latency_s = pl.next_latency_s.data();
  double* next_s_per_byte = pl.next_s_per_byte.data();
  double* prev_latency_s = pl.prev_latency_s.data();
  double* prev_s_per_byte = pl.prev_s_per_byte.data();
  for (int r = 0; r < dp; ++r) {
    const int row = r * pp;
    for (int p = 0; p < pp; ++p) {
      const int next = p + 1 < pp ? p + 1 : 0;
      link(row + p, row + next, next_latency_s[row + p], next_s_per_byte[row + p]);
    }
    for (int p = 0; p < pp; ++p) {
      const int prev = p > 0 ? p - 1 : pp - 1;
      prev_latency_s[row + p] = next_latency_s[row + prev];
      prev_s_per_byte[row + p] = next_s_per_byte[row + prev];
    }
  }
  // Rank ((r * pp + p) * cp + c) * tp + t is the group's GPU c * tp + t: each slot's group's
  // GPUs, slot after slot. The default order when that is every GPU, in order.
  pl.gpus.resize(static_cast<size_t>(used) * unit);
  for (int slot = 0; slot < used; ++slot) {
    // Element by element: a group holds few GPUs, too few to pay for a call to memcpy.
    const int* from = flat_gpus.data() + group_of[group[slot]].first;
    int* to = pl.gpus.data() + static_cast<size_t>(slot) * unit;
    for (int t = 0; t < unit; ++t) to[t] = from[t];
  }
  bool identity = used * unit == topo_.num_gpus();
  for (int rank = 0; rank < used * unit && identity; ++rank) identity = pl.gpus[rank] == rank;
  if (identity) pl.gpus.clear();
  // A replica's predecessor links are its successor links rotated by one rank, so two replicas
  // whose successor links match rank by rank match in both.
  bool alike = true;
  for (int slot = pp; slot < used && alike; ++slot) {
    const int first = slot % pp;
    alike = pl.type[slot] == pl.type[first] && pl.slow[slot] == pl.slow[first] &&
            pl.slot_link[slot] == pl.slot_link[first] &&
            next_latency_s[slot] == next_latency_s[first] &&
            next_s_per_byte[slot] == next_s_per_byte[first];
  }
  pl.cost_leaders.assign(1, 0);
  for (int r = 1; r < dp && !alike; ++r) {
    bool same = pl.like_replica[r] == pl.like_replica[r - 1];
    for (int p = 0; p < pp && same; ++p) {
      const int a = r * pp + p, b = a - pp;
      same = next_latency_s[a] == next_latency_s[b] && next_s_per_byte[a] == next_s_per_byte[b];
    }
    if (!same) pl.cost_leaders.push_back(r);
  }
  pl.capacity_gib.assign(pp, kInf);
  for (int r = 0; r < dp; ++r) {
    if (pl.like_replica[r] != r) continue;  // the types of the replica it is like
    for (int p = 0; p < pp; ++p) {
      double& capacity = pl.capacity_gib[p];
      capacity = std::min(capacity, topo_.types[pl.type[r * pp + p]].memory_gib);
    }
  }
  pl.detailed = true;
  return pl;
}

}  // namespace planner_internal
}  // namespace parapilot
