#include "agent/deploy/decider.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cmath>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace parapilot::agent::deploy {

Status guardrail_for(const Candidate& target, const CostBreakdown& under_beliefs, bool staging,
                     int intervals_since_commit, int cooldown_intervals) {
  // "a switch is being staged" is also decide()'s reason while staging.
  if (staging) return Status::rejected("a switch is being staged");
  if (intervals_since_commit < cooldown_intervals) {
    return Status::rejected("cool-down after the last switch");
  }
  if (!target.cost.fits_in_memory || !under_beliefs.fits_in_memory) {
    return Status::rejected("target predicted not to fit in memory");
  }
  if (!target.cost.feasible || !under_beliefs.feasible) {
    return Status::rejected("target uses a lost GPU");
  }
  if (!wire_name(target.strategy)) {
    return Status::rejected("target not representable on the bus (wire v1)");
  }
  return {};
}

LoadedPolicy load_policy_or_reactive(const std::string& path, const PolicyLoader& loader) {
  LoadedPolicy out;
  if (path.empty()) {
    out.policy = policy::make_reactive({});
    return out;
  }
  if (!loader) {
    out.fallback =
        Status::unavailable("no learned-policy loader in this build; cannot load " + path);
  } else {
    StatusOr<std::unique_ptr<policy::Policy>> loaded = loader(path);
    if (!loaded.ok()) {
      out.fallback = loaded.status();
    } else if (!*loaded) {
      out.fallback = Status::internal(path + ": the loader returned no policy");
    } else {
      out.policy = std::move(*loaded);
    }
  }
  if (!out.fallback.ok()) out.policy = policy::make_reactive({});
  return out;
}

Decider::Decider(std::shared_ptr<const Job> job, LoadedPolicy policy, DeciderOptions options)
    : job_(std::move(job)),
      policy_(std::move(policy.policy)),
      fallback_(!policy.fallback.ok()),
      o_(std::move(options)) {
  assert(policy_);  // precondition
  if (o_.horizon <= 0) o_.horizon = job_->scenario.horizon;
  if (o_.interval_s <= 0) o_.interval_s = job_->scenario.interval_s;
  current_ = job_->start_layout(o_.initial_layout).value();  // checked by the caller
  policy_->begin_episode();
  plan_now(Conditions{}, current_);
  if (o_.async_planning) planner_ = std::thread([this] { planner_loop(); });
}

Decider::~Decider() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (planner_.joinable()) planner_.join();
}

void Decider::plan_now(const Conditions& beliefs, const Strategy& current) {
  const auto start = std::chrono::steady_clock::now();
  PlanRequest request;
  request.conditions = beliefs;
  request.space = job_->scenario.space;
  request.current = current;
  request.top_k = env::kMaxCandidates + 1;
  auto snap = std::make_shared<Snapshot>();
  snap->current = current;
  snap->beliefs = beliefs;
  try {
    snap->candidates = env::select_candidates(job_->planner->plan(request), current);
  } catch (const InputError&) {
    // Nothing can be planned (e.g. every GPU lost): no candidates, keep.
  }
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::lock_guard lock(mutex_);
  snapshot_ = std::move(snap);
  ++plans_;
  last_plan_ms_ = ms;
}

void Decider::planner_loop() {
  // Planning is background work: let the threads that ingest telemetry and decide run first.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
  std::unique_lock lock(mutex_);
  while (true) {
    cv_.wait(lock, [&] { return stopping_ || plan_requested_; });
    if (stopping_) return;
    plan_requested_ = false;
    planning_ = true;
    const Conditions beliefs = beliefs_.conditions;
    const Strategy current = current_;
    lock.unlock();
    plan_now(beliefs, current);
    lock.lock();
    planning_ = false;
    cv_.notify_all();
  }
}

void Decider::update_beliefs(const monitor::Beliefs& beliefs) {
  std::unique_lock lock(mutex_);
  beliefs_ = beliefs;
  have_beliefs_ = true;
  const bool layout_changed = snapshot_ && !(snapshot_->current == current_);
  if (!layout_changed &&
      !env::beliefs_moved(beliefs.conditions, planned_beliefs_, job_->gpus(), job_->nodes())) {
    return;
  }
  planned_beliefs_ = beliefs.conditions;
  if (o_.async_planning) {
    plan_requested_ = true;
    cv_.notify_all();
    return;
  }
  const Strategy current = current_;
  lock.unlock();
  plan_now(beliefs.conditions, current);
}

void Decider::committed(const Strategy& s) {
  std::unique_lock lock(mutex_);
  current_ = s;
  // The switch landed in the interval the last decision began (the simulator's t): the next
  // decision reads since_last_switch = 1/8, as training does.
  last_migration_ = interval_ - 1;
  since_commit_ = 0;
  planned_beliefs_ = beliefs_.conditions;
  const Conditions beliefs = beliefs_.conditions;
  if (o_.async_planning) {
    plan_requested_ = true;
    cv_.notify_all();
    return;
  }
  lock.unlock();
  plan_now(beliefs, s);
}

void Decider::wait_for_plan() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return stopping_ || (!plan_requested_ && !planning_); });
}

Strategy Decider::current() const {
  std::lock_guard lock(mutex_);
  return current_;
}

std::string Decider::policy_name() const { return policy_->name(); }

long Decider::plans() const {
  std::lock_guard lock(mutex_);
  return plans_;
}

double Decider::last_plan_ms() const {
  std::lock_guard lock(mutex_);
  return last_plan_ms_;
}

namespace {

double min_of(const std::vector<double>& v) {
  return v.empty() ? 1.0 : *std::min_element(v.begin(), v.end());
}

nlohmann::json candidate_json(const Candidate& c, double current_tps) {
  return {{"layout", layout_name(c.strategy)},
          {"tokens_per_s", c.cost.tokens_per_s},
          {"gain", current_tps > 0 ? c.cost.tokens_per_s / current_tps : 0.0},
          {"migration_s", c.migration_s},
          {"memory_gib", c.cost.memory_gib},
          {"fits_in_memory", c.cost.fits_in_memory}};
}

}  // namespace

Decision Decider::decide(uint64_t step, bool staging, double staging_left_s,
                         const std::vector<std::string>& evidence) {
  Decision d;
  d.step = step;
  std::shared_ptr<const Snapshot> snap;
  monitor::Beliefs beliefs;
  Strategy current;
  int last_migration = 0;
  int since_commit = 0;
  double previous_min_speed = 1, previous_min_bw = 1;
  {
    std::lock_guard lock(mutex_);
    d.interval = interval_++;
    snap = snapshot_;
    beliefs = beliefs_;
    current = current_;
    last_migration = last_migration_;
    since_commit = since_commit_++;
    previous_min_speed = previous_min_speed_;
    previous_min_bw = previous_min_bw_;
    previous_min_speed_ = min_of(beliefs.conditions.gpu_speed);
    previous_min_bw_ = min_of(beliefs.conditions.node_inter_bw);
  }
  // Candidates stand only for the layout and the beliefs they were planned under: against a
  // current cost under moved beliefs their predictions would mix two views of the cluster.
  const bool stale = !snap || !(snap->current == current) ||
                     env::beliefs_moved(beliefs.conditions, snap->beliefs, job_->gpus(),
                                        job_->nodes());
  if (!stale) d.candidates = snap->candidates;
  const CostModel& cost = job_->planner->cost_model();
  const CostBreakdown current_cost = cost.evaluate(current, beliefs.conditions);

  env::ObservationInputs in;
  in.beliefs = &beliefs.conditions;
  in.gpus = job_->gpus();
  in.nodes = job_->nodes();
  in.previous_min_speed = previous_min_speed;
  in.previous_min_bw = previous_min_bw;
  {
    const uint64_t per = static_cast<uint64_t>(std::max(1, o_.interval_steps));
    const uint64_t now = (step + 1) / per;  // the boundary after the interval ending at `step`
    const uint64_t newest = beliefs.any_closed ? beliefs.last_closed_step / per : 0;
    in.telemetry_age_intervals =
        static_cast<int>(beliefs.any_closed ? (now > newest ? now - newest : 0) : now);
  }
  in.missing_fraction = beliefs.missing_fraction;
  in.current = &current;
  in.current_cost = current_cost;
  in.candidates = &d.candidates;
  in.interval = d.interval;
  in.horizon = o_.horizon;
  // The fraction of the run left, on the horizon's scale; unknown when no length was given.
  in.remaining_intervals = o_.run_intervals > 0 ? std::max(0, o_.run_intervals - d.interval) * 1.0 *
                                                      o_.horizon / o_.run_intervals
                                                : env::kUnknownRemaining;
  in.last_migration = last_migration;
  in.staging = staging;
  in.staging_left_s = staging_left_s;
  in.interval_s = o_.interval_s;
  in.staging_slowdown = job_->scenario.staging_slowdown;
  in.switch_pause_s = job_->scenario.switch_pause_s;
  d.observation = env::build_observation(in);
  {
    std::lock_guard lock(mutex_);
    history_.annotate(d.observation);
  }

  if (staging) {
    // The simulator ignores actions while a switch is staged, so the policy is not asked: it
    // would read a state it rarely saw (staging outlasting an interval) for nothing.
    d.guardrail = "a switch is being staged";
  } else {
    std::lock_guard lock(policy_mutex_);
    d.policy_action = policy_->act(d.observation);
    d.inputs = policy_->check_inputs(d.observation);
  }
  int action = d.policy_action;
  if (action < 0 || action > env::kMaxCandidates ||
      (action > 0 && !d.observation.mask[action - 1])) {
    if (action != 0) d.guardrail = "masked or invalid action";
    action = 0;
  }
  if (action > 0) {
    const Candidate& c = d.candidates[action - 1];
    d.guardrail = guardrail_for(c, cost.evaluate(c.strategy, beliefs.conditions), staging,
                                since_commit, o_.cooldown_intervals)
                      .message();
    if (!d.guardrail.empty()) action = 0;
  }
  if (stale && d.policy_action != 0 && d.guardrail.empty())
    d.guardrail = "candidates being re-planned";
  d.action = action;
  const double current_tps =
      current_cost.feasible && current_cost.fits_in_memory ? current_cost.tokens_per_s : 0.0;
  if (action > 0) {
    d.target = d.candidates[action - 1];
    d.predicted_gain = current_tps > 0 ? d.target->cost.tokens_per_s / current_tps : 0.0;
    d.migration_s = d.target->migration_s;
  }

  nlohmann::json j;
  j["event"] = "decision";
  j["interval"] = d.interval;
  j["step"] = step;
  j["policy"] = policy_->name();
  j["fallback"] = fallback_;
  j["evidence"] = evidence;
  j["beliefs"] = {{"min_speed", min_of(beliefs.conditions.gpu_speed)},
                  {"min_node_bw", min_of(beliefs.conditions.node_inter_bw)},
                  {"slow_ranks", beliefs.slow_ranks},
                  {"congested_nodes", beliefs.congested_nodes},
                  {"lost_ranks", std::count(beliefs.conditions.gpu_failed.begin(),
                                            beliefs.conditions.gpu_failed.end(), true)},
                  {"missing_fraction", beliefs.missing_fraction}};
  j["current"] = {{"layout", layout_name(current)},
                  {"tokens_per_s", current_tps},
                  {"fits_in_memory", current_cost.fits_in_memory},
                  {"feasible", current_cost.feasible}};
  nlohmann::json cands = nlohmann::json::array();
  for (const Candidate& c : d.candidates) cands.push_back(candidate_json(c, current_tps));
  j["candidates"] = cands;
  j["policy_action"] = d.policy_action;
  j["action"] = d.action;
  j["guardrail"] = d.guardrail;
  j["choice"] = d.target ? nlohmann::json(layout_name(d.target->strategy)) : nlohmann::json("keep");
  j["predicted_gain"] = d.predicted_gain;
  j["migration_s"] = d.migration_s;
  auto names = [](const std::vector<int>& inputs) {
    nlohmann::json out = nlohmann::json::array();
    for (int i : inputs) out.push_back(env::input_name(i));
    return out;
  };
  j["features_clipped"] = names(d.inputs.clipped);
  j["features_unseen"] = names(d.inputs.unseen);
  d.record = std::move(j);
  return d;
}

}  // namespace parapilot::agent::deploy
