#include "env/sim/sim_env.h"

#include <algorithm>
#include <cmath>

#include "env/observation.h"
#include "core/error.h"

namespace parapilot::env {

namespace {

// The gradient regime of interval t; -1 when compression is not modelled.
int regime_at(const Truth& truth, int t) {
  return truth.gradient_regimes.empty() ? -1 : truth.gradient_regime[t];
}

// The statistics of a regime (empty for -1).
const GradientStats& gradients_of(const Truth& truth, int regime) {
  static const GradientStats kNone;
  return regime < 0 ? kNone : truth.gradient_regimes[regime];
}

// Appends the bytes of a value to a key: keys compare exactly, not within a rounding.
template <class T>
void put(std::string& key, const T& value) {
  key.append(reinterpret_cast<const char*>(&value), sizeof value);
}

// Appends conditions to a key exactly: each vector's size and its entries other than nominal.
void put_conditions(std::string& key, const Conditions& c) {
  auto sparse = [&](const std::vector<double>& v) {
    put(key, v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] != 1.0) {
        put(key, i);
        put(key, v[i]);
      }
    }
  };
  sparse(c.gpu_speed);
  sparse(c.node_inter_bw);
  sparse(c.node_intra_bw);
  put(key, c.gpu_failed.size());
  for (size_t i = 0; i < c.gpu_failed.size(); ++i) {
    if (c.gpu_failed[i]) put(key, i);
  }
}

// What interval t's true best layout depends on, exactly: its conditions, workload and gradient
// regime (the regimes' statistics are the scenario's, the same in every episode).
std::string interval_key(const Truth& truth, int t) {
  std::string key;
  put(key, truth.seq_len[t]);
  put(key, truth.global_batch[t]);
  put(key, regime_at(truth, t));
  put_conditions(key, truth.conditions[t]);
  return key;
}

// OracleResult::truth_changed: per interval, whether its key differs from the interval before's;
// interval 0 whether its conditions differ from the nominal cluster's (its workload is its own).
std::vector<bool> truth_changes(const Truth& truth) {
  const int H = static_cast<int>(truth.conditions.size());
  std::vector<bool> changed(H, false);
  if (H == 0) return changed;
  std::string first, nominal;
  put_conditions(first, truth.conditions[0]);
  put_conditions(nominal, Conditions{});
  changed[0] = first != nominal;
  std::string before = interval_key(truth, 0);
  for (int t = 1; t < H; ++t) {
    std::string key = interval_key(truth, t);
    changed[t] = key != before;
    before = std::move(key);
  }
  return changed;
}

// The same layout run at another global batch (a batch ramp changes the batch under a running
// layout): uniform shares when the batch divides evenly, trying smaller microbatches first;
// otherwise shares proportional to the old ones (largest remainder, whole microbatches).
// nullopt when no legal variant exists.
std::optional<Strategy> with_global_batch(const Strategy& s, int batch, const ModelSpec& model,
                                          const ClusterSpec& cluster) {
  if (s.global_batch == batch) return s;
  auto legal = [&](const Strategy& r) { return !find_problem(r, model, cluster); };
  if (s.dp_shares.empty()) {
    for (int mb = s.microbatch_size; mb >= 1; --mb) {
      if (s.microbatch_size % mb != 0 || batch % (mb * s.dp) != 0) continue;
      Strategy r = s;
      r.global_batch = batch;
      r.microbatch_size = mb;
      if (legal(r)) return r;
    }
  }
  const std::vector<int> old = s.shares();
  double old_total = 0;
  for (int share : old) old_total += share;
  for (int mb = s.microbatch_size; mb >= 1; --mb) {
    if (s.microbatch_size % mb != 0) continue;
    const int unit = mb * (s.schedule == Schedule::kInterleaved ? s.pp : 1);
    if (batch % unit != 0 || batch / unit < s.dp) continue;
    const int units = batch / unit;
    // Every replica keeps one unit; the rest is shared in proportion to the old shares.
    std::vector<int> shares(s.dp, 1);
    std::vector<std::pair<double, int>> remainder;
    int given = s.dp;
    for (int r = 0; r < s.dp; ++r) {
      const double want = (units - s.dp) * old[r] / old_total;
      const int whole = static_cast<int>(want);
      shares[r] += whole;
      given += whole;
      remainder.emplace_back(-(want - whole), r);
    }
    std::sort(remainder.begin(), remainder.end());
    for (int i = 0; given < units; ++i, ++given) ++shares[remainder[i % s.dp].second];
    Strategy r = s;
    r.global_batch = batch;
    r.microbatch_size = mb;
    r.dp_shares.clear();
    for (int share : shares) r.dp_shares.push_back(share * unit);
    if (legal(r)) return r;
  }
  return std::nullopt;
}

}  // namespace

SimEnv::SimEnv(Scenario scenario, std::string id)
    : scenario_(std::move(scenario)), id_(std::move(id)) {
  global_batch_ = final_global_batch(scenario_);
  scenario_.space.global_batch = global_batch_;
  planner_for(scenario_.model.seq_len);
}

SimEnv::SimEnv(Scenario scenario, std::string id, Truth recorded, bool follows_scenario)
    : SimEnv(std::move(scenario), std::move(id)) {
  scenario_.horizon = static_cast<int>(recorded.conditions.size());
  recorded_ = std::move(recorded);
  follows_scenario_ = follows_scenario;
}

const PlanningView* SimEnv::planning_view() const {
  return follows_scenario_ ? this : nullptr;
}

std::optional<int> SimEnv::intervals_left() const {
  if (!run_length_known_) return std::nullopt;
  return scenario_.horizon - t_;
}

double SimEnv::tokens_per_s(const Strategy& s, const Conditions& c) const {
  // The workload the job runs now: the interval's sequence length and batch, which the job
  // knows, and the gradient statistics the monitor has measured.
  const int t = std::min(t_, scenario_.horizon - 1);
  return tokens_per_s_at(s, c, planners_.at(truth_.seq_len[t])->cost_model(),
                         truth_.global_batch[t], measured_regime());
}

double SimEnv::tokens_per_s_at(const Strategy& s, const Conditions& c, const CostModel& cost,
                               int batch, int regime) const {
  CostBreakdown b;
  if (s.global_batch == batch) {
    b = cost.evaluate(s, c);
  } else {
    const std::optional<Strategy> rebatched =
        with_global_batch(s, batch, scenario_.model, scenario_.cluster);
    if (!rebatched) return 0.0;
    b = cost.evaluate(*rebatched, c);
  }
  if (!b.feasible || !b.fits_in_memory) return 0.0;
  if (regime < 0) return b.tokens_per_s;
  return b.tokens_per_s * convergence_efficiency(s, scenario_.model.layers,
                                                 gradients_of(truth_, regime),
                                                 scenario_.phase.convergence_penalty);
}

const GradientStats& SimEnv::true_gradients(int t) const {
  return gradients_of(truth_, regime_at(truth_, t));
}

int SimEnv::measured_regime() const {
  return regime_at(truth_,
                   std::clamp(t_ - scenario_.telemetry.delay_intervals, 0, scenario_.horizon - 1));
}

const GradientStats& SimEnv::measured_gradients() const {
  return gradients_of(truth_, measured_regime());
}

const Planner& SimEnv::planner_for(int seq_len) {
  auto it = planners_.find(seq_len);
  if (it == planners_.end()) {
    ModelSpec model = scenario_.model;
    model.seq_len = seq_len;
    const PlannerOptions options{scenario_.switch_pause_s};
    it = planners_.emplace(seq_len, std::make_unique<Planner>(model, scenario_.cluster, options))
             .first;
  }
  return *it->second;
}

PlanResult SimEnv::plan(const Conditions& c, int seq_len, int global_batch, const GradientStats& g,
                        const std::optional<Strategy>& current, int top_k) {
  // The candidates depend on the running layout only through its kernel settings
  // (strategy/planner.h): a plan is kept by its request without the layout, and its migration
  // costs are worked out again for the layout at hand.
  const Strategy kernels = current.value_or(Strategy{});
  std::string key;
  put(key, seq_len);
  put(key, global_batch);
  put(key, top_k);
  put(key, kernels.attention);
  put(key, kernels.fp8);
  put(key, kernels.tp_comm_overlap);
  put(key, kernels.overlap_param_gather);
  put(key, kernels.overlap_grad_reduce);
  put(key, g.topk_ratio);
  put(key, g.powersgd_rank);
  put(key, g.fp16_error);
  put(key, g.error_budget);
  for (const std::vector<double>* v : {&g.topk_energy, &g.lowrank_residual}) {
    put(key, v->size());
    key.append(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(double));
  }
  put_conditions(key, c);
  auto it = plan_cache_.find(key);
  if (it == plan_cache_.end()) {
    if (plan_cache_.size() >= kPlanCacheEntries) plan_cache_.clear();
    it = plan_cache_.emplace(std::move(key), search(c, seq_len, global_batch, g, current, top_k))
             .first;
    return it->second;
  }
  PlanResult result = it->second;
  const Planner& planner = planner_for(seq_len);
  if (current) {
    planner.price_migrations(*current, result.candidates, c);
  } else {
    for (Candidate& cand : result.candidates) cand.migration_bytes = cand.migration_s = 0;
  }
  result.current.reset();
  if (current) result.current = Candidate{*current, planner.cost_model().evaluate(*current, c), 0, 0};
  return result;
}

PlanResult SimEnv::search(const Conditions& c, int seq_len, int global_batch,
                          const GradientStats& g, const std::optional<Strategy>& current,
                          int top_k) {
  PlanRequest request;
  request.conditions = c;
  request.gradients = g;
  request.space = scenario_.space;
  request.space.global_batch = global_batch;
  request.current = current;
  request.top_k = top_k;
  // While the gradients admit top-k or PowerSGD the planner also compresses each family's best
  // plain all-reduce (ZeRO-0) layout; compression is tried on the leaders only, so it ranks
  // enough of those even for a top-1 search.
  request.zero0_top_k = kMaxCandidates + 1;
  try {
    return planner_for(seq_len).plan(request);
  } catch (const InputError&) {
    return PlanResult{};  // nothing can run (e.g. every GPU is lost): the job stalls
  }
}

double SimEnv::true_tokens_per_s(const Strategy& s, int t) {
  return tokens_per_s_at(s, truth_.conditions[t], planner_for(truth_.seq_len[t]).cost_model(),
                         truth_.global_batch[t], regime_at(truth_, t));
}

double SimEnv::best_tokens_per_s(int t) {
  const std::string key = interval_key(truth_, t);
  auto it = best_cache_.find(key);
  if (it != best_cache_.end()) return it->second;
  // Only the best layout matters here: a top-1 search prunes hardest. The planner keeps
  // compression within the true error budget, so its best layout loses no progress.
  const PlanResult r = plan(truth_.conditions[t], truth_.seq_len[t], truth_.global_batch[t],
                            true_gradients(t), std::nullopt, 1);
  const double best = r.candidates.empty() ? 0.0 : r.candidates.front().cost.tokens_per_s;
  // A pure function of the key: kept across episodes, only bounded in size.
  if (best_cache_.size() >= kBestCacheEntries) best_cache_.clear();
  best_cache_.emplace(key, best);
  return best;
}

StatusOr<Observation> SimEnv::reset(uint64_t seed, const ResetOptions& options) {
  truth_ = recorded_ ? *recorded_ : generate_truth(scenario_, seed);
  if (truth_.global_batch.empty()) truth_.global_batch.assign(scenario_.horizon, global_batch_);
  rng_.seed(seed ^ 0xA5A5A5A5DEADBEEFULL);
  run_length_known_ =
      std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < scenario_.run_length_known_prob;
  t_ = 0;
  target_.reset();
  staging_left_s_ = 0;
  pause_left_s_ = 0;
  last_migration_ = -1;
  telemetry_age_ = 0;
  missing_fraction_ = 0;
  previous_min_speed_ = previous_min_bw_ = 1;
  history_.reset();
  belief_ = Conditions{};
  monitor_beliefs_ = monitor::Beliefs{};
  {
    const ClusterTopology& topo = planner_for(scenario_.model.seq_len).cost_model().topology();
    monitor::MonitorOptions mo = monitor::options_for(topo);
    // A step closes once a rank reported the next one: with a few steps per interval and
    // samples missing, waiting longer would hold beliefs back a whole interval.
    mo.close_lag_steps = 1;
    // The last episode's monitor goes first, so that the new one reuses its memory.
    monitor_.reset();
    monitor_ = std::make_unique<monitor::Monitor>(mo);
    for (int g = 0; g < topo.num_gpus(); ++g) monitor_->rank_connected(g);
  }
  telemetry_.reset();
  in_flight_.clear();
  clock_ns_ = 0;

  // The layout a team picks before the run: the best plan for the nominal cluster, or pure
  // data parallel with equal shares.
  // A team plans for the run's full batch; a batch ramp runs that layout at smaller batches.
  const int full_batch = *std::max_element(truth_.global_batch.begin(), truth_.global_batch.end());
  const PlanResult nominal =
      plan(Conditions{}, scenario_.model.seq_len, full_batch, true_gradients(0), std::nullopt);
  if (nominal.candidates.empty()) {
    return Status::invalid_argument("scenario " + scenario_.name +
                                    ": no layout fits this model on this cluster");
  }
  planned_initial_ = nominal.candidates.front().strategy;
  {
    Strategy dp;
    dp.dp = scenario_.cluster.num_gpus();
    dp.global_batch = truth_.global_batch[0];
    dp.zero = 1;
    dp.microbatch_size = 1;
    dp.recompute = scenario_.space.recompute.empty() ? Recompute::kSelective
                                                     : scenario_.space.recompute.front();
    if (find_problem(dp, scenario_.model, scenario_.cluster)) {
      return Status::invalid_argument("scenario " + scenario_.name +
                                      ": pure data parallel is not legal here");
    }
    uniform_dp_ = dp;
  }
  if (options.initial_layout == "uniform-dp") {
    initial_ = uniform_dp_;
  } else if (options.initial_layout == "planned") {
    initial_ = planned_initial_;
  } else {
    return Status::invalid_argument("unknown initial layout \"" + options.initial_layout +
                                    "\" (planned | uniform-dp)");
  }
  current_ = chosen_ = initial_;
  observe_telemetry();  // failures present from the start are seen at once
  replan_if_needed(true);
  return observation();
}

void SimEnv::emit_telemetry(int t) {
  const CostModel& cost = planner_for(truth_.seq_len[t]).cost_model();
  const Conditions& truth = truth_.conditions[t];
  // The job is down (its layout uses a failed GPU, the one way a layout is infeasible): no
  // steps to report. Without failed GPUs every layout is feasible.
  const bool any_failed =
      std::find(truth.gpu_failed.begin(), truth.gpu_failed.end(), true) != truth.gpu_failed.end();
  if (any_failed && !cost.evaluate(current_, truth).feasible) return;
  if (!telemetry_ || !(telemetry_layout_ == current_)) {
    monitor_->layout_changed(monitor::peer_groups(cost.topology(), current_));
    telemetry_.emplace(cost, current_);
    telemetry_layout_ = current_;
  }
  const TelemetryModel& m = scenario_.telemetry;
  std::vector<monitor::StepSample> all = std::move(spare_samples_);
  all.clear();
  for (int k = 0; k < m.steps_per_interval; ++k) {
    // Each sample of the step goes missing with missing_prob.
    const double ms =
        telemetry_->generate(truth, static_cast<uint64_t>(t) * m.steps_per_interval + k, clock_ns_,
                             m.noise, rng_, all, nullptr, m.missing_prob);
    clock_ns_ += static_cast<uint64_t>(ms * 1e6);
  }
  in_flight_.emplace_back(t, std::move(all));
}

void SimEnv::observe_telemetry() {
  // Samples of an interval arrive `delay` intervals after it began; failures are seen at once
  // (the job crashes or the GPU drops out of the collective).
  previous_min_speed_ =
      belief_.gpu_speed.empty()
          ? 1.0
          : *std::min_element(belief_.gpu_speed.begin(), belief_.gpu_speed.end());
  previous_min_bw_ =
      belief_.node_inter_bw.empty()
          ? 1.0
          : *std::min_element(belief_.node_inter_bw.begin(), belief_.node_inter_bw.end());
  const Conditions& now = truth_.conditions[std::min(t_, scenario_.horizon - 1)];
  for (int g = 0; g < scenario_.cluster.num_gpus(); ++g) {
    if (now.failed(g) != belief_.failed(g)) {
      if (now.failed(g)) {
        monitor_->rank_lost(g);
      } else {
        monitor_->rank_connected(g);
      }
    }
  }
  const auto arrival = monitor::Clock::now();
  while (!in_flight_.empty() &&
         in_flight_.front().first <= t_ - scenario_.telemetry.delay_intervals) {
    monitor_->ingest(std::move(in_flight_.front().second), arrival);
    spare_samples_ = std::move(in_flight_.front().second);  // emptied: its buffer is reused
    in_flight_.pop_front();
  }
  if (scenario_.telemetry.exact_beliefs) {
    // A perfect estimator: the interval just run as it was, failures as they happen.
    belief_ = t_ > 0 ? truth_.conditions[std::min(t_, scenario_.horizon) - 1] : Conditions{};
    belief_.gpu_failed = now.gpu_failed;
    missing_fraction_ = 0;
    telemetry_age_ = std::min(t_, 1);
  } else {
    monitor_beliefs_ = monitor_->beliefs();
    const monitor::Beliefs& b = monitor_beliefs_;
    belief_ = b.conditions;
    missing_fraction_ = b.any_closed ? b.missing_fraction : 0.0;
    const int S = scenario_.telemetry.steps_per_interval;
    telemetry_age_ = b.any_closed ? t_ - static_cast<int>(b.last_closed_step / S) : t_;
  }
  // Nominal where nothing is believed otherwise: the planner's fast path for empty vectors.
  auto nominal = [](const std::vector<double>& v) {
    return std::all_of(v.begin(), v.end(), [](double x) { return x == 1.0; });
  };
  if (nominal(belief_.gpu_speed)) belief_.gpu_speed.clear();
  if (nominal(belief_.node_inter_bw)) belief_.node_inter_bw.clear();
}

void SimEnv::replan_if_needed(bool force) {
  const int t = std::min(t_, scenario_.horizon - 1);
  const int seq_len = truth_.seq_len[t];
  const int batch = truth_.global_batch[t];
  // The job runs the interval's batch: the running layout follows the ramp (a layout that
  // cannot run it crashes at the next step and is restarted).
  if (current_.global_batch != batch) {
    // From the layout as chosen, so that a ramp keeps its shares and microbatch where the
    // batch allows them.
    if (auto r = with_global_batch(chosen_, batch, scenario_.model, scenario_.cluster)) {
      current_ = *r;
    }
  }
  const int regime = measured_regime();
  const bool changed = force || seq_len != seq_len_at_plan_ || batch != batch_at_plan_ ||
                       regime != regime_at_plan_ ||
                       beliefs_moved(belief_, belief_at_plan_, scenario_.cluster.num_gpus(),
                                     scenario_.cluster.num_nodes());
  if (changed) {
    candidates_ =
        select_candidates(plan(belief_, seq_len, batch, measured_gradients(), current_), current_);
    belief_at_plan_ = belief_;
    seq_len_at_plan_ = seq_len;
    batch_at_plan_ = batch;
    regime_at_plan_ = regime;
  }
  current_belief_cost_ = planner_for(seq_len).cost_model().evaluate(current_, belief_);
}

StepResult SimEnv::step(int action) {
  StepResult result;
  const int t = t_;
  const double interval = scenario_.interval_s;
  double time = 0, tokens = 0;
  double tps = true_tokens_per_s(current_, t);
  if (tps == 0) {
    // The layout crashed: restart from the last checkpoint on the best plan that avoids the
    // failed GPUs (what an operator does), losing restart_s.
    Conditions known = belief_;
    known.gpu_failed = truth_.conditions[t].gpu_failed;
    const PlanResult r =
        plan(known, truth_.seq_len[t], truth_.global_batch[t], measured_gradients(), std::nullopt);
    if (!r.candidates.empty()) current_ = chosen_ = r.candidates.front().strategy;
    target_.reset();
    pause_left_s_ = 0;
    time = std::min(interval, scenario_.restart_s);
    tps = true_tokens_per_s(current_, t);
    result.info.restarted = true;
    last_migration_ = t;
  }
  if (action >= 1 && action <= kMaxCandidates &&
      action - 1 < static_cast<int>(candidates_.size()) && !target_ && !result.info.restarted) {
    const Candidate& c = candidates_[action - 1];
    target_ = c.strategy;
    staging_left_s_ = std::max(0.0, c.migration_s - scenario_.switch_pause_s);
    result.info.migration_started = true;
  }
  double remaining = run_pause(pause_left_s_, interval - time);
  if (target_) {
    const StagedInterval staged =
        stage_switch(staging_left_s_, remaining, scenario_.switch_pause_s);
    tokens += tps * (1.0 - scenario_.staging_slowdown) * staged.staged_s;
    remaining = staged.rest_s;
    if (staged.committed) {
      pause_left_s_ = staged.pause_left_s;
      current_ = chosen_ = *target_;
      if (auto r = with_global_batch(current_, truth_.global_batch[t], scenario_.model,
                                     scenario_.cluster)) {
        current_ = *r;
      }
      target_.reset();
      tps = true_tokens_per_s(current_, t);
      result.info.migration_committed = true;
      last_migration_ = t;
    }
  }
  tokens += tps * remaining;

  emit_telemetry(t);
  if (recording_) record_interval(t);
  const double best = best_tokens_per_s(t) * interval;
  result.info.tokens = tokens;
  result.info.best_tokens = best;
  result.info.tokens_per_s = tokens / interval;
  result.info.interval = t;
  result.reward = best > 0 ? tokens / best : 0.0;

  ++t_;
  result.truncated = t_ >= scenario_.horizon;
  if (!result.truncated) {
    observe_telemetry();
    replan_if_needed(result.info.migration_committed || result.info.restarted);
  }
  result.observation = observation();
  return result;
}

void SimEnv::record_interval(int t) {
  const CostModel& cost = planner_for(truth_.seq_len[t]).cost_model();
  const Conditions& truth = truth_.conditions[t];
  const CostBreakdown b = cost.evaluate(current_, truth);
  if (!b.feasible) return;  // the job is down this interval: no step to report
  // Per-chunk compute of one microbatch at nominal speed (replicas are alike at nominal).
  const PipelineTimings nominal = cost.pipeline_timings(current_, Conditions{});
  const Strategy& s = current_;
  const std::vector<int> shares = s.shares();
  const double start = t * scenario_.interval_s;
  for (int r = 0; r < s.dp; ++r) {
    for (int p = 0; p < s.pp; ++p) {
      double speed = 1.0;
      for (int i = 0; i < s.tp; ++i) speed = std::min(speed, truth.speed(s.gpu_of_rank(r, p, i)));
      double per_microbatch = 0;
      for (int k = 0; k < s.virtual_stages; ++k) {
        const int chunk = k * s.pp + p;
        per_microbatch += nominal.forward_s[chunk] + nominal.backward_s[chunk];
      }
      trace::TelemetrySample x;
      x.rank = r * s.pp + p;
      x.dp_rank = r;
      x.stage = p;
      x.step = t;
      x.start_s = start;
      x.end_s = start + b.iteration_time_s;
      x.microbatches = shares[r] / s.microbatch_size;
      x.compute_ms = 1e3 * x.microbatches * per_microbatch / std::max(speed, 1e-6);
      x.dp_comm = {1e3 * b.dp_comm_s, 0};
      x.pp_comm = {1e3 * b.pp_comm_s, 0};
      x.tp_comm = {1e3 * b.tp_comm_s, 0};
      recording_->push_back(x);
    }
  }
}

Observation SimEnv::observation() {
  const int H = scenario_.horizon;
  ObservationInputs in;
  in.beliefs = &belief_;
  in.gpus = scenario_.cluster.num_gpus();
  in.nodes = scenario_.cluster.num_nodes();
  in.previous_min_speed = previous_min_speed_;
  in.previous_min_bw = previous_min_bw_;
  in.telemetry_age_intervals = telemetry_age_;
  in.missing_fraction = missing_fraction_;
  in.current = &current_;
  in.current_cost = current_belief_cost_;
  in.candidates = &candidates_;
  in.interval = t_;
  in.horizon = H;
  in.remaining_intervals = run_length_known_ ? H - t_ : kUnknownRemaining;
  in.last_migration = last_migration_;
  in.staging = target_.has_value();
  in.staging_left_s = staging_left_s_;
  in.interval_s = scenario_.interval_s;
  in.seq_len_ratio =
      static_cast<double>(truth_.seq_len[std::min(t_, H - 1)]) / scenario_.model.seq_len;
  in.staging_slowdown = scenario_.staging_slowdown;
  in.switch_pause_s = scenario_.switch_pause_s;
  Observation o = build_observation(in);
  history_.annotate(o);
  return o;
}

std::optional<OracleResult> SimEnv::oracle() {
  // Layouts worth considering: the start layouts any policy may begin on (the oracle starts
  // on the planned one) and the best plans under every distinct true condition.
  const int H = scenario_.horizon;
  std::vector<Strategy> layouts = {planned_initial_};
  if (!(uniform_dp_ == planned_initial_)) layouts.push_back(uniform_dp_);
  std::map<std::string, bool> seen;
  for (int t = 0; t < H; ++t) {
    if (!seen.emplace(interval_key(truth_, t), true).second) continue;
    const PlanResult r = plan(truth_.conditions[t], truth_.seq_len[t], truth_.global_batch[t],
                              true_gradients(t), std::nullopt);
    for (const Candidate& c : r.candidates) {
      // true_tokens_per_s runs each layout at every interval's batch of a ramp.
      if (std::find(layouts.begin(), layouts.end(), c.strategy) == layouts.end()) {
        layouts.push_back(c.strategy);
      }
    }
  }
  const int L = static_cast<int>(layouts.size());
  std::vector<double> switch_s(static_cast<size_t>(L) * L, 0);
  const Planner& base = planner_for(scenario_.model.seq_len);
  for (int a = 0; a < L; ++a) {
    for (int b = 0; b < L; ++b) {
      if (a != b) switch_s[a * L + b] = base.migration(layouts[a], layouts[b]).time_s;
    }
  }
  // value[l]: most tokens so far ending interval t on layout l; choice for backtracking.
  const double interval = scenario_.interval_s;
  const double pause = scenario_.switch_pause_s;
  std::vector<double> value(L, -1e300), next(L);
  std::vector<std::vector<int>> from(H, std::vector<int>(L, -1));
  std::vector<std::vector<double>> gained(H, std::vector<double>(L, 0));
  std::vector<double> tps(L);
  for (int t = 0; t < H; ++t) {
    for (int l = 0; l < L; ++l) tps[l] = true_tokens_per_s(layouts[l], t);
    for (int b = 0; b < L; ++b) {
      double best = -1e300;
      int arg = -1;
      double best_gain = 0;
      for (int a = 0; a < L; ++a) {
        // The episode may start on either start layout (entries 0 and, when distinct, 1).
        const bool start_layout = a == 0 || (a == 1 && !(uniform_dp_ == planned_initial_));
        const double before = t == 0 ? (start_layout ? 0.0 : -1e300) : value[a];
        if (before <= -1e299) continue;
        double g;
        if (a == b) {
          g = tps[b] * interval;
        } else {
          const double staging = std::max(0.0, switch_s[a * L + b] - pause);
          const double stage = std::min(staging, interval);
          const double rest = std::max(0.0, interval - stage - pause);
          // A pause the interval has no room for stops the next ones: charged here, at this
          // interval's rate of the new layout.
          const double overflow = stage < interval ? std::max(0.0, stage + pause - interval) : 0;
          g = tps[a] * (1 - scenario_.staging_slowdown) * stage + tps[b] * rest -
              tps[b] * overflow;
        }
        if (before + g > best) {
          best = before + g;
          arg = a;
          best_gain = g;
        }
      }
      next[b] = best;
      from[t][b] = arg;
      gained[t][b] = best_gain;
    }
    value = next;
  }
  int l = static_cast<int>(std::max_element(value.begin(), value.end()) - value.begin());
  OracleResult out;
  out.truth_changed = truth_changes(truth_);
  out.tokens_per_interval.assign(H, 0);
  for (int t = H - 1; t >= 0; --t) {
    out.tokens_per_interval[t] = gained[t][l];
    const int prev = from[t][l];
    if (prev != l) ++out.migrations;
    l = prev;
  }
  return out;
}

}  // namespace parapilot::env
