#include "env/monitor/monitor.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>

#include "env/monitor/robust_stats.h"
#include "transport/telemetry_keys.h"

namespace parapilot::monitor {

namespace keys = transport::telemetry_keys;

const char* to_string(MonitorEvent::Kind kind) {
  switch (kind) {
    case MonitorEvent::Kind::slow_rank:
      return "slow_rank";
    case MonitorEvent::Kind::rank_recovered:
      return "rank_recovered";
    case MonitorEvent::Kind::congested_link:
      return "congested_link";
    case MonitorEvent::Kind::link_recovered:
      return "link_recovered";
    case MonitorEvent::Kind::rank_lost:
      return "rank_lost";
    case MonitorEvent::Kind::slow_link:
      return "slow_link";
    case MonitorEvent::Kind::link_restored:
      return "link_restored";
  }
  return "?";
}

namespace {

// Why a reported time is unusable (nan, infinite, negative, absurd); nullptr when it is fine.
const char* bad_number(double v, const MonitorOptions& o) {
  // The common case first, in two comparisons: a NaN fails both, and the bound is finite (an
  // infinite max_compute_ms still refuses infinite values), so a value passing them is none of
  // the cases below.
  if (v >= 0 && v <= std::min(o.max_compute_ms, std::numeric_limits<double>::max())) {
    return nullptr;
  }
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return "infinite";
  if (v < 0) return "negative";
  if (v > o.max_compute_ms) return "absurd";
  return nullptr;
}

// Why per-layer gradient statistics are unusable; nullptr when they are fine.
const char* layers_problem(const std::vector<transport::LayerGradStat>& layers) {
  for (const auto& l : layers) {
    if (std::isnan(l.norm) || std::isnan(l.max_abs)) return "nan";
    if (std::isinf(l.norm) || std::isinf(l.max_abs)) return "infinite";
    if (l.norm < 0 || l.max_abs < 0) return "negative";
  }
  return nullptr;
}

// What is wrong with one sample's values (finite, non-negative, bounded, consistent); "" when
// nothing is.
std::string telemetry_problem(const transport::Telemetry& t, const MonitorOptions& o) {
  if (o.ranks > 0 && t.rank >= static_cast<uint32_t>(o.ranks)) return "unknown_rank";
  if (const char* r = bad_number(t.compute_ms, o)) return r;
  if (t.step_end_ns < t.step_start_ns) return "negative";
  const double wall_ms = static_cast<double>(t.step_end_ns - t.step_start_ns) / 1e6;
  if (wall_ms > o.max_compute_ms) return "absurd";
  // Compute-only time cannot exceed the step it is part of (1 ms of clock slack).
  if (t.compute_ms > wall_ms + 1.0) return "absurd";
  for (const auto& [name, c] : t.collectives) {
    if (const char* r = bad_number(c.ms, o)) return r;
    if (c.ms > wall_ms + 1.0) return "absurd";
  }
  if (const char* r = layers_problem(t.layers)) return r;
  return "";
}

// What is wrong with a sample handed in directly (the checks telemetry_problem makes on the
// message, on the fields the monitor reads); nullptr when nothing is.
const char* sample_problem(const StepSample& x, const MonitorOptions& o) {
  if (x.rank < 0 || x.rank >= o.ranks) return "unknown_rank";
  if (x.end_ns < x.start_ns) return "negative";
  const double wall_ms = static_cast<double>(x.end_ns - x.start_ns) / 1e6;
  if (wall_ms > o.max_compute_ms) return "absurd";
  for (double v : {x.compute_ms, x.inter_ms, x.longest_collective_ms, x.queue_depth}) {
    if (const char* r = bad_number(v, o)) return r;
  }
  for (double v : {x.samples, x.fixed_ms, x.wait_ms}) {  // -1: not reported
    if (v == -1) continue;
    if (const char* r = bad_number(v, o)) return r;
  }
  // A byte count has no time bound.
  if (std::isnan(x.dp_bytes)) return "nan";
  if (std::isinf(x.dp_bytes)) return "infinite";
  if (x.dp_bytes < 0 && x.dp_bytes != -1) return "negative";
  if (x.compute_ms > wall_ms + 1.0 || x.longest_collective_ms > wall_ms + 1.0) return "absurd";
  for (double v : x.stage.block_ms) {
    if (const char* r = bad_number(v, o)) return r;
  }
  if (const char* r = layers_problem(x.layers)) return r;
  return nullptr;
}

enum class Liveness : uint8_t { unknown, live, lost };

struct StepAgg {
  std::vector<StepSample> samples;
  std::vector<uint8_t> seen;
  Clock::time_point last_arrival;
};

struct RankStats {
  RobustEwma compute;  // per sample when samples are reported: (compute - fixed) / samples
  RobustEwma fixed;    // the per-step part that does not scale with samples (phase/optimizer)
  RobustEwma bandwidth;
  RobustEwma wall;
  double lateness_ms = 0;
  double last_wait_ms = 0;
  double waited_ms = -1;  // smoothed measured wait in all the step's collectives; -1: none
  double sync_share = -1;  // smoothed share of steps with another collective besides dp; -1: none
  double queue = 0;
  long samples = 0;
  double speed = 1;  // last believed; kept across layout changes until re-estimated
  bool slow = false;
  int past_steps = 0;     // closed steps in a row past the slow (or recovered) threshold
  bool reported = false;  // any sample accepted; newest: the largest step reported
  uint64_t newest = 0;
  Liveness liveness = Liveness::unknown;
};

// One sample's compute into its rank's levels. With samples reported, the speed level is per
// sample of the part that scales with samples (compute minus the optimizer step, which a rank
// pays once per step however many samples it has); a rank with no samples says nothing.
void add_compute(RankStats& r, double compute_ms, double work, double fixed_ms,
                 uint64_t& outliers) {
  const double fixed = std::clamp(fixed_ms, 0.0, compute_ms);
  if (work > 0) {
    if (!r.compute.add((compute_ms - fixed) / work)) ++outliers;
    if (fixed_ms >= 0 && !r.fixed.add(fixed)) ++outliers;
  } else if (work < 0 && !r.compute.add(compute_ms)) {
    ++outliers;
  }
}

// Per group of the `count` items at `items` (dense group index, value): the k-th smallest
// value, k = (size - 1) / 2 (the lower median) or, with `upper`, size / 2; has[g] = 0 for a
// group without items. `fill` and `values` are scratch.
void group_medians(const std::pair<int, double>* items, size_t count, int groups, bool upper,
                   std::vector<int>& fill, std::vector<double>& values, std::vector<double>& out,
                   std::vector<uint8_t>& has) {
  const std::pair<int, double>* const end = items + count;
  // Counting sort by group: fill[g] ends as where group g starts, fill[groups] = the total.
  fill.assign(static_cast<size_t>(groups) + 1, 0);
  for (const auto* item = items; item != end; ++item) ++fill[item->first];
  for (int g = 1; g < groups; ++g) fill[g] += fill[g - 1];
  fill[groups] = static_cast<int>(count);
  values.resize(count);
  for (const auto* item = items; item != end; ++item) values[--fill[item->first]] = item->second;
  out.assign(groups, 0.0);
  has.assign(groups, 0);
  for (int g = 0; g < groups; ++g) {
    const int size = fill[g + 1] - fill[g];
    if (size == 0) continue;
    double* first = values.data() + fill[g];
    double* kth = first + (upper ? size / 2 : (size - 1) / 2);
    select_nth(first, kth, first + size);
    out[g] = *kth;
    has[g] = 1;
  }
}

}  // namespace

struct Monitor::State {
  MonitorOptions o;
  int nodes = 0;
  std::vector<RankStats> ranks;
  std::vector<double> node_bw;
  std::vector<bool> node_congested;
  std::map<uint64_t, StepAgg> pending;
  std::map<uint64_t, StepAgg>::node_type spare;  // a closed step's buffers, for a new step
  // The pending aggregate the last accepted sample went to, and its step: the samples of a step
  // mostly arrive in a row, and this spares them the map lookup. nullptr when none (the entry
  // left `pending`); map entries stay put while they are in it.
  StepAgg* last_agg = nullptr;
  uint64_t last_agg_step = 0;
  bool any_closed = false;
  uint64_t last_closed = 0;
  uint64_t newest = 0;
  bool any_seen = false;
  bool any_connected = false;
  Beliefs beliefs;
  MonitorCounters counters;
  std::vector<MonitorEvent> events;
  // The last closed step's median wait in the collectives, for slow-rank events: worked out
  // from `waits` (that step's waits) when the first event needs it, then kept for the others.
  double median_wait_ms() {
    if (!median_wait) median_wait = median_in_place(waits.data(), waits.data() + waits.size());
    return *median_wait;
  }
  std::optional<double> median_wait;  // of `waits`; empty until asked for
  bool per_sample = false;  // compute levels are per sample (ranks report info/samples)

  // The gradient all-reduce's link (monitor.h, "Slow link").
  struct Link {
    RobustEwma wait, bytes, compute;  // least wait/dp, median bytes, median compute, per step
    double reference = 0;             // MB/s while normal; 0: none yet
    double reference_spread = 0;      // the least wait's spread while normal, ms
    double reference_compute = 0;     // the median compute while normal, ms
    bool slow = false;
  } link;
  // The last closed step's link figures (close() to refresh_beliefs()); valid: every rank
  // reported wait/dp and its gradient bytes.
  bool step_link_valid = false;
  double step_link_wait = 0, step_link_bytes = 0, step_link_compute = 0;

  int live_count = 0;  // ranks whose liveness is live

  // o.peer_group as dense indices [0, group_count) (one group when it is empty).
  std::vector<int> group_index;
  int group_count = 1;
  // Buffers close() and refresh_beliefs() reuse.
  std::vector<double> arrivals, waits, walls, values, group_reference, node_level, node_rates,
      raw_speeds;
  std::vector<std::pair<int, double>> group_items;
  std::vector<int> measured_ranks;  // refresh_beliefs: the ranks whose speed is measured
  std::vector<int> group_fill;
  std::vector<uint8_t> has_reference, has_spread;
  std::vector<double> group_spread, group_band;  // per peer group: speeds' noise, the band

  void index_groups() {
    group_index.assign(o.ranks, 0);
    group_count = 1;
    if (o.peer_group.empty()) return;
    std::map<int, int> dense;
    for (int r = 0; r < o.ranks; ++r) {
      group_index[r] = dense.emplace(o.peer_group[r], static_cast<int>(dense.size())).first->second;
    }
    group_count = static_cast<int>(dense.size());
  }
  // The aggregate of a step not seen before, reusing a closed step's buffers when there is one.
  StepAgg& new_step(uint64_t step) {
    std::map<uint64_t, StepAgg>::iterator it;
    if (spare.empty()) {
      it = pending.try_emplace(step).first;
    } else {
      spare.key() = step;
      it = pending.insert(std::move(spare)).position;
    }
    StepAgg& agg = it->second;
    agg.samples.clear();
    agg.samples.reserve(o.ranks);
    agg.seen.assign(o.ranks, 0);
    return agg;
  }
  // Takes one sample (the caller holds the lock); appends the steps it closed to `closed`.
  // Returns nullptr when the sample is accepted, else why it is rejected (a key of
  // MonitorCounters::rejected_by_reason): no Status is built per sample of a batch.
  const char* take(StepSample&& sample, Clock::time_point arrival,
                   std::vector<std::pair<uint64_t, Clock::time_point>>& closed);

  int expected() const { return any_connected ? live_count : o.ranks; }
  void set_liveness(int rank, Liveness l) {
    live_count += (l == Liveness::live) - (ranks[rank].liveness == Liveness::live);
    ranks[rank].liveness = l;
  }

  void close(uint64_t step, StepAgg& agg, Clock::time_point trigger,
             std::vector<std::pair<uint64_t, Clock::time_point>>& out);
  void refresh_beliefs(uint64_t step, int missing, int expected_count);
  // refresh_beliefs' phases, in order: the ranks' speeds against their groups' references, the
  // ranks' beliefs and events, the nodes' bandwidths and events.
  void measure_speeds();
  int update_rank_beliefs(uint64_t step, Clock::time_point now);
  void update_node_beliefs(uint64_t step, Clock::time_point now);
  void update_link_beliefs(uint64_t step, Clock::time_point now);
};

Monitor::Monitor(MonitorOptions options) : s_(std::make_unique<State>()) {
  // Preconditions (the options come from code: options_for and its callers).
  assert(options.ranks >= 1 && options.gpus_per_node >= 1);
  assert(options.compute_alpha > 0 && options.compute_alpha <= 1);
  assert(options.peer_group.empty() ||
         static_cast<int>(options.peer_group.size()) == options.ranks);
  s_->o = options;
  s_->index_groups();
  s_->nodes = (options.ranks + options.gpus_per_node - 1) / options.gpus_per_node;
  RobustEwma::Options compute_options;
  compute_options.alpha = options.compute_alpha;
  s_->ranks.resize(options.ranks);
  for (RankStats& r : s_->ranks) r.compute = r.fixed = RobustEwma(compute_options);
  s_->node_bw.assign(s_->nodes, 1.0);
  s_->node_congested.assign(s_->nodes, false);
  s_->beliefs.conditions.gpu_speed.assign(options.ranks, 1.0);
  s_->beliefs.conditions.node_inter_bw.assign(s_->nodes, 1.0);
  s_->beliefs.rank_compute_ms.assign(options.ranks, 0.0);
  s_->beliefs.rank_compute_se_ms.assign(options.ranks, 0.0);
  s_->beliefs.rank_steps_per_s.assign(options.ranks, 0.0);
  s_->beliefs.rank_lateness_ms.assign(options.ranks, 0.0);
  s_->beliefs.rank_wait_ms.assign(options.ranks, -1.0);
  s_->beliefs.rank_queue_depth.assign(options.ranks, 0.0);
  s_->beliefs.rank_fixed_ms.assign(options.ranks, 0.0);
  s_->beliefs.rank_samples.assign(options.ranks, 0.0);
}

Monitor::~Monitor() = default;

void Monitor::set_step_callback(StepCallback callback) {
  std::lock_guard lock(mutex_);
  callback_ = std::move(callback);
}

namespace {

// A pipeline stage's facts, when `t` reports its blocks (pp-contract: a stage holding more than
// kMaxReportedBlocks blocks reports no block's compute).
constexpr uint64_t kMaxReportedBlocks = 60;

void read_stage(const transport::Telemetry& t, StageFacts& f) {
  const auto first = keys::info(t, keys::kFirstBlock);
  const auto blocks = keys::info(t, keys::kBlocks);
  if (!first || !blocks || *blocks < 1 || *first > INT32_MAX / 2 || *blocks > INT32_MAX / 2) {
    return;
  }
  f.first_block = static_cast<int>(*first);
  f.blocks = static_cast<int>(*blocks);
  if (const auto m = keys::info(t, keys::kMicrobatches)) {
    f.microbatches = static_cast<int>(std::min<uint64_t>(*m, INT32_MAX));
  }
  if (const auto* p2p = keys::timing(t, keys::kP2pPp)) {
    f.p2p_ms = p2p->ms;
    f.p2p_bytes = static_cast<double>(p2p->bytes);
  }
  if (*blocks > kMaxReportedBlocks) return;
  for (uint64_t i = 0; i < *blocks; ++i) {
    const auto ms = keys::block_ms(t, static_cast<size_t>(*first + i));
    if (!ms) {
      f.block_ms.clear();  // not every block: none (deploy then assumes equal costs)
      return;
    }
    f.block_ms.push_back(*ms);
  }
}

// The stage facts of a closed step into the rank's smoothed ones.
void fold_stage(const StageFacts& x, StageFacts& f) {
  if (f.first_block != x.first_block || f.blocks != x.blocks ||
      f.block_ms.size() != x.block_ms.size()) {
    f = x;  // a new stage (or the first report): its figures start afresh
    return;
  }
  f.microbatches = x.microbatches;
  for (size_t i = 0; i < f.block_ms.size(); ++i) {
    f.block_ms[i] = 0.8 * f.block_ms[i] + 0.2 * x.block_ms[i];
  }
  f.p2p_ms = 0.8 * f.p2p_ms + 0.2 * x.p2p_ms;
  f.p2p_bytes = 0.8 * f.p2p_bytes + 0.2 * x.p2p_bytes;
}

}  // namespace

StepSample to_sample(const transport::Telemetry& t) {
  StepSample x;
  x.rank = static_cast<int>(std::min<uint32_t>(t.rank, INT32_MAX));
  x.step = t.step;
  x.start_ns = t.step_start_ns;
  x.end_ns = t.step_end_ns;
  x.compute_ms = t.compute_ms;
  x.queue_depth = t.queue_depth;
  for (const auto& [name, c] : t.collectives) {
    x.longest_collective_ms = std::max(x.longest_collective_ms, c.ms);
    if (name.find("inter") == std::string::npos) continue;
    x.inter_bytes += static_cast<double>(c.bytes);
    x.inter_ms += c.ms;
  }
  if (auto samples = keys::info(t, keys::kSamples)) x.samples = static_cast<double>(*samples);
  if (const auto* wait = keys::timing(t, keys::kWaitDp)) x.wait_ms = wait->ms;
  for (const char* key : {keys::kAllReduceDp, keys::kAllGatherDp}) {
    if (const auto* c = keys::timing(t, key)) {
      x.dp_bytes = std::max(0.0, x.dp_bytes) + static_cast<double>(c->bytes);
    }
  }
  if (const auto* other = keys::timing(t, keys::kWaitOther)) {
    x.other_wait_ms = other->ms;
    x.other_calls = static_cast<int>(std::min<uint32_t>(other->calls, INT32_MAX));
  }
  if (const auto* optimizer = keys::timing(t, keys::kPhaseOptimizer)) x.fixed_ms = optimizer->ms;
  x.layers = t.layers;
  read_stage(t, x.stage);
  return x;
}

transport::Telemetry to_telemetry(const StepSample& x) {
  transport::Telemetry t;
  t.rank = static_cast<uint32_t>(x.rank);
  t.step = x.step;
  t.step_start_ns = x.start_ns;
  t.step_end_ns = x.end_ns;
  t.compute_ms = x.compute_ms;
  t.queue_depth = static_cast<uint32_t>(x.queue_depth);
  if (x.samples >= 0) keys::set_info(t, keys::kSamples, static_cast<uint64_t>(x.samples));
  if (x.wait_ms >= 0) t.collectives[keys::kWaitDp] = {x.wait_ms, 0, 1};
  if (x.other_wait_ms >= 0) {
    t.collectives[keys::kWaitOther] = {x.other_wait_ms, 0,
                                       static_cast<uint32_t>(std::max(0, x.other_calls))};
  }
  if (x.fixed_ms >= 0) t.collectives[keys::kPhaseOptimizer] = {x.fixed_ms, 0, 1};
  if (x.dp_bytes >= 0) {
    t.collectives[keys::kAllReduceDp] = {0, static_cast<uint64_t>(x.dp_bytes), 1};
  }
  if (x.inter_bytes > 0 || x.inter_ms > 0) {
    t.collectives[keys::kAllReduceDpInter] = {x.inter_ms, static_cast<uint64_t>(x.inter_bytes),
                                              1};
  }
  t.layers = x.layers;
  if (x.stage.first_block >= 0) {
    keys::set_info(t, keys::kFirstBlock, static_cast<uint64_t>(x.stage.first_block));
    keys::set_info(t, keys::kBlocks, static_cast<uint64_t>(x.stage.blocks));
    if (x.stage.microbatches > 0) {
      keys::set_info(t, keys::kMicrobatches, static_cast<uint64_t>(x.stage.microbatches));
    }
    for (size_t i = 0; i < x.stage.block_ms.size(); ++i) {
      keys::set_block_ms(t, static_cast<size_t>(x.stage.first_block) + i, x.stage.block_ms[i]);
    }
    if (x.stage.p2p_ms > 0 || x.stage.p2p_bytes > 0) {
      t.collectives[keys::kP2pPp] = {x.stage.p2p_ms, static_cast<uint64_t>(x.stage.p2p_bytes), 1};
    }
  }
  return t;
}

MonitorOptions options_for(const ClusterTopology& topology, MonitorOptions base) {
  base.ranks = topology.num_gpus();
  base.gpus_per_node = topology.nodes.empty() ? 8 : topology.nodes.front().gpus;
  base.peer_group = topology.type_of_gpu;
  return base;
}

std::vector<int> peer_groups(const ClusterTopology& topology, const Strategy& layout) {
  const int pp = std::max(1, layout.pp);
  // Unused GPUs: group type (stage pp, past every real stage).
  std::vector<int> group(topology.num_gpus());
  for (int g = 0; g < topology.num_gpus(); ++g) group[g] = topology.type_of_gpu[g] * (pp + 1) + pp;
  for (int d = 0; d < layout.dp; ++d) {
    for (int p = 0; p < pp; ++p) {
      for (int i = 0; i < std::max(1, layout.tp); ++i) {
        const int g = layout.gpu_of_rank(d, p, i);
        if (g >= 0 && g < topology.num_gpus()) {
          group[g] = topology.type_of_gpu[g] * (pp + 1) + p;
        }
      }
    }
  }
  return group;
}

Status Monitor::ingest(const transport::Telemetry& t, Clock::time_point arrival) {
  {
    std::lock_guard lock(mutex_);
    const std::string reason = telemetry_problem(t, s_->o);
    if (!reason.empty()) {
      ++s_->counters.rejected;
      ++s_->counters.rejected_by_reason[reason];
      return Status::rejected(reason);
    }
  }
  return ingest(to_sample(t), arrival);
}

Status Monitor::ingest(const StepSample& sample, Clock::time_point arrival) {
  std::vector<std::pair<uint64_t, Clock::time_point>> closed;
  StepCallback callback;
  Status status;
  {
    std::lock_guard lock(mutex_);
    const char* reason = s_->take(StepSample(sample), arrival, closed);
    if (reason) status = Status::rejected(reason);
    callback = callback_;
  }
  if (callback) {
    for (const auto& [step, when] : closed) callback(step, when);
  }
  return status;
}

size_t Monitor::ingest(std::vector<StepSample>&& samples, Clock::time_point arrival) {
  std::vector<std::pair<uint64_t, Clock::time_point>> closed;
  StepCallback callback;
  size_t accepted = 0;
  {
    std::lock_guard lock(mutex_);
    for (StepSample& x : samples) accepted += s_->take(std::move(x), arrival, closed) == nullptr;
    callback = callback_;
  }
  samples.clear();
  if (callback) {
    for (const auto& [step, when] : closed) callback(step, when);
  }
  return accepted;
}

const char* Monitor::State::take(StepSample&& sample, Clock::time_point arrival,
                                 std::vector<std::pair<uint64_t, Clock::time_point>>& closed) {
  State& s = *this;
  // Why the sample is rejected (nullptr: it is not).
  const char* reason = sample_problem(sample, s.o);
  if (!reason && s.any_seen && sample.step > s.newest + s.o.max_step_jump) reason = "absurd_step";
  // Ranks report their steps in order: one already reported is a duplicate.
  if (!reason && s.ranks[sample.rank].reported &&
      sample.step <= s.ranks[sample.rank].newest) {
    reason = "duplicate";
  }
  if (!reason && s.any_closed && sample.step <= s.last_closed) {
    // Its step already closed without it: the rank's own levels still learn from it, the
    // cross-rank comparisons of that step cannot.
    ++s.counters.accepted;
    ++s.counters.late;
    RankStats& r = s.ranks[sample.rank];
    r.reported = true;
    r.newest = sample.step;
    add_compute(r, sample.compute_ms, sample.samples, sample.fixed_ms, s.counters.outliers);
    return nullptr;
  }
  StepAgg* agg = nullptr;
  if (!reason) {
    if (s.last_agg && s.last_agg_step == sample.step) {
      agg = s.last_agg;
    } else {
      auto it = s.pending.find(sample.step);
      agg = it != s.pending.end() ? &it->second : &s.new_step(sample.step);
      s.last_agg = agg;
      s.last_agg_step = sample.step;
    }
    if (agg->seen[sample.rank]) reason = "duplicate";
  }
  if (reason) {
    ++s.counters.rejected;
    ++s.counters.rejected_by_reason[reason];
    return reason;
  }
  ++s.counters.accepted;
  s.ranks[sample.rank].reported = true;
  s.ranks[sample.rank].newest = std::max(s.ranks[sample.rank].newest, sample.step);
  for (const auto& l : sample.layers) s.beliefs.nonfinite_gradients += l.nonfinite_count;
  agg->seen[sample.rank] = 1;
  const uint64_t step = sample.step;
  agg->samples.push_back(std::move(sample));
  agg->last_arrival = arrival;
  s.newest = s.any_seen ? std::max(s.newest, step) : step;
  s.any_seen = true;

  // Close steps in order: older ones that a rank has moved well past, then this one if every
  // live rank reported it.
  const int expected_count = s.expected();
  const bool this_full = static_cast<int>(agg->samples.size()) >= expected_count;
  while (!s.pending.empty()) {
    auto it = s.pending.begin();
    const bool lagging = it->first + static_cast<uint64_t>(s.o.close_lag_steps) <= s.newest;
    const bool full = static_cast<int>(it->second.samples.size()) >= expected_count;
    const bool older_than_full = it->first < step && this_full;
    if (!(lagging || full || older_than_full)) break;
    s.close(it->first, it->second, arrival, closed);
    if (&it->second == s.last_agg) s.last_agg = nullptr;
    // Keep one closed step's buffers for the next new step.
    if (s.spare.empty()) {
      s.spare = s.pending.extract(it);
    } else {
      s.pending.erase(it);
    }
  }
  return nullptr;
}

void Monitor::State::close(uint64_t step, StepAgg& agg, Clock::time_point trigger,
                           std::vector<std::pair<uint64_t, Clock::time_point>>& out) {
  const int expected_count = std::max(expected(), static_cast<int>(agg.samples.size()));
  const int missing = expected_count - static_cast<int>(agg.samples.size());
  // The step's per-sample series are written in place, sized once (no capacity check per
  // sample); they are read below only up to `count`.
  const size_t count = agg.samples.size();
  arrivals.resize(count);
  waits.resize(count);
  walls.resize(count);
  // Arrival at the collective = step start + compute-only time, relative to the earliest start.
  // Arrivals are >= +0 (accepted compute times are >= 0, and +0 + -0 is +0), so the largest
  // starts from 0.
  uint64_t min_start = UINT64_MAX;
  for (const StepSample& x : agg.samples) min_start = std::min(min_start, x.start_ns);
  double last = 0;
  for (size_t i = 0; i < count; ++i) {
    const StepSample& x = agg.samples[i];
    arrivals[i] = static_cast<double>(x.start_ns - min_start) / 1e6 + x.compute_ms;
    last = std::max(last, arrivals[i]);
  }
  values.assign(arrivals.begin(), arrivals.end());
  const double mid = median_in_place(values.data(), values.data() + values.size());
  median_wait.reset();
  // Whether every wall time equals the first (ranks of a synchronous step often leave its last
  // collective together): their median is then that value, without a selection. Wall times come
  // from unsigned differences, so there is no -0 to tell from 0.
  bool one_wall = true;
  const double first_wall =
      count > 0 ? static_cast<double>(agg.samples[0].end_ns - agg.samples[0].start_ns) / 1e6 : 0;
  std::map<uint32_t, std::vector<double>> layer_norms;
  // The link's figures of the step: every rank's wait/dp and gradient bytes, or none.
  step_link_valid = missing == 0 && count > 0;
  step_link_wait = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < count && step_link_valid; ++i) {
    const StepSample& x = agg.samples[i];
    step_link_valid = x.wait_ms >= 0 && x.dp_bytes > 0;
    step_link_wait = std::min(step_link_wait, x.wait_ms);
  }
  if (step_link_valid) {
    values.resize(count);
    for (size_t i = 0; i < count; ++i) values[i] = agg.samples[i].dp_bytes;
    step_link_bytes = median_in_place(values.data(), values.data() + count);
    for (size_t i = 0; i < count; ++i) values[i] = agg.samples[i].compute_ms;
    step_link_compute = median_in_place(values.data(), values.data() + count);
  }
  for (size_t i = 0; i < count; ++i) {
    const StepSample& x = agg.samples[i];
    RankStats& r = ranks[x.rank];
    // Speed compares compute per sample when ranks report their samples (elastic shares give
    // ranks unequal work), else compute per step.
    if (x.samples > 0) per_sample = true;
    add_compute(r, x.compute_ms, x.samples, x.fixed_ms, counters.outliers);
    const double wall_ms = static_cast<double>(x.end_ns - x.start_ns) / 1e6;
    r.wall.add(wall_ms);
    walls[i] = wall_ms;
    one_wall &= wall_ms == first_wall;
    beliefs.rank_samples[x.rank] = std::max(0.0, x.samples);
    if (x.stage.first_block >= 0) {
      beliefs.rank_stage.resize(o.ranks);
      fold_stage(x.stage, beliefs.rank_stage[x.rank]);
    }
    const double wait = x.wait_ms >= 0 ? x.wait_ms : last - arrivals[i];
    waits[i] = wait;
    r.last_wait_ms = wait;
    if (x.wait_ms >= 0) {
      const double all = x.wait_ms + std::max(0.0, x.other_wait_ms);
      r.waited_ms = r.waited_ms < 0 ? all : 0.8 * r.waited_ms + 0.2 * all;
    }
    if (x.other_calls >= 0) {
      const double synced = x.other_calls > 0 ? 1.0 : 0.0;
      r.sync_share = r.sync_share < 0 ? synced : 0.9 * r.sync_share + 0.1 * synced;
    }
    r.lateness_ms =
        r.samples == 0 ? arrivals[i] - mid : 0.7 * r.lateness_ms + 0.3 * (arrivals[i] - mid);
    if (x.inter_bytes > 0) {
      // The time actually spent moving bytes: the collective minus waiting for the last rank.
      const double transfer_ms = std::max(x.inter_ms - wait, 1e-3);
      if (!r.bandwidth.add(x.inter_bytes / transfer_ms / 1e6)) ++counters.outliers;
    }
    r.queue = r.samples == 0 ? x.queue_depth : 0.8 * r.queue + 0.2 * x.queue_depth;
    ++r.samples;
    for (const auto& l : x.layers) layer_norms[l.layer].push_back(static_cast<double>(l.norm));
  }
  beliefs.last_step_ms =
      one_wall ? first_wall : median_in_place(walls.data(), walls.data() + walls.size());
  beliefs.compute_per_sample = per_sample;
  beliefs.layer_grad_norm.clear();
  for (auto& [layer, norms] : layer_norms) {
    if (beliefs.layer_grad_norm.size() <= layer) beliefs.layer_grad_norm.resize(layer + 1, 0.0);
    beliefs.layer_grad_norm[layer] = median(std::move(norms));
  }
  ++counters.steps_closed;
  any_closed = true;
  last_closed = step;
  refresh_beliefs(step, missing, expected_count);
  out.emplace_back(step, trigger);
}

// Each measured rank's speed before the band (raw_speeds; 0 for a rank not measured), its peer
// group's reference level (group_reference) and each group's dead band (group_band).
void Monitor::State::measure_speeds() {
  const int n = o.ranks;
  // group_medians' items are written in place, at most one per rank (nodes <= ranks): `items`
  // holds room for them all, `count` says how many the current list has.
  group_items.resize(n);
  std::pair<int, double>* const items = group_items.data();
  size_t count = 0;
  // Speed: the peer group's reference compute level over this rank's, for the ranks measured
  // (listed in rank order, item i being measured_ranks[i]'s level).
  measured_ranks.resize(n);
  int* const measured = measured_ranks.data();
  for (int r = 0; r < n; ++r) {
    const RankStats& st = ranks[r];
    if (st.liveness == Liveness::lost || st.compute.count() < o.min_samples) continue;
    measured[count] = r;
    items[count++] = {group_index[r], st.compute.value()};
  }
  const size_t measured_count = count;
  // The reference is the lower median of the group's compute levels (the faster middle rank):
  // in a group of two a slow rank must not drag its own reference halfway to itself.
  group_medians(items, count, group_count, false, group_fill, values, group_reference,
                has_reference);
  const std::vector<double>& reference = group_reference;
  // Each rank's speed before the band; 0 for a rank not measured (a measured one is >= 0.01).
  // The band around 1 per group: the fixed dead band, widened to the group's own noise (the
  // lower median of |speed - 1| over its measured ranks, collected here: most ranks are
  // healthy, and the reference rank reads 0).
  // A measured rank's group always has a reference (its level is among the group's items).
  // The deviations overwrite the levels in place, never ahead of the item read.
  raw_speeds.assign(n, 0.0);
  count = 0;
  for (size_t i = 0; i < measured_count; ++i) {
    const int r = measured[i];
    const auto [g, level] = items[i];
    if (level > 0) {
      raw_speeds[r] = std::clamp(reference[g] / level, 0.01, 1.5);
      items[count++] = {g, std::abs(raw_speeds[r] - 1.0)};
    }
  }
  group_band.assign(group_count, o.dead_band);
  if (o.dead_band_deviations > 0) {
    group_medians(items, count, group_count, false, group_fill, values, group_spread, has_spread);
    // Never as wide as a slow rank's shift: a rank slow enough to be reported is believed.
    const double widest = std::max(o.dead_band, 1.0 - o.slow_speed);
    for (int g = 0; g < group_count; ++g) {
      if (has_spread[g]) {
        group_band[g] = std::clamp(o.dead_band_deviations * 1.4826 * group_spread[g],
                                   o.dead_band, widest);
      }
    }
  }
}

// Each rank's beliefs from its statistics, and the slow-rank and recovery events its speed
// crossing the thresholds raises (reference: the speed references measure_speeds found).
// Returns the ranks live.
int Monitor::State::update_rank_beliefs(uint64_t step, Clock::time_point now) {
  const int n = o.ranks;
  const std::vector<double>& reference = group_reference;
  Beliefs& b = beliefs;
  b.conditions.gpu_failed.clear();
  b.slow_ranks.clear();
  int live = 0;
  int sync_measured = 0, sync_apart = 0;  // ranks reporting wait/other; ...mostly with calls
  for (int r = 0; r < n; ++r) {
    RankStats& st = ranks[r];
    const int g = group_index[r];
    if (raw_speeds[r] > 0) {
      st.speed = raw_speeds[r];
      if (std::abs(st.speed - 1.0) < group_band[g]) st.speed = 1.0;
    }
    b.conditions.gpu_speed[r] = st.speed;
    b.rank_compute_ms[r] = st.compute.value();
    if (o.compute_standard_errors) b.rank_compute_se_ms[r] = st.compute.standard_error();
    b.rank_fixed_ms[r] = st.fixed.value();
    b.rank_steps_per_s[r] = st.wall.value() > 0 ? 1000.0 / st.wall.value() : 0.0;
    b.rank_lateness_ms[r] = st.lateness_ms;
    b.rank_wait_ms[r] = st.waited_ms;
    if (st.sync_share >= 0) {
      ++sync_measured;
      if (st.sync_share > 0.5) ++sync_apart;
    }
    b.rank_queue_depth[r] = st.queue;
    const bool lost = st.liveness == Liveness::lost;
    // A rank is flagged once its speed stayed past the threshold for `confirm_steps` closed
    // steps in a row (and cleared likewise): a passing hiccup is not a slow rank.
    const bool past =
        st.slow ? (lost || st.speed > o.recovered_speed) : (!lost && st.speed < o.slow_speed);
    st.past_steps = past ? st.past_steps + 1 : 0;
    const bool confirmed = lost || st.past_steps >= std::max(1, o.confirm_steps);
    if (!st.slow && past && confirmed) {
      st.past_steps = 0;
      st.slow = true;
      ++counters.slow_rank_events;
      char text[320];
      std::snprintf(
          text, sizeof text,
          "compute-only %.2f ms%s vs peer median %.2f ms (%.2fx slower); arrives %.1f ms "
          "after the median rank at the collective; waits %.1f ms in it vs median %.1f ms",
          st.compute.value(), per_sample ? " per sample" : "", reference[g], 1.0 / st.speed,
          st.lateness_ms, st.last_wait_ms, median_wait_ms());
      events.push_back({MonitorEvent::Kind::slow_rank, r, -1, st.speed, step, now, text});
    } else if (st.slow && past && confirmed) {
      st.past_steps = 0;
      st.slow = false;
      char text[160];
      std::snprintf(text, sizeof text, "compute-only %.1f ms vs peer median %.1f ms",
                    st.compute.value(), has_reference[g] ? reference[g] : 0.0);
      events.push_back({MonitorEvent::Kind::rank_recovered, r, -1, st.speed, step, now, text});
    }
    if (lost) {
      if (b.conditions.gpu_failed.empty()) b.conditions.gpu_failed.assign(n, false);
      b.conditions.gpu_failed[r] = true;
    }
    live += st.liveness == Liveness::live;
    if (st.slow) b.slow_ranks.push_back(r);
  }
  b.fixed_apart = sync_measured > 0 && 2 * sync_apart > sync_measured;
  return live;
}

// Each node's bandwidth relative to its peer group, and the congestion and recovery events it
// raises crossing the thresholds.
void Monitor::State::update_node_beliefs(uint64_t step, Clock::time_point now) {
  // Bandwidth: each node's median over its ranks, relative to the median node of its peer group
  // (the group of its first rank: nodes of another GPU type have other NICs).
  const int n = o.ranks;
  Beliefs& b = beliefs;
  std::pair<int, double>* const items = group_items.data();
  size_t count = 0;
  node_level.assign(nodes, 0.0);
  auto node_group = [&](int node) { return group_index[std::min(n - 1, node * o.gpus_per_node)]; };
  // A node's rates are written in place, at most one per rank of the node.
  node_rates.resize(o.gpus_per_node);
  double* const rates = node_rates.data();
  for (int node = 0; node < nodes; ++node) {
    double* rates_end = rates;
    for (int r = node * o.gpus_per_node; r < std::min(n, (node + 1) * o.gpus_per_node); ++r) {
      if (ranks[r].liveness != Liveness::lost && ranks[r].bandwidth.count() >= o.min_samples) {
        *rates_end++ = ranks[r].bandwidth.value();
      }
    }
    if (rates_end != rates) {
      node_level[node] = median_in_place(rates, rates_end);
      items[count++] = {node_group(node), node_level[node]};
    }
  }
  // The upper median (the faster middle node), as for speed: of two nodes, a congested one must
  // not drag its own reference halfway down.
  group_medians(items, count, group_count, true, group_fill, values, group_reference,
                has_reference);
  for (int node = 0; node < nodes; ++node) {
    const int g = node_group(node);
    const double ref = has_reference[g] ? group_reference[g] : 0.0;
    if (node_level[node] > 0 && ref > 0) {
      node_bw[node] = std::clamp(node_level[node] / ref, 0.01, 1.5);
      if (std::abs(node_bw[node] - 1.0) < o.dead_band) node_bw[node] = 1.0;
    }
    b.conditions.node_inter_bw[node] = node_bw[node];
    if (!node_congested[node] && node_bw[node] < o.congested_bw) {
      node_congested[node] = true;
      ++counters.congestion_events;
      char text[200];
      std::snprintf(text, sizeof text,
                    "network transfer %.2f GB/s (collective time minus wait for the last arrival) "
                    "vs median peer node %.2f GB/s",
                    node_level[node], ref);
      events.push_back(
          {MonitorEvent::Kind::congested_link, -1, node, node_bw[node], step, now, text});
    } else if (node_congested[node] && node_bw[node] > o.recovered_bw) {
      node_congested[node] = false;
      events.push_back({MonitorEvent::Kind::link_recovered, -1, node, node_bw[node], step, now,
                        "network transfer back to the median peer node's"});
    }
  }
  b.congested_nodes.clear();
  for (int node = 0; node < nodes; ++node) {
    if (node_congested[node]) b.congested_nodes.push_back(node);
  }
}

// The gradient all-reduce's link from the last closed step's figures: its levels, its
// reference while normal, and the slow-link and restored events (monitor.h, "Slow link").
void Monitor::State::update_link_beliefs(uint64_t step, Clock::time_point now) {
  Link& l = link;
  if (!l.wait.add(step_link_wait)) ++counters.outliers;
  if (!l.bytes.add(step_link_bytes)) ++counters.outliers;
  l.compute.add(step_link_compute);
  if (l.wait.count() < o.min_samples || l.bytes.count() < o.min_samples) return;
  const double wait_ms = std::max(l.wait.value(), 1e-3);
  const double bytes = l.bytes.value();
  const double bw = bytes / wait_ms / 1e3;  // bytes per ms -> MB/s
  Beliefs& b = beliefs;
  b.dp_bytes = bytes;
  b.dp_link_ms = l.wait.value();
  b.dp_bandwidth = bw;
  const bool below = l.reference > 0 && bw < o.congested_bw * l.reference;
  if (!l.slow && !below) {
    // Normal: the reference follows the measured bandwidth, and the noise it was measured with.
    l.reference = l.reference > 0 ? 0.9 * l.reference + 0.1 * bw : bw;
    l.reference_spread = l.wait.spread();
    l.reference_compute = l.compute.value();
  }
  b.dp_reference = l.reference;
  b.dp_explained_ms = l.reference > 0 ? bytes / l.reference / 1e3 : 0.0;
  b.dp_noise_ms = std::max(o.dead_band_deviations * l.reference_spread, o.dead_band * wait_ms);
  const double excess_ms = l.wait.value() - b.dp_explained_ms;
  char text[320];
  if (!l.slow && below && excess_ms > b.dp_noise_ms) {
    l.slow = true;
    ++counters.congestion_events;
    std::snprintf(text, sizeof text,
                  "gradient all-reduce: the last rank to arrive waits %.1f ms a step for %.0f KB "
                  "(%.1f MB/s) vs %.1f MB/s before: the bytes explain %.1f ms, %.1f ms more is "
                  "beyond the noise bound of %.1f ms; median compute %.2f ms vs %.2f ms before",
                  l.wait.value(), bytes / 1e3, bw, l.reference, b.dp_explained_ms, excess_ms,
                  b.dp_noise_ms, l.compute.value(), l.reference_compute);
    events.push_back({MonitorEvent::Kind::slow_link, -1, -1, bw / l.reference, step, now, text});
  } else if (l.slow && bw > o.recovered_bw * l.reference) {
    l.slow = false;
    std::snprintf(text, sizeof text,
                  "gradient all-reduce: %.1f MB/s (%.0f KB in %.1f ms) vs %.1f MB/s before the "
                  "slowdown",
                  bw, bytes / 1e3, l.wait.value(), l.reference);
    events.push_back(
        {MonitorEvent::Kind::link_restored, -1, -1, bw / l.reference, step, now, text});
  }
  b.slow_link = l.slow;
}

void Monitor::State::refresh_beliefs(uint64_t step, int missing, int expected_count) {
  const int n = o.ranks;
  const Clock::time_point now = Clock::now();
  measure_speeds();
  const int live = update_rank_beliefs(step, now);
  update_node_beliefs(step, now);
  if (step_link_valid) update_link_beliefs(step, now);
  Beliefs& b = beliefs;
  b.live_ranks = any_connected ? live : n;
  b.missing_fraction = expected_count > 0 ? static_cast<double>(missing) / expected_count : 0.0;
  b.last_closed_step = step;
  b.any_closed = true;
}

void Monitor::rank_connected(int rank) {
  std::lock_guard lock(mutex_);
  if (rank < 0 || rank >= s_->o.ranks) return;
  s_->any_connected = true;
  s_->set_liveness(rank, Liveness::live);
  if (!s_->beliefs.conditions.gpu_failed.empty()) s_->beliefs.conditions.gpu_failed[rank] = false;
}

void Monitor::rank_lost(int rank) {
  std::lock_guard lock(mutex_);
  if (rank < 0 || rank >= s_->o.ranks) return;
  RankStats& st = s_->ranks[rank];
  if (st.liveness == Liveness::lost) return;
  s_->set_liveness(rank, Liveness::lost);
  if (s_->beliefs.conditions.gpu_failed.empty()) {
    s_->beliefs.conditions.gpu_failed.assign(s_->o.ranks, false);
  }
  s_->beliefs.conditions.gpu_failed[rank] = true;
  s_->events.push_back({MonitorEvent::Kind::rank_lost, rank, -1, 0, s_->newest, Clock::now(),
                        "disconnected from the bus"});
}

void Monitor::layout_changed(std::vector<int> peer_group) {
  std::lock_guard lock(mutex_);
  if (!peer_group.empty()) {
    assert(static_cast<int>(peer_group.size()) == s_->o.ranks);  // precondition
    s_->o.peer_group = std::move(peer_group);
    s_->index_groups();
  }
  for (RankStats& st : s_->ranks) {
    st.compute.reset();
    st.fixed.reset();
    st.bandwidth.reset();
    st.wall.reset();
  }
}

Beliefs Monitor::beliefs() const {
  std::lock_guard lock(mutex_);
  return s_->beliefs;
}

MonitorCounters Monitor::counters() const {
  std::lock_guard lock(mutex_);
  return s_->counters;
}

std::vector<MonitorEvent> Monitor::take_events() {
  std::lock_guard lock(mutex_);
  std::vector<MonitorEvent> out;
  out.swap(s_->events);
  return out;
}

uint64_t Monitor::newest_step() const {
  std::lock_guard lock(mutex_);
  return s_->newest;
}

}  // namespace parapilot::monitor
