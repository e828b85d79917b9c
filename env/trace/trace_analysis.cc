#include "env/trace/trace_analysis.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

#include "env/trace/replay.h"

namespace parapilot::trace {

namespace {

constexpr double kNoSlowdown = 1.02;  // below this the job runs at its ideal speed
constexpr double kWorkerRatio = 1.2;  // a straggler computes at least this much over its stage
constexpr double kStageRatio = 1.05;  // an imbalanced stage computes this much over the median

double mean(const std::vector<double>& v) {
  return v.empty() ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const std::size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  double m = v[mid];
  if (v.size() % 2 == 0) {
    m = (m + *std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid))) / 2;
  }
  return m;
}

// The lower quartile (nearest rank): the minimum for up to four values.
double lower_quartile(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 4];
}

std::size_t ti(OpType t) { return static_cast<std::size_t>(t); }

// "forward-pp-comm" for forward sends and receives, likewise backward; else the op type.
std::string optype_group(OpType t) {
  if (t == OpType::kForwardSend || t == OpType::kForwardRecv) return "forward-pp-comm";
  if (t == OpType::kBackwardSend || t == OpType::kBackwardRecv) return "backward-pp-comm";
  return op_type_name(t);
}

double pipeline_time(const std::vector<double>& stage_s, int microbatches) {
  if (stage_s.empty()) return 0;
  const double worst = *std::max_element(stage_s.begin(), stage_s.end());
  return (microbatches - 1) * worst + std::accumulate(stage_s.begin(), stage_s.end(), 0.0);
}

// Contiguous split of `cost` into `parts` non-empty pieces minimising the largest piece
// (exact dynamic program, O(parts * n^2)). Returns the piece sizes.
std::vector<int> balanced_split(const std::vector<double>& cost, int parts) {
  const int n = static_cast<int>(cost.size());
  std::vector<double> prefix(cost.size() + 1, 0.0);
  for (int i = 0; i < n; ++i)
    prefix[static_cast<std::size_t>(i) + 1] =
        prefix[static_cast<std::size_t>(i)] + cost[static_cast<std::size_t>(i)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[p][i]: minimal max piece splitting the first i units into p pieces.
  std::vector<std::vector<double>> best(static_cast<std::size_t>(parts) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> cut(best.size(),
                                    std::vector<int>(static_cast<std::size_t>(n) + 1, 0));
  best[0][0] = 0;
  for (int p = 1; p <= parts; ++p)
    for (int i = p; i <= n; ++i)
      for (int j = p - 1; j < i; ++j) {
        const double v =
            std::max(best[static_cast<std::size_t>(p) - 1][static_cast<std::size_t>(j)],
                     prefix[static_cast<std::size_t>(i)] - prefix[static_cast<std::size_t>(j)]);
        if (v < best[static_cast<std::size_t>(p)][static_cast<std::size_t>(i)] - 1e-15) {
          best[static_cast<std::size_t>(p)][static_cast<std::size_t>(i)] = v;
          cut[static_cast<std::size_t>(p)][static_cast<std::size_t>(i)] = j;
        }
      }
  std::vector<int> sizes(static_cast<std::size_t>(parts));
  int i = n;
  for (int p = parts; p >= 1; --p) {
    const int j = cut[static_cast<std::size_t>(p)][static_cast<std::size_t>(i)];
    sizes[static_cast<std::size_t>(p) - 1] = i - j;
    i = j;
  }
  return sizes;
}

// A number with `digits` decimals.
std::string num(double v, int digits = 3) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// "a,b,c"
std::string join(const std::vector<int>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s.push_back(',');
    s.append(std::to_string(v[i]));
  }
  return s;
}

// Per-worker statistics of the compute ops.
struct WorkerStats {
  int rank = 0, dp = 0, stage = 0;
  std::array<double, 2> sum{};  // forward, backward seconds over all steps
  std::array<int, 2> count{};
  double mean(int k) const {
    return count[static_cast<std::size_t>(k)]
               ? sum[static_cast<std::size_t>(k)] / count[static_cast<std::size_t>(k)]
               : 0.0;
  }
};

struct ComputeModel {
  std::vector<WorkerStats> workers;                  // indexed by rank; count 0 = absent
  std::vector<std::array<double, 2>> stage_typical;  // per stage: forward, backward per op
  int vpp = 1;
  // Forward + backward of one microbatch on one stage (all its model chunks).
  double stage_microbatch_s(int s) const {
    return vpp * (stage_typical[static_cast<std::size_t>(s)][0] +
                  stage_typical[static_cast<std::size_t>(s)][1]);
  }
  double worker_microbatch_s(int rank) const {
    const WorkerStats& w = workers[static_cast<std::size_t>(rank)];
    return vpp * (w.mean(0) + w.mean(1));
  }
};

ComputeModel compute_model(const OpTrace& trace) {
  ComputeModel cm;
  cm.vpp = std::max(1, trace.meta.vpp_size);
  cm.workers.resize(static_cast<std::size_t>(std::max(1, trace.meta.world_size)));
  for (const OpRecord& r : trace.ops) {
    if (!is_compute(r.type)) continue;
    WorkerStats& w = cm.workers[static_cast<std::size_t>(r.rank)];
    const std::size_t k = r.type == OpType::kForwardCompute ? 0 : 1;
    w.rank = r.rank;
    w.dp = r.dp_rank;
    w.stage = r.stage;
    w.sum[k] += r.duration_s;
    ++w.count[k];
  }
  const int pp = trace.meta.pp_size;
  cm.stage_typical.assign(static_cast<std::size_t>(pp), {0.0, 0.0});
  for (int s = 0; s < pp; ++s)
    for (int k = 0; k < 2; ++k) {
      std::vector<double> means;
      for (const WorkerStats& w : cm.workers)
        if (w.stage == s && w.count[static_cast<std::size_t>(k)] > 0) means.push_back(w.mean(k));
      cm.stage_typical[static_cast<std::size_t>(s)][static_cast<std::size_t>(k)] =
          lower_quartile(means);
    }
  return cm;
}

// Typical durations: the mean per op type for computation (and gc, optimizer), the median of
// the transfer time per op type for communication. Returns every node's typical duration and
// sets the measured and ideal step times and the slowdown between them.
std::vector<double> replay_typical(const OpTrace& trace, const ReplayGraph& graph,
                                   TraceAnalysis& a) {
  const int n = graph.num_nodes();
  const std::vector<double>& measured = graph.measured();
  std::vector<std::vector<double>> pool(kNumOpTypes);
  for (int v = 0; v < n; ++v)
    pool[ti(trace.ops[static_cast<std::size_t>(graph.record(v))].type)].push_back(
        measured[static_cast<std::size_t>(v)]);
  std::vector<double> typical(kNumOpTypes, 0.0);
  for (int t = 0; t < kNumOpTypes; ++t)
    typical[static_cast<std::size_t>(t)] = is_communication(static_cast<OpType>(t))
                                               ? median(pool[static_cast<std::size_t>(t)])
                                               : mean(pool[static_cast<std::size_t>(t)]);
  std::vector<double> ideal(static_cast<std::size_t>(n));
  for (int v = 0; v < n; ++v)
    ideal[static_cast<std::size_t>(v)] =
        typical[ti(trace.ops[static_cast<std::size_t>(graph.record(v))].type)];

  a.measured_step_s = mean(graph.replay(measured));
  a.ideal_step_s = mean(graph.replay(ideal));
  a.slowdown = a.ideal_step_s > 0 ? a.measured_step_s / a.ideal_step_s : 1.0;
  return ideal;
}

// What-if attribution: ideal everywhere except the group (a stage, a replica, a rank, an op
// type group), which keeps its measured durations.
void attribute_slowdowns(const OpTrace& trace, const ReplayGraph& graph,
                         const std::vector<double>& ideal, TraceAnalysis& a) {
  const int n = graph.num_nodes();
  const std::vector<double>& measured = graph.measured();
  auto rec = [&](int v) -> const OpRecord& {
    return trace.ops[static_cast<std::size_t>(graph.record(v))];
  };
  auto attribute = [&](auto key_of, auto& out) {
    using Key = typename std::decay_t<decltype(out)>::key_type;
    std::map<Key, std::vector<int>> members;
    for (int v = 0; v < n; ++v) members[key_of(rec(v))].push_back(v);
    std::vector<double> d = ideal;
    for (const auto& [key, nodes] : members) {
      for (int v : nodes) d[static_cast<std::size_t>(v)] = measured[static_cast<std::size_t>(v)];
      out[key] = a.ideal_step_s > 0 ? mean(graph.replay(d)) / a.ideal_step_s : 1.0;
      for (int v : nodes) d[static_cast<std::size_t>(v)] = ideal[static_cast<std::size_t>(v)];
    }
  };
  attribute([](const OpRecord& r) { return static_cast<int>(r.stage); }, a.stage_slowdown);
  attribute([](const OpRecord& r) { return static_cast<int>(r.dp_rank); }, a.dp_rank_slowdown);
  attribute([](const OpRecord& r) { return static_cast<int>(r.rank); }, a.rank_slowdown);
  attribute([](const OpRecord& r) { return optype_group(r.type); }, a.optype_slowdown);
}

// Replays with each compute op at its stage's typical duration (A), then at its worker's mean
// (B): ideal -> A is the partitioning, A -> B the workers, B -> measured the rest. Also each
// stage's compute per microbatch and the microbatches per step.
void split_factors(const OpTrace& trace, const ReplayGraph& graph, const ComputeModel& cm,
                   const std::vector<double>& ideal, TraceAnalysis& a) {
  const int n = graph.num_nodes();
  std::vector<double> stage_level = ideal, worker_level = ideal;
  for (int v = 0; v < n; ++v) {
    const OpRecord& r = trace.ops[static_cast<std::size_t>(graph.record(v))];
    if (!is_compute(r.type)) continue;
    const int k = r.type == OpType::kForwardCompute ? 0 : 1;
    stage_level[static_cast<std::size_t>(v)] =
        cm.stage_typical[static_cast<std::size_t>(r.stage)][static_cast<std::size_t>(k)];
    worker_level[static_cast<std::size_t>(v)] =
        cm.workers[static_cast<std::size_t>(r.rank)].mean(k);
  }
  const double t_stage = mean(graph.replay(stage_level));
  const double t_worker = mean(graph.replay(worker_level));
  if (a.ideal_step_s > 0 && t_stage > 0 && t_worker > 0) {
    a.stage_factor = t_stage / a.ideal_step_s;
    a.worker_factor = t_worker / t_stage;
    a.diffuse_factor = a.measured_step_s / t_worker;
  }
  const int pp = trace.meta.pp_size;
  for (int s = 0; s < pp; ++s) a.stage_compute_s.push_back(cm.stage_microbatch_s(s));
  std::vector<int> fwd_per_worker;
  std::map<std::pair<std::int64_t, int>, int> count;
  for (const OpRecord& r : trace.ops)
    if (r.type == OpType::kForwardCompute) ++count[{r.step, r.rank}];
  for (const auto& [key, c] : count) fwd_per_worker.push_back(c);
  std::vector<double> as_double(fwd_per_worker.begin(), fwd_per_worker.end());
  a.microbatches = std::max(1, static_cast<int>(std::lround(median(as_double))) / cm.vpp);
}

// Cause and stragglers. The largest factor names the cause, provided it is borne out by the
// ranks: a worker cause needs a few ranks (at most one position in eight) computing clearly
// slower than their stage and mattering on their own; a stage cause needs a stage computing
// more per microbatch than the median stage and mattering on its own. Otherwise the next factor
// is tried; diffuse needs no such evidence.
void find_cause(const ComputeModel& cm, TraceAnalysis& a) {
  const double bar = 1 + std::max(0.01, 0.3 * (a.slowdown - 1));
  const std::vector<double>& stage_s = a.stage_compute_s;
  const double stage_median = median(stage_s);
  std::vector<Straggler> by_worker, by_stage;
  for (const auto& [rank, slowdown] : a.rank_slowdown) {
    const WorkerStats& w = cm.workers[static_cast<std::size_t>(rank)];
    if (w.count[0] + w.count[1] == 0) continue;
    const double stage_typ = cm.stage_microbatch_s(w.stage);
    const double ratio = stage_typ > 0 ? cm.worker_microbatch_s(rank) / stage_typ : 1.0;
    const Straggler s{rank, w.dp, w.stage, slowdown, ratio};
    if (slowdown >= bar && ratio >= kWorkerRatio) by_worker.push_back(s);
    if (a.stage_slowdown[w.stage] >= bar && stage_median > 0 &&
        stage_s[static_cast<std::size_t>(w.stage)] / stage_median >= kStageRatio)
      by_stage.push_back(s);
  }
  // Ranks that share a (dp_rank, stage) (tensor-parallel peers) slow down together: count
  // positions, and allow at most one in eight of them.
  std::vector<std::pair<int, int>> positions, all_positions;
  for (const Straggler& s : by_worker) positions.emplace_back(s.dp_rank, s.stage);
  for (const WorkerStats& w : cm.workers)
    if (w.count[0] + w.count[1] > 0) all_positions.emplace_back(w.dp, w.stage);
  for (auto* v : {&positions, &all_positions}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  const bool worker_evident =
      !positions.empty() &&
      static_cast<int>(positions.size()) <= std::max(1, static_cast<int>(all_positions.size()) / 8);
  const bool stage_evident = !by_stage.empty();
  std::vector<std::pair<double, std::string>> ranked = {{a.stage_factor, "stage-imbalance"},
                                                        {a.worker_factor, "worker"},
                                                        {a.diffuse_factor, "diffuse"}};
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  a.cause = "diffuse";
  for (const auto& [factor, cause] : ranked) {
    if ((cause == "worker" && worker_evident) || (cause == "stage-imbalance" && stage_evident) ||
        cause == "diffuse") {
      a.cause = cause;
      break;
    }
  }
  if (a.slowdown < kNoSlowdown) a.cause = "none";
  if (a.cause == "worker") a.stragglers = by_worker;
  if (a.cause == "stage-imbalance") a.stragglers = by_stage;
  std::sort(a.stragglers.begin(), a.stragglers.end(),
            [](const Straggler& x, const Straggler& y) { return x.slowdown > y.slowdown; });
}

// Remedy: move stage boundaries so that each stage's compute (at its measured per-layer cost)
// evens out.
void propose_repartition(const TraceAnalysis& a, const AnalysisOptions& options, Remedy& r) {
  const int pp = a.meta.pp_size;
  const int m = a.microbatches;
  const std::vector<double>& stage_s = a.stage_compute_s;
  r.kind = "repartition-stages";
  r.layers_assumed = options.layers <= 0;
  const int total = r.layers_assumed ? kAssumedLayersPerStage * pp : options.layers;
  for (int s = 0; s < pp; ++s) r.current_layers.push_back(total / pp + (s < total % pp ? 1 : 0));
  std::vector<double> unit;
  for (int s = 0; s < pp; ++s)
    for (int l = 0; l < r.current_layers[static_cast<std::size_t>(s)]; ++l)
      unit.push_back(stage_s[static_cast<std::size_t>(s)] /
                     r.current_layers[static_cast<std::size_t>(s)]);
  r.current_stage_s = stage_s;
  if (static_cast<int>(unit.size()) < pp) {
    r.kind = "none";
    r.description = "fewer layers than stages; cannot re-partition";
    return;
  }
  r.proposed_layers = balanced_split(unit, pp);
  std::size_t u = 0;
  for (int s = 0; s < pp; ++s) {
    double t = 0;
    for (int l = 0; l < r.proposed_layers[static_cast<std::size_t>(s)]; ++l) t += unit[u++];
    r.proposed_stage_s.push_back(t);
  }
  r.predicted_step_s =
      a.measured_step_s - pipeline_time(stage_s, m) + pipeline_time(r.proposed_stage_s, m);
  std::string d = "move stage boundaries to layers per stage [";
  d.append(join(r.proposed_layers)).append("]");
  if (r.layers_assumed)
    d.append(" (assumes ")
        .append(std::to_string(kAssumedLayersPerStage))
        .append(" equal layers per stage today; pass --layers for the real count)");
  d.append(
       "; per-layer cost is each stage's forward+backward time divided by its layers; "
       "pipeline estimate (m-1)*max+sum: ")
      .append(num(pipeline_time(stage_s, m)))
      .append(" s -> ")
      .append(num(pipeline_time(r.proposed_stage_s, m)))
      .append(" s");
  r.description = d;
}

// Remedy: give the data-parallel replicas microbatches in proportion to their speed.
void propose_rebalance(const TraceAnalysis& a, const ComputeModel& cm, Remedy& r) {
  const int pp = a.meta.pp_size, dp = a.meta.dp_size;
  const int m = a.microbatches;
  const std::vector<double>& stage_s = a.stage_compute_s;
  r.kind = "rebalance-dp-shares";
  // Per replica, forward + backward per microbatch on each of its stages.
  std::vector<std::vector<double>> replica(
      static_cast<std::size_t>(dp), std::vector<double>(static_cast<std::size_t>(pp), 0.0));
  std::vector<std::vector<int>> seen(replica.size(),
                                     std::vector<int>(static_cast<std::size_t>(pp), 0));
  for (const WorkerStats& w : cm.workers) {
    if (w.count[0] + w.count[1] == 0) continue;
    replica[static_cast<std::size_t>(w.dp)][static_cast<std::size_t>(w.stage)] =
        std::max(replica[static_cast<std::size_t>(w.dp)][static_cast<std::size_t>(w.stage)],
                 cm.worker_microbatch_s(w.rank));
    seen[static_cast<std::size_t>(w.dp)][static_cast<std::size_t>(w.stage)] = 1;
  }
  for (std::size_t d = 0; d < replica.size(); ++d)
    for (int s = 0; s < pp; ++s)
      if (!seen[d][static_cast<std::size_t>(s)])
        replica[d][static_cast<std::size_t>(s)] = stage_s[static_cast<std::size_t>(s)];
  auto replica_time = [&](std::size_t d, int k) { return pipeline_time(replica[d], k); };
  double fastest = std::numeric_limits<double>::infinity();
  for (const auto& t : replica) fastest = std::min(fastest, *std::max_element(t.begin(), t.end()));
  double now = 0;
  for (std::size_t d = 0; d < replica.size(); ++d) {
    r.current_microbatches.push_back(m);
    r.replica_speed.push_back(fastest / *std::max_element(replica[d].begin(), replica[d].end()));
    now = std::max(now, replica_time(d, m));
  }
  // Hand out the replicas' microbatches one at a time to whoever finishes it soonest.
  r.proposed_microbatches.assign(replica.size(), 1);
  for (int left = m * dp - dp; left > 0; --left) {
    std::size_t pick = 0;
    for (std::size_t d = 1; d < replica.size(); ++d)
      if (replica_time(d, r.proposed_microbatches[d] + 1) <
          replica_time(pick, r.proposed_microbatches[pick] + 1))
        pick = d;
    ++r.proposed_microbatches[pick];
  }
  double after = 0;
  for (std::size_t d = 0; d < replica.size(); ++d)
    after = std::max(after, replica_time(d, r.proposed_microbatches[d]));
  r.predicted_step_s = a.measured_step_s - now + after;
  std::string d = "give the data-parallel replicas microbatches in proportion to their speed: [";
  d.append(join(r.proposed_microbatches))
      .append("] instead of ")
      .append(std::to_string(m))
      .append(" each (slowest replica's pipeline ")
      .append(num(now))
      .append(" s -> ")
      .append(num(after))
      .append(" s); or move the slow rank to a healthy GPU");
  r.description = d;
}

// The remedy for the cause found, or none with the reason.
void propose_remedy(const ComputeModel& cm, const AnalysisOptions& options, TraceAnalysis& a) {
  const int pp = a.meta.pp_size, dp = a.meta.dp_size;
  Remedy& r = a.remedy;
  r.current_step_s = r.predicted_step_s = a.measured_step_s;
  if (a.cause == "stage-imbalance") {
    propose_repartition(a, options, r);
  } else if (a.cause == "worker") {
    if (dp > 1)
      propose_rebalance(a, cm, r);
    else if (pp > 1)
      propose_repartition(a, options, r);
  }
  if (r.kind.empty() || r.kind == "none") {
    r.kind = "none";
    r.predicted_step_s = a.measured_step_s;
    if (r.description.empty()) {
      std::string d;
      if (a.cause == "diffuse") {
        d = "no layout change helps: the slowdown is spread over all workers (op-to-op and "
            "step-to-step variation, e.g. uneven sequence lengths); an ideal run would take ";
        d.append(num(a.ideal_step_s))
            .append(" s per step (")
            .append(num(a.slowdown, 2))
            .append("x faster)");
      } else {
        d = "the job runs within ";
        d.append(num((a.slowdown - 1) * 100, 1))
            .append("% of its ideal step time; keep the layout");
      }
      r.description = d;
    }
  }
}

}  // namespace

StatusOr<TraceAnalysis> analyze_trace(const OpTrace& trace, const AnalysisOptions& options) {
  StatusOr<ReplayGraph> built = ReplayGraph::build(trace);
  if (!built.ok()) return built.status();
  const ReplayGraph& graph = *built;
  TraceAnalysis a;
  a.meta = trace.meta;
  a.steps = graph.num_steps();
  a.recorded_step_s = mean(graph.recorded_step_s());
  const std::vector<double> ideal = replay_typical(trace, graph, a);
  attribute_slowdowns(trace, graph, ideal, a);
  const ComputeModel cm = compute_model(trace);
  split_factors(trace, graph, cm, ideal, a);
  find_cause(cm, a);
  propose_remedy(cm, options, a);
  return a;
}

std::vector<ConditionsInterval> recorded_conditions(const OpTrace& trace, int steps_per_interval) {
  std::vector<ConditionsInterval> out;
  if (steps_per_interval < 1 || trace.ops.empty()) return out;
  const ComputeModel cm = compute_model(trace);
  std::vector<std::int64_t> steps;
  for (const OpRecord& r : trace.ops) steps.push_back(r.step);
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  const std::size_t n_intervals =
      (steps.size() + static_cast<std::size_t>(steps_per_interval) - 1) /
      static_cast<std::size_t>(steps_per_interval);
  const std::size_t world = static_cast<std::size_t>(std::max(1, trace.meta.world_size));
  std::vector<std::vector<double>> typical(n_intervals, std::vector<double>(world, 0.0));
  std::vector<std::vector<double>> actual = typical;
  std::vector<double> first_start(n_intervals, std::numeric_limits<double>::infinity());
  std::vector<double> last_end(n_intervals, -std::numeric_limits<double>::infinity());
  for (const OpRecord& r : trace.ops) {
    const auto si = static_cast<std::size_t>(std::lower_bound(steps.begin(), steps.end(), r.step) -
                                             steps.begin());
    const std::size_t iv = si / static_cast<std::size_t>(steps_per_interval);
    first_start[iv] = std::min(first_start[iv], r.start_s);
    last_end[iv] = std::max(last_end[iv], r.end_s());
    if (!is_compute(r.type)) continue;
    const std::size_t k = r.type == OpType::kForwardCompute ? 0 : 1;
    typical[iv][static_cast<std::size_t>(r.rank)] +=
        cm.stage_typical[static_cast<std::size_t>(r.stage)][k];
    actual[iv][static_cast<std::size_t>(r.rank)] += r.duration_s;
  }
  for (std::size_t iv = 0; iv < n_intervals; ++iv) {
    ConditionsInterval c;
    c.first_step = steps[iv * static_cast<std::size_t>(steps_per_interval)];
    c.last_step =
        steps[std::min(steps.size(), (iv + 1) * static_cast<std::size_t>(steps_per_interval)) - 1];
    c.start_s = first_start[iv] - first_start[0];
    const double end = iv + 1 < n_intervals ? first_start[iv + 1] : last_end[iv];
    c.duration_s = std::max(0.0, end - first_start[iv]);
    c.conditions.gpu_speed.assign(world, 1.0);
    for (std::size_t g = 0; g < world; ++g)
      if (actual[iv][g] > 0)
        c.conditions.gpu_speed[g] = std::clamp(typical[iv][g] / actual[iv][g], 0.01, 2.0);
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace parapilot::trace
