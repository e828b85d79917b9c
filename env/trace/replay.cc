#include "env/trace/replay.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <limits>
#include <map>
#include <numeric>
#include <tuple>
#include <unordered_map>

#include "core/error.h"

namespace parapilot::trace {

namespace {

constexpr double kOverlapEps = 1e-4;  // s: tolerance for "started before the last compute ended"

struct Worker {
  int rank = 0;
  int dp = 0;
  int stage = 0;
  int tpi = 0;  // index of this rank among the ranks sharing (dp_rank, stage)
  std::array<std::vector<int>, kNumOpTypes> by_type;  // node ids, in recorded order
  std::vector<int> chain;                             // compute nodes in recorded order
};

std::size_t type_index(OpType t) { return static_cast<std::size_t>(t); }

}  // namespace

StatusOr<ReplayGraph> ReplayGraph::build(const OpTrace& trace) {
  return catch_input_error([&] { return build_or_throw(trace); });
}

// Builds a ReplayGraph: the trace, the graph so far, and the state the phases share. build()
// indexes the steps and places the ranks, then adds each step's nodes, dependencies, collective
// groups, measured durations and topological order, and finally lays the dependencies out.
struct ReplayGraph::Builder {
  explicit Builder(const OpTrace& t)
      : trace(t),
        ops(t.ops),
        pp(std::max(1, t.meta.pp_size)),
        vpp(std::max(1, t.meta.vpp_size)),
        dp(std::max(1, t.meta.dp_size)),
        world(std::max(t.meta.world_size, 1)) {}

  ReplayGraph build() {
    index_steps();
    place_ranks();
    g.recorded_step_s_.assign(steps.size(), 0.0);
    for (std::size_t si = 0; si < steps.size(); ++si) {
      base = g.num_nodes();
      workers.clear();
      groups.clear();
      group_of.clear();
      edges_before = edges.size();
      add_nodes(si);
      for (Worker& w : workers) add_worker_deps(w);
      pair_pipeline_ops();
      group_collectives();
      measure_durations();
      order_step(si);
      for (const Worker& w : workers) {
        worker_of_rank[static_cast<std::size_t>(w.rank)] = -1;
        worker_at[static_cast<std::size_t>(slot_of(w.dp, w.stage, w.tpi))] = -1;
      }
    }
    link_deps();
    return std::move(g);
  }

  // Steps, and the records of each step (by_step[step_count[si] .. step_count[si + 1])).
  void index_steps() {
    steps.reserve(ops.size() / 16 + 1);
    for (const OpRecord& r : ops) steps.push_back(r.step);
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    g.steps_ = steps;
    std::vector<int> record_step(ops.size());
    step_count.assign(steps.size() + 1, 0);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      record_step[i] = static_cast<int>(std::lower_bound(steps.begin(), steps.end(), ops[i].step) -
                                        steps.begin());
      ++step_count[static_cast<std::size_t>(record_step[i]) + 1];
    }
    std::partial_sum(step_count.begin(), step_count.end(), step_count.begin());
    by_step.resize(ops.size());
    std::vector<int> fill(step_count.begin(), step_count.end() - 1);
    for (std::size_t i = 0; i < ops.size(); ++i)
      by_step[static_cast<std::size_t>(fill[static_cast<std::size_t>(record_step[i])]++)] =
          static_cast<int>(i);
  }

  // Position of each rank: (dp_rank, stage) of its first record, and its index among the ranks
  // that share them (tensor- or sequence-parallel peers).
  void place_ranks() {
    rank_dp.assign(static_cast<std::size_t>(world), -1);
    rank_stage = rank_dp;
    rank_tpi = rank_dp;
    for (const OpRecord& r : ops) {
      if (rank_dp[static_cast<std::size_t>(r.rank)] < 0) {
        rank_dp[static_cast<std::size_t>(r.rank)] = r.dp_rank;
        rank_stage[static_cast<std::size_t>(r.rank)] = r.stage;
      }
    }
    std::map<std::pair<int, int>, int> seen;
    for (int rank = 0; rank < world; ++rank) {
      if (rank_dp[static_cast<std::size_t>(rank)] < 0) continue;
      const int t = seen[{rank_dp[static_cast<std::size_t>(rank)],
                          rank_stage[static_cast<std::size_t>(rank)]}]++;
      rank_tpi[static_cast<std::size_t>(rank)] = t;
      max_tpi = std::max(max_tpi, t + 1);
    }
    worker_at.assign(static_cast<std::size_t>(dp * pp * max_tpi), -1);
    worker_of_rank.assign(static_cast<std::size_t>(world), -1);
  }

  // One node per record of step si but kOther, in (rank, type, start, seq_id) order, listed
  // by type under its rank's worker; also the step's recorded length.
  void add_nodes(std::size_t si) {
    double first_start = std::numeric_limits<double>::infinity();
    double last_end = -std::numeric_limits<double>::infinity();
    std::vector<int> recs(by_step.begin() + step_count[si], by_step.begin() + step_count[si + 1]);
    for (int i : recs) {
      first_start = std::min(first_start, ops[static_cast<std::size_t>(i)].start_s);
      last_end = std::max(last_end, ops[static_cast<std::size_t>(i)].end_s());
    }
    g.recorded_step_s_[si] = last_end - first_start;
    std::sort(recs.begin(), recs.end(), [&](int a, int b) {
      const OpRecord& x = ops[static_cast<std::size_t>(a)];
      const OpRecord& y = ops[static_cast<std::size_t>(b)];
      return std::tie(x.rank, x.type, x.start_s, x.seq_id) <
             std::tie(y.rank, y.type, y.start_s, y.seq_id);
    });
    for (int i : recs) {
      const OpRecord& r = ops[static_cast<std::size_t>(i)];
      if (r.type == OpType::kOther) continue;
      int& w = worker_of_rank[static_cast<std::size_t>(r.rank)];
      if (w < 0) {
        w = static_cast<int>(workers.size());
        Worker wk;
        wk.rank = r.rank;
        wk.dp = rank_dp[static_cast<std::size_t>(r.rank)];
        wk.stage = rank_stage[static_cast<std::size_t>(r.rank)];
        wk.tpi = rank_tpi[static_cast<std::size_t>(r.rank)];
        workers.push_back(std::move(wk));
        worker_at[static_cast<std::size_t>(
            slot_of(workers.back().dp, workers.back().stage, workers.back().tpi))] = w;
      }
      const int node = g.num_nodes();
      g.record_.push_back(i);
      g.step_index_.push_back(static_cast<int>(si));
      group_of.push_back(-1);
      workers[static_cast<std::size_t>(w)].by_type[type_index(r.type)].push_back(node);
    }
  }

  // Dependencies among one worker's ops: its computes in order, parameter all-gathers before
  // their chunk's first forward, pipeline transfers around their computes, and what runs after
  // the last compute.
  void add_worker_deps(Worker& w) {
    const auto& fwd = w.by_type[type_index(OpType::kForwardCompute)];
    const auto& bwd = w.by_type[type_index(OpType::kBackwardCompute)];
    std::merge(fwd.begin(), fwd.end(), bwd.begin(), bwd.end(), std::back_inserter(w.chain),
               [&](int a, int b) {
                 return std::tie(rec(a).start_s, rec(a).seq_id, rec(a).type) <
                        std::tie(rec(b).start_s, rec(b).seq_id, rec(b).type);
               });
    chain(w.chain);

    // Parameter all-gathers run in order; the first forward of their model chunk waits.
    const auto& ag = w.by_type[type_index(OpType::kParamsAllGather)];
    chain(ag);
    for (int a : ag) {
      int target = w.chain.empty() ? -1 : w.chain.front();
      for (int f : fwd)
        if (rec(a).mc >= 0 && rec(f).mc == rec(a).mc) {
          target = f;
          break;
        }
      if (target >= 0) dep(a, target);
    }

    add_pipeline_deps(w);
    add_after_compute_deps(w);
  }

  // Pipeline sends and receives: each stream in order, matched to computes by position.
  void add_pipeline_deps(const Worker& w) {
    const auto& fwd = w.by_type[type_index(OpType::kForwardCompute)];
    const auto& bwd = w.by_type[type_index(OpType::kBackwardCompute)];
    std::unordered_map<int, int> chain_pos;
    for (std::size_t k = 0; k < w.chain.size(); ++k) chain_pos[w.chain[k]] = static_cast<int>(k);
    auto match = [](std::size_t n_comm, std::size_t n_comp, bool recv) -> int {
      if (n_comm == n_comp) return 0;
      if (n_comm + 1 == n_comp) return recv ? 1 : 0;
      return -1;
    };
    for (const bool forward : {true, false}) {
      const auto& comp = forward ? fwd : bwd;
      const auto& send =
          w.by_type[type_index(forward ? OpType::kForwardSend : OpType::kBackwardSend)];
      const auto& recv =
          w.by_type[type_index(forward ? OpType::kForwardRecv : OpType::kBackwardRecv)];
      chain(send);
      chain(recv);
      if (const int off = match(send.size(), comp.size(), false); off >= 0)
        for (std::size_t k = 0; k < send.size(); ++k)
          dep(comp[k + static_cast<std::size_t>(off)], send[k]);
      if (const int off = match(recv.size(), comp.size(), true); off >= 0) {
        for (std::size_t k = 0; k < recv.size(); ++k) {
          const std::size_t c = k + static_cast<std::size_t>(off);
          dep(recv[k], comp[c]);
          if (c >= 1) {
            dep(comp[c - 1], recv[k]);
          } else if (!forward) {
            // The first backward receive is posted during the last warm-up forwards.
            const int pos = chain_pos[comp[0]];
            if (pos >= 2) dep(w.chain[static_cast<std::size_t>(pos - 2)], recv[k]);
          }
        }
      }
    }
  }

  // After the last compute: gc, layernorm, embedding, gradient reduce-scatter, clip, optimizer.
  void add_after_compute_deps(const Worker& w) {
    const auto& bwd = w.by_type[type_index(OpType::kBackwardCompute)];
    const int last_compute = w.chain.empty() ? -1 : w.chain.back();
    const double last_compute_end = last_compute >= 0 ? rec(last_compute).end_s() : -1e300;
    std::vector<int> overlapped;  // reduce-scatters that ran during the backward passes
    std::vector<int> post;
    for (const OpType t :
         {OpType::kGc, OpType::kLayernormGradsAllReduce, OpType::kEmbeddingGradsAllReduce,
          OpType::kGradsReduceScatter, OpType::kSeparateGradsAllReduce,
          OpType::kOptimizerClipMainGrad, OpType::kOptimizer}) {
      if (t == OpType::kSeparateGradsAllReduce || t == OpType::kOptimizerClipMainGrad ||
          t == OpType::kOptimizer) {
        if (!overlapped.empty() && overlapped.back() >= 0 && !w.by_type[type_index(t)].empty()) {
          dep(overlapped.back(), w.by_type[type_index(t)].front());
          overlapped.push_back(-1);  // attach only once
        }
      }
      for (int n : w.by_type[type_index(t)]) {
        if (t == OpType::kGradsReduceScatter && rec(n).start_s < last_compute_end - kOverlapEps) {
          int after = -1;
          for (int b : bwd)
            if (rec(b).end_s() <= rec(n).start_s + kOverlapEps) after = b;
          if (after >= 0) dep(after, n);
          if (!overlapped.empty() && overlapped.back() >= 0) dep(overlapped.back(), n);
          overlapped.push_back(n);
          continue;
        }
        post.push_back(n);
      }
    }
    if (last_compute >= 0 && !post.empty()) dep(last_compute, post.front());
    chain(post);
  }

  // Each pipeline send and the matching receive of the peer stage form a group.
  void pair_pipeline_ops() {
    for (const Worker& w : workers) {
      for (const bool forward : {true, false}) {
        const OpType send_t = forward ? OpType::kForwardSend : OpType::kBackwardSend;
        const OpType recv_t = forward ? OpType::kForwardRecv : OpType::kBackwardRecv;
        int peer_stage = w.stage + (forward ? 1 : -1);
        if (vpp > 1) peer_stage = (peer_stage + pp) % pp;
        const auto& send = w.by_type[type_index(send_t)];
        for (std::size_t k = 0; k < send.size(); ++k) {
          const int peer = worker_node(w.dp, peer_stage, w.tpi, recv_t, k);
          if (peer >= 0 && group_of[static_cast<std::size_t>(peer - base)] < 0)
            new_group({send[k], peer});
        }
      }
    }
  }

  // The k-th collective of a kind joins the group of its peers' k-th; unpaired pipeline ops
  // (first/last stage no-ops) are their own group.
  void group_collectives() {
    std::map<std::tuple<int, int, int, int, std::size_t>, int> collective;
    for (const Worker& w : workers) {
      for (const OpType t :
           {OpType::kParamsAllGather, OpType::kGradsReduceScatter, OpType::kSeparateGradsAllReduce,
            OpType::kEmbeddingGradsAllReduce, OpType::kOptimizerClipMainGrad}) {
        const auto& list = w.by_type[type_index(t)];
        for (std::size_t k = 0; k < list.size(); ++k) {
          std::tuple<int, int, int, int, std::size_t> key;
          if (t == OpType::kEmbeddingGradsAllReduce)
            key = {static_cast<int>(t), -1, w.dp, w.tpi, k};
          else if (t == OpType::kOptimizerClipMainGrad)
            key = {static_cast<int>(t), -1, -1, -1, k};
          else
            key = {static_cast<int>(t), w.stage, -1, -1, k};
          auto [it, inserted] = collective.try_emplace(key, static_cast<int>(groups.size()));
          if (inserted) groups.emplace_back();
          groups[static_cast<std::size_t>(it->second)].push_back(list[k]);
          group_of[static_cast<std::size_t>(list[k] - base)] = it->second;
        }
      }
      for (const OpType t : {OpType::kForwardSend, OpType::kForwardRecv, OpType::kBackwardSend,
                             OpType::kBackwardRecv})
        for (int n : w.by_type[type_index(t)])
          if (group_of[static_cast<std::size_t>(n - base)] < 0) new_group({n});
    }
  }

  // Measured durations: local ops their duration; collective members their transfer time.
  void measure_durations() {
    g.group_size_.resize(static_cast<std::size_t>(g.num_nodes()), 0);
    g.measured_.resize(static_cast<std::size_t>(g.num_nodes()), 0.0);
    for (int v = base; v < g.num_nodes(); ++v)
      g.measured_[static_cast<std::size_t>(v)] = rec(v).duration_s;
    for (const auto& members : groups) {
      double latest_start = -std::numeric_limits<double>::infinity();
      for (int m : members) latest_start = std::max(latest_start, rec(m).start_s);
      for (int m : members) {
        g.group_size_[static_cast<std::size_t>(m)] = static_cast<int>(members.size());
        g.measured_[static_cast<std::size_t>(m)] = std::max(0.0, rec(m).end_s() - latest_start);
      }
    }
  }

  // Topological order of step si's super nodes (a group is one super node). Throws
  // InputError when its dependencies hold a cycle.
  void order_step(std::size_t si) {
    const int n_step = g.num_nodes() - base;
    const int n_groups = static_cast<int>(groups.size());
    auto super_of = [&](int node) {
      const int gid = group_of[static_cast<std::size_t>(node - base)];
      return gid >= 0 ? gid : n_groups + (node - base);
    };
    const int n_super = n_groups + n_step;
    std::vector<int> indegree(static_cast<std::size_t>(n_super), 0);
    std::vector<std::vector<int>> next(static_cast<std::size_t>(n_super));
    for (std::size_t e = edges_before; e < edges.size(); ++e) {
      const int a = super_of(edges[e].first), b = super_of(edges[e].second);
      if (a == b) continue;
      next[static_cast<std::size_t>(a)].push_back(b);
      ++indegree[static_cast<std::size_t>(b)];
    }
    std::vector<int> queue;
    for (int s = 0; s < n_super; ++s) {
      const bool empty_slot =
          s >= n_groups && group_of[static_cast<std::size_t>(s - n_groups)] >= 0;
      if (!empty_slot && indegree[static_cast<std::size_t>(s)] == 0) queue.push_back(s);
    }
    int processed = 0;
    for (std::size_t qi = 0; qi < queue.size(); ++qi) {
      const int s = queue[qi];
      ++processed;
      if (s < n_groups) {
        for (int m : groups[static_cast<std::size_t>(s)]) g.order_nodes_.push_back(m);
      } else {
        g.order_nodes_.push_back(base + s - n_groups);
      }
      g.order_offset_.push_back(static_cast<int>(g.order_nodes_.size()));
      for (int t : next[static_cast<std::size_t>(s)])
        if (--indegree[static_cast<std::size_t>(t)] == 0) queue.push_back(t);
    }
    int expected = n_groups;
    for (int v = 0; v < n_step; ++v) expected += group_of[static_cast<std::size_t>(v)] < 0 ? 1 : 0;
    if (processed != expected)
      throw InputError(trace.source + ": step " + std::to_string(steps[si]) +
                       ": the ops cannot be ordered (dependency cycle); is the step complete and "
                       "does it follow a supported pipeline schedule?");
  }

  // Dependencies in CSR form, by target node.
  void link_deps() {
    const std::size_t n = static_cast<std::size_t>(g.num_nodes());
    g.dep_offset_.assign(n + 1, 0);
    for (const auto& [from, to] : edges) ++g.dep_offset_[static_cast<std::size_t>(to) + 1];
    std::partial_sum(g.dep_offset_.begin(), g.dep_offset_.end(), g.dep_offset_.begin());
    g.deps_.resize(edges.size());
    std::vector<int> fill(g.dep_offset_.begin(), g.dep_offset_.end() - 1);
    for (const auto& [from, to] : edges)
      g.deps_[static_cast<std::size_t>(fill[static_cast<std::size_t>(to)]++)] = from;
    g.order_offset_.insert(g.order_offset_.begin(), 0);
  }

  const OpRecord& rec(int node) const {
    return ops[static_cast<std::size_t>(g.record_[static_cast<std::size_t>(node)])];
  }
  void dep(int from, int to) { edges.emplace_back(from, to); }
  int new_group(std::initializer_list<int> members) {
    const int id = static_cast<int>(groups.size());
    groups.emplace_back(members);
    for (int m : members) group_of[static_cast<std::size_t>(m - base)] = id;
    return id;
  }
  void chain(const std::vector<int>& nodes) {
    for (std::size_t k = 1; k < nodes.size(); ++k) dep(nodes[k - 1], nodes[k]);
  }
  int slot_of(int d, int s, int t) const { return (d * pp + s) * max_tpi + t; }
  // The k-th node of `type` of the worker at (d, s, t) in this step, or -1.
  int worker_node(int d, int s, int t, OpType type, std::size_t k) const {
    if (d < 0 || s < 0 || s >= pp || d >= dp) return -1;
    const int w = worker_at[static_cast<std::size_t>(slot_of(d, s, t))];
    if (w < 0) return -1;
    const auto& list = workers[static_cast<std::size_t>(w)].by_type[type_index(type)];
    return k < list.size() ? list[k] : -1;
  }

  const OpTrace& trace;
  const std::vector<OpRecord>& ops;
  const int pp;
  const int vpp;
  const int dp;
  const int world;
  ReplayGraph g;
  std::vector<std::int64_t> steps;
  std::vector<int> step_count;  // prefix sums: step si's records start at step_count[si]
  std::vector<int> by_step;     // record indices, grouped by step
  std::vector<int> rank_dp, rank_stage, rank_tpi;
  int max_tpi = 1;
  std::vector<int> worker_at;       // per (dp, stage, tpi) slot: the worker in this step, or -1
  std::vector<int> worker_of_rank;  // per rank: its worker in this step, or -1
  std::vector<std::pair<int, int>> edges;  // (from node, to node)
  std::vector<int> group_of;               // per node of the step: group id or -1
  std::vector<std::vector<int>> groups;
  std::vector<Worker> workers;
  int base = 0;                  // the step's first node
  std::size_t edges_before = 0;  // the step's first edge
};

ReplayGraph ReplayGraph::build_or_throw(const OpTrace& trace) { return Builder(trace).build(); }

std::vector<double> ReplayGraph::replay(const std::vector<double>& duration_s) const {
  std::vector<double> start, end;
  return replay(duration_s, start, end);
}

std::vector<double> ReplayGraph::replay(const std::vector<double>& duration_s,
                                        std::vector<double>& start_s,
                                        std::vector<double>& end_s) const {
  const std::size_t n = record_.size();
  start_s.assign(n, 0.0);
  end_s.assign(n, 0.0);
  std::vector<double> step_time(steps_.size(), 0.0);
  auto ready = [&](int v) {
    double t = 0;
    for (int k = dep_offset_[static_cast<std::size_t>(v)];
         k < dep_offset_[static_cast<std::size_t>(v) + 1]; ++k)
      t = std::max(t, end_s[static_cast<std::size_t>(deps_[static_cast<std::size_t>(k)])]);
    return t;
  };
  for (std::size_t s = 0; s + 1 < order_offset_.size(); ++s) {
    const int first = order_offset_[s], last = order_offset_[s + 1];
    double group_start = 0;
    for (int k = first; k < last; ++k) {
      const auto v = static_cast<std::size_t>(order_nodes_[static_cast<std::size_t>(k)]);
      start_s[v] = ready(static_cast<int>(v));
      group_start = std::max(group_start, start_s[v]);
    }
    for (int k = first; k < last; ++k) {
      const auto v = static_cast<std::size_t>(order_nodes_[static_cast<std::size_t>(k)]);
      end_s[v] = group_start + duration_s[v];
      double& st = step_time[static_cast<std::size_t>(step_index_[v])];
      st = std::max(st, end_s[v]);
    }
  }
  return step_time;
}

OpTrace synthesize_op_trace(const SyntheticJob& job) {
  const int dp = job.meta.dp_size, pp = job.meta.pp_size, m = job.microbatches;
  OpTrace skeleton;
  skeleton.meta = job.meta;
  skeleton.meta.tp_size = skeleton.meta.dsp_size = skeleton.meta.vpp_size = 1;
  skeleton.meta.world_size = dp * pp;
  // Records in schedule order; start_s holds the position so that the graph sees the order,
  // duration_s holds the duration (or transfer time) to replay.
  for (int step = 0; step < job.steps; ++step) {
    for (int stage = 0; stage < pp; ++stage) {
      for (int d = 0; d < dp; ++d) {
        std::array<int, kNumOpTypes> seq{};
        double position = 0;
        auto add = [&](OpType t, double seconds, int mb) {
          OpRecord r;
          r.step = job.first_step + step;
          r.dp_rank = d;
          r.stage = stage;
          r.rank = stage * dp + d;
          r.type = t;
          r.seq_id = seq[type_index(t)]++;
          r.mb_id = mb;
          r.mc = is_compute(t) ? 0 : -1;
          r.gmc = is_compute(t) ? stage : -1;
          r.start_s = position;
          position += 1e4;
          r.duration_s = seconds;
          skeleton.ops.push_back(r);
        };
        auto forward = [&](int mb) {
          if (stage > 0) add(OpType::kForwardRecv, job.p2p_s, -1);
          add(OpType::kForwardCompute, job.forward_s(step, d, stage, mb), mb);
          if (stage + 1 < pp) add(OpType::kForwardSend, job.p2p_s, -1);
        };
        auto backward = [&](int mb) {
          if (stage + 1 < pp) add(OpType::kBackwardRecv, job.p2p_s, -1);
          add(OpType::kBackwardCompute, job.backward_s(step, d, stage, mb), mb);
          if (stage > 0) add(OpType::kBackwardSend, job.p2p_s, -1);
        };
        if (dp > 1) add(OpType::kParamsAllGather, job.params_all_gather_s, -1);
        const int warmup = std::min(pp - stage - 1, m);
        for (int mb = 0; mb < warmup; ++mb) forward(mb);
        for (int i = 0; i < m - warmup; ++i) {
          forward(warmup + i);
          backward(i);
        }
        for (int mb = m - warmup; mb < m; ++mb) backward(mb);
        add(OpType::kGc, 0.0, 0);
        add(OpType::kLayernormGradsAllReduce, 0.0, -1);
        if (stage == 0 || stage == pp - 1)
          add(OpType::kEmbeddingGradsAllReduce, job.embedding_all_reduce_s, -1);
        if (dp > 1) add(OpType::kGradsReduceScatter, job.grads_reduce_scatter_s, -1);
        add(OpType::kOptimizerClipMainGrad, job.clip_s, -1);
        add(OpType::kOptimizer, job.optimizer_s, -1);
      }
    }
  }
  // A schedule laid out here is complete and ordered by construction.
  const StatusOr<ReplayGraph> built = ReplayGraph::build(skeleton);
  assert(built.ok());
  const ReplayGraph& graph = *built;
  std::vector<double> durations(static_cast<std::size_t>(graph.num_nodes()));
  for (int v = 0; v < graph.num_nodes(); ++v)
    durations[static_cast<std::size_t>(v)] =
        skeleton.ops[static_cast<std::size_t>(graph.record(v))].duration_s;
  std::vector<double> start, end;
  const std::vector<double> step_time = graph.replay(durations, start, end);
  std::vector<double> step_offset(step_time.size(), 0.0);
  for (std::size_t s = 1; s < step_time.size(); ++s)
    step_offset[s] = step_offset[s - 1] + step_time[s - 1] + job.step_gap_s;
  OpTrace out = skeleton;
  for (int v = 0; v < graph.num_nodes(); ++v) {
    OpRecord& r = out.ops[static_cast<std::size_t>(graph.record(v))];
    const double offset = step_offset[static_cast<std::size_t>(graph.step_index(v))];
    r.start_s = offset + start[static_cast<std::size_t>(v)];
    r.duration_s = end[static_cast<std::size_t>(v)] - start[static_cast<std::size_t>(v)];
  }
  return out;
}

}  // namespace parapilot::trace
