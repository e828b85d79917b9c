#include "agent/deploy/agent.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "agent/deploy/metrics.h"
#include "env/dp/shares.h"
#include "env/pp/pipeline_model.h"
#include "env/monitor/robust_stats.h"
#include "core/error.h"

namespace parapilot::agent::deploy {

using env::dp::counts_text;

namespace {

template <class T>
void push_bounded(std::vector<T>& v, T x, size_t cap) {
  if (v.size() >= cap) v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(cap / 10));
  v.push_back(std::move(x));
}

// A data-parallel layout with these samples per rank (a learned job's only knob).
Strategy shares_layout(const std::vector<int>& counts, int global_batch) {
  Strategy s;
  s.dp = static_cast<int>(counts.size());
  s.global_batch = global_batch;
  s.microbatch_size = std::max(1, global_batch / std::max(1, s.dp));
  s.dp_shares = counts;
  return s;
}

// A learned job whose stages can move blocks and whose shares cannot: a pipeline.
bool is_pipeline_job(const transport::JobInfo& info) {
  return (info.capabilities & transport::kCapPipeline) &&
         !(info.capabilities & transport::kCapDpShares);
}

// Why deploy cannot decide for the learned job `info` announces ("" when it can).
std::string learned_job_problem(const transport::JobInfo& info) {
  const std::string who = "rank " + std::to_string(info.rank) + " announced ";
  if (is_pipeline_job(info)) {
    if (info.global_batch < 1) {
      return who + "no global batch for its pipeline: deploy only observes";
    }
    if (info.layers.size() < info.world_size) {
      return who + std::to_string(info.layers.size()) + " blocks for " +
             std::to_string(info.world_size) +
             " pipeline stages: a stage needs a block; deploy only observes";
    }
    return "";
  }
  if (info.global_batch < info.world_size) {
    return who + "global batch " + std::to_string(info.global_batch) + " for " +
           std::to_string(info.world_size) + " ranks: deploy cannot split it and only observes";
  }
  if (!(info.capabilities & transport::kCapDpShares)) {
    return "the job cannot switch batch shares or pipeline stages: deploy only observes";
  }
  return "";
}

}  // namespace

struct DeployAgent::Impl {
  AgentOptions o;
  std::unique_ptr<monitor::Monitor> monitor_owner;
  std::atomic<monitor::Monitor*> monitor{nullptr};  // set once (at start, or at a learned job's JobInfo)
  std::unique_ptr<Decider> decider;
  std::unique_ptr<env::dp::DataParallelDecider> dp;  // a learned job, once known
  // The learned job is a pipeline (dp's split: blocks per stage); read by prepare_switch on
  // any thread.
  std::atomic<bool> pipeline{false};
  std::unique_ptr<policy::Policy> dp_policy;  // decides for a learned job (under decide_mutex)
  std::unique_ptr<transport::PlanExecutor> executor;
  // The layout of each plan in flight, by plan id (prepare_switch, on_outcome).
  std::mutex targets_mutex;
  std::map<uint64_t, Strategy> targets;
  std::unique_ptr<transport::Server> server;
  std::unique_ptr<MetricsHttpServer> metrics;
  std::thread ticker;
  std::atomic<bool> stopping{false};
  std::atomic<bool> stopped{false};

  mutable std::mutex mutex;  // guards the fields below
  std::unordered_map<transport::PeerId, uint32_t> peer_rank;  // looked up per telemetry sample
  std::map<uint32_t, int> rank_connections;
  std::set<uint32_t> live;
  AgentStats stats;
  std::deque<std::string> recent_evidence;
  double staging_predicted_s = 0;
  double step_wall_ms_ = 0;  // EWMA of the wall time between closed steps
  std::vector<std::pair<uint64_t, double>> step_ms;  // closed steps' wall time (most recent 200k)
  monitor::Clock::time_point last_close{};
  std::mutex decide_mutex;
  // What the ranks announced (JobInfo). For a learned job the first announcement defines it.
  std::optional<transport::JobInfo> job_info;
  uint32_t capabilities = ~0u;  // AND over the ranks' announcements
  std::string mismatch;         // non-empty: a rank disagrees with the job; no plans are sent
  bool pending_revert = false;  // the switch in flight undoes the last one

  void log(const std::string& line) const {
    if (o.log) {
      o.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  }
  void on_connect(const transport::PeerInfo& p);
  void on_disconnect(transport::PeerId id, std::string_view reason);
  void on_message(transport::PeerId id, transport::Message&& m);
  void on_step(uint64_t step, monitor::Clock::time_point last_arrival);
  // Starts the switch of `ranks` to `target` (PlanExecutor::prepare), remembering its layout.
  // A learned pipeline's plan leaves the schedule to the job (plan_for).
  bool prepare_switch(const Strategy& target, const std::set<uint32_t>& ranks,
                      transport::PlanExecutor::Clock::time_point now);
  transport::PlanPrepare plan_for(const Strategy& target) const {
    return pipeline ? plan_prepare_keeping_schedule(target) : plan_prepare_for(target);
  }
  void on_outcome(const transport::PlanOutcome& outcome);
  void on_job_info(transport::PeerId id, const transport::JobInfo& info);
  // Makes the learned job's decider: batch shares, or the blocks of a pipeline.
  std::unique_ptr<env::dp::DataParallelDecider> learned_decider(const transport::JobInfo& info);
  void decide_learned(uint64_t step, monitor::Clock::time_point last_arrival, monitor::Clock::time_point start,
                      bool staging, const monitor::Beliefs& beliefs,
                      const std::vector<std::string>& evidence, const nlohmann::json& rejected);
  // Latency figures of one decision (timestamps in order), under no lock.
  void record_decision(monitor::Clock::time_point last_arrival, monitor::Clock::time_point callback_start,
                       monitor::Clock::time_point decide_start, monitor::Clock::time_point decided,
                       monitor::Clock::time_point sent, bool prepared);
  // Counts the inputs the policy read at its clip or never saw in training (AgentStats).
  void count_inputs(const policy::InputReport& inputs);
  // Why the job cannot run a switch from `from` to `s` (OK when it can). Under the lock.
  Status job_cannot_run(const Strategy& from, const Strategy& s) const;
  int ranks_of_job() const;  // under the lock; 0: not known yet
  std::string render() const;
};

int DeployAgent::Impl::ranks_of_job() const {
  if (o.job) return o.job->gpus();
  return job_info ? static_cast<int>(job_info->world_size) : 0;
}

Status DeployAgent::Impl::job_cannot_run(const Strategy& from, const Strategy& s) const {
  if (!job_info) return {};  // nothing announced: the ranks will say what they refuse
  return unsupported_switch(from, s, capabilities);
}

void DeployAgent::Impl::on_connect(const transport::PeerInfo& p) {
  if (p.rank == transport::kNoRank) return;
  {
    std::lock_guard lock(mutex);
    const int n = ranks_of_job();
    if (n > 0 && p.rank >= static_cast<uint32_t>(n)) return;
    peer_rank[p.id] = p.rank;
    ++rank_connections[p.rank];
    live.insert(p.rank);
  }
  if (monitor::Monitor* m = monitor.load()) m->rank_connected(static_cast<int>(p.rank));
}

void DeployAgent::Impl::on_disconnect(transport::PeerId id, std::string_view reason) {
  uint32_t rank = 0;
  {
    std::lock_guard lock(mutex);
    auto it = peer_rank.find(id);
    if (it == peer_rank.end()) return;
    rank = it->second;
    peer_rank.erase(it);
    if (--rank_connections[rank] > 0) return;  // a newer connection of the same rank is live
    live.erase(rank);
    ++stats.ranks_lost;
  }
  if (stopping) return;
  if (monitor::Monitor* m = monitor.load()) m->rank_lost(static_cast<int>(rank));
  nlohmann::json j = {{"event", "rank_lost"}, {"rank", rank}, {"reason", std::string(reason)}};
  log(j.dump());
  executor->on_rank_lost(rank, monitor::Clock::now());
}

void DeployAgent::Impl::on_message(transport::PeerId id, transport::Message&& m) {
  const auto now = monitor::Clock::now();
  if (auto* t = std::get_if<transport::Telemetry>(&m)) {
    // A rank may only speak for itself.
    {
      std::lock_guard lock(mutex);
      auto it = peer_rank.find(id);
      if (it == peer_rank.end() || it->second != t->rank) return;
      if (!monitor.load()) {
        ++stats.telemetry_before_job;
        return;
      }
    }
    // A rejected sample is counted by the monitor (MonitorCounters::rejected_by_reason) and
    // reported with every decision; nothing else is to be done with it here.
    static_cast<void>(monitor.load()->ingest(*t, now));
  } else if (auto* info = std::get_if<transport::JobInfo>(&m)) {
    on_job_info(id, *info);
  } else if (auto* r = std::get_if<transport::PlanReady>(&m)) {
    double step_wall_ms = 0;
    {
      std::lock_guard lock(mutex);
      step_wall_ms = step_wall_ms_;
    }
    monitor::Monitor* mon = monitor.load();
    executor->on_ready(*r, mon ? mon->newest_step() : 0, now, step_wall_ms);
  } else if (auto* a = std::get_if<transport::Ack>(&m)) {
    executor->on_ack(*a, now);
  }
}

void DeployAgent::Impl::on_job_info(transport::PeerId id, const transport::JobInfo& info) {
  std::string warning;
  bool learned_now = false;
  {
    std::lock_guard lock(mutex);
    auto it = peer_rank.find(id);
    if (it == peer_rank.end() || it->second != info.rank) return;  // a rank speaks for itself
    const bool first = !job_info;
    if (first) {
      job_info = info;
      capabilities = info.capabilities;
    } else {
      capabilities &= info.capabilities;
    }
    if (o.job) {
      if (static_cast<int>(info.world_size) != o.job->gpus()) {
        warning = "deploy's job has " + std::to_string(o.job->gpus()) + " ranks but rank " +
                  std::to_string(info.rank) + " belongs to a job of " +
                  std::to_string(info.world_size) +
                  ": no plans will be sent (start deploy without --scenario to learn the job "
                  "from its ranks, or give a scenario of the job's size)";
      }
    } else if (first) {
      warning = learned_job_problem(info);
      learned_now = warning.empty();
    } else if (info.world_size != job_info->world_size ||
               info.global_batch != job_info->global_batch) {
      warning = "rank " + std::to_string(info.rank) + " announced " +
                std::to_string(info.world_size) + " ranks and global batch " +
                std::to_string(info.global_batch) + ", but the job is " +
                std::to_string(job_info->world_size) + " ranks, global batch " +
                std::to_string(job_info->global_batch) + ": no plans will be sent";
    }
    if (!warning.empty()) mismatch = warning;
  }
  if (!warning.empty()) {
    log(nlohmann::json{{"event", "job_mismatch"}, {"rank", info.rank}, {"reason", warning}}.dump());
    // Tell the rank too: PlanAbort of plan 0 is a notice that no plan will come, and why.
    if (server) server->send(id, transport::PlanAbort{0, warning});
    return;
  }
  if (!learned_now) return;
  // The first announcement of a learned job: now it can be watched and planned for.
  monitor::MonitorOptions mo = o.monitor;
  mo.ranks = static_cast<int>(info.world_size);
  mo.gpus_per_node = mo.ranks;  // nodes are unknown: one peer group, one "node"
  mo.peer_group.clear();
  mo.compute_standard_errors = true;  // the data-parallel decider's noise band
  monitor_owner = std::make_unique<monitor::Monitor>(mo);
  {
    std::lock_guard decide_lock(decide_mutex);  // current_layout() reads dp under it
    pipeline = is_pipeline_job(info);
    dp = learned_decider(info);
    dp_policy->begin_episode();
  }
  const std::string initial_split = counts_text(dp->counts());  // before telemetry flows
  monitor_owner->set_step_callback(
      [this](uint64_t step, monitor::Clock::time_point t) { on_step(step, t); });
  monitor.store(monitor_owner.get());
  // Ranks that connected before the job was known (rank_connected is idempotent, so a rank that
  // connects meanwhile and is registered by on_connect too is fine).
  std::set<uint32_t> ranks;
  {
    std::lock_guard lock(mutex);
    ranks = live;
  }
  for (uint32_t r : ranks) {
    if (r < info.world_size) monitor_owner->rank_connected(static_cast<int>(r));
  }
  uint64_t params = 0, grad_bytes = 0;
  for (const auto& l : info.layers) {
    params += l.params;
    grad_bytes += l.grad_bytes;
  }
  nlohmann::json j = {{"event", "job_learned"},
                      {"ranks", info.world_size},
                      {"global_batch", info.global_batch},
                      {"framework", info.framework},
                      {"layers", info.layers.size()},
                      {"params", params},
                      {"grad_bytes", grad_bytes},
                      {"can_switch",
                       {{"dp_shares", (info.capabilities & transport::kCapDpShares) != 0},
                        {"compression", (info.capabilities & transport::kCapCompression) != 0},
                        {"tp", (info.capabilities & transport::kCapTensor) != 0},
                        {"pp", (info.capabilities & transport::kCapPipeline) != 0}}},
                      {"kind", pipeline ? "pipeline" : "data-parallel"},
                      {pipeline ? "split" : "shares", initial_split}};
  log(j.dump());
}

std::unique_ptr<env::dp::DataParallelDecider> DeployAgent::Impl::learned_decider(
    const transport::JobInfo& info) {
  env::dp::DataParallelOptions dpo = o.data_parallel;
  dpo.ranks = static_cast<int>(info.world_size);
  dpo.global_batch = static_cast<int>(info.global_batch);
  dpo.decision_steps = o.interval_steps;
  dpo.verify_steps = std::max(dpo.verify_steps, o.interval_steps);
  if (!is_pipeline_job(info)) {
    // A job that can switch compression gets fp16 proposed on a slow link (env/dp/decider.h).
    dpo.compression = (info.capabilities & transport::kCapCompression) ? "fp16" : "";
    return std::make_unique<env::dp::DataParallelDecider>(dpo);
  }
  env::pp::PipelineModelOptions ppo;
  ppo.stages = dpo.ranks;
  ppo.global_batch = dpo.global_batch;
  for (const transport::LayerInfo& l : info.layers) {
    ppo.block_params.push_back(l.params);
    ppo.block_bytes.push_back(l.grad_bytes);
  }
  ppo.equal_band = dpo.equal_band;
  ppo.noise_k = dpo.noise_k;
  return std::make_unique<env::dp::DataParallelDecider>(
      dpo, std::make_unique<env::pp::PipelineModel>(std::move(ppo)));
}

void DeployAgent::Impl::on_step(uint64_t step, monitor::Clock::time_point last_arrival) {
  if (stopping) return;
  monitor::Monitor* mon = monitor.load();
  const auto callback_start = monitor::Clock::now();
  const monitor::Beliefs beliefs = mon->beliefs();
  if (decider) decider->update_beliefs(beliefs);
  std::vector<monitor::MonitorEvent> events = mon->take_events();
  {
    std::lock_guard lock(mutex);
    if (last_close.time_since_epoch().count() != 0 && callback_start > last_close) {
      const double ms =
          std::chrono::duration<double, std::milli>(callback_start - last_close).count();
      step_wall_ms_ = step_wall_ms_ == 0 ? ms : 0.9 * step_wall_ms_ + 0.1 * ms;
    }
    last_close = callback_start;
    if (beliefs.last_step_ms > 0) push_bounded(step_ms, {step, beliefs.last_step_ms}, 200000);
    for (const monitor::MonitorEvent& e : events) {
      if (e.kind == monitor::MonitorEvent::Kind::slow_rank) ++stats.stragglers_detected;
      if (e.kind == monitor::MonitorEvent::Kind::congested_link ||
          e.kind == monitor::MonitorEvent::Kind::slow_link) {
        ++stats.congested_links_detected;
      }
      push_bounded(stats.events, e, 1000);
      std::string who = e.rank >= 0   ? "rank " + std::to_string(e.rank)
                        : e.node >= 0 ? "node " + std::to_string(e.node)
                                      : std::string("gradient all-reduce");
      recent_evidence.push_back(std::string(to_string(e.kind)) + " " + who + ": " + e.evidence);
      while (recent_evidence.size() > 8) recent_evidence.pop_front();
    }
  }
  for (const monitor::MonitorEvent& e : events) {
    nlohmann::json j = {
        {"event", to_string(e.kind)}, {"step", e.step},        {"rank", e.rank}, {"node", e.node},
        {"value", e.value},           {"evidence", e.evidence}};
    log(j.dump());
  }
  std::lock_guard decide_lock(decide_mutex);
  if (dp) dp->observe_step(step, beliefs.last_step_ms);
  if (o.interval_steps <= 0 || (step + 1) % static_cast<uint64_t>(o.interval_steps) != 0) return;

  const bool staging = executor->busy();
  std::vector<std::string> evidence;
  double staging_left = 0;
  std::string blocked;
  {
    std::lock_guard lock(mutex);
    evidence.assign(recent_evidence.begin(), recent_evidence.end());
    recent_evidence.clear();
    staging_left =
        staging ? std::max(0.0, staging_predicted_s - executor->staging_elapsed_s(monitor::Clock::now()))
                : 0.0;
    blocked = mismatch;
  }
  const monitor::MonitorCounters mc = mon->counters();
  nlohmann::json rejected = nlohmann::json::object();
  for (const auto& [reason, n] : mc.rejected_by_reason) rejected[reason] = n;
  if (dp) {
    decide_learned(step, last_arrival, callback_start, staging, beliefs, evidence, rejected);
    return;
  }
  const auto decide_start = monitor::Clock::now();
  Decision d = decider->decide(step, staging, staging_left, evidence);
  const auto decided = monitor::Clock::now();
  bool prepared = false;
  std::string held;
  if (d.action > 0 && d.target) {
    // The ranks the plan goes to: those live now (copied only for a switch: 16,384 ranks are
    // a tree of 16,384 nodes).
    std::set<uint32_t> ranks;
    {
      std::lock_guard lock(mutex);
      ranks = live;
      if (!blocked.empty()) {
        held = blocked;
      } else {
        held = job_cannot_run(decider->current(), d.target->strategy).message();
      }
      if (!held.empty()) ++stats.held_back;
      staging_predicted_s = std::max(0.0, d.target->migration_s - o.job->scenario.switch_pause_s);
    }
    if (held.empty()) prepared = prepare_switch(d.target->strategy, ranks, decided);
  }
  record_decision(last_arrival, callback_start, decide_start, decided, monitor::Clock::now(), prepared);
  count_inputs(d.inputs);
  nlohmann::json j = std::move(d.record);
  j["telemetry_rejected"] = rejected;
  if (!held.empty()) j["held_back"] = held;
  log(j.dump());
}

void DeployAgent::Impl::decide_learned(uint64_t step, monitor::Clock::time_point last_arrival,
                                       monitor::Clock::time_point start, bool staging,
                                       const monitor::Beliefs& beliefs,
                                       const std::vector<std::string>& evidence,
                                       const nlohmann::json& rejected) {
  const env::Observation observation = dp->observe(beliefs, staging);
  const int action = dp_policy->act(observation);
  const policy::InputReport inputs = dp_policy->check_inputs(observation);
  env::dp::DataParallelDecision d = dp->decide(action);
  const auto decided = monitor::Clock::now();
  std::string blocked;
  int global_batch = 0;
  {
    std::lock_guard lock(mutex);
    blocked = mismatch;
    global_batch = static_cast<int>(job_info->global_batch);
  }
  bool prepared = false;
  if (d.kind != env::dp::DataParallelDecision::Kind::keep) {
    if (!blocked.empty()) {
      d.reason = "held back: " + blocked + "; " + d.reason;
    } else {
      {
        std::lock_guard lock(mutex);
        pending_revert = d.kind == env::dp::DataParallelDecision::Kind::revert;
        staging_predicted_s = 0;
      }
      std::set<uint32_t> members;  // live ranks of this job (a stray rank id never answers)
      {
        std::lock_guard lock(mutex);
        for (uint32_t r : live) {
          if (r < d.counts.size()) members.insert(r);
        }
      }
      Strategy target = pipeline ? dp->layout_of(d.counts) : shares_layout(d.counts, global_batch);
      if (!pipeline) target.compression = d.compression;
      prepared = prepare_switch(target, members, decided);
    }
  }
  record_decision(last_arrival, start, start, decided, monitor::Clock::now(), prepared);
  count_inputs(inputs);
  const double sps = d.current_step_ms > 0 ? 1000.0 * global_batch / d.current_step_ms : 0.0;
  nlohmann::json j = {
      {"event", "decision"},
      {"step", step},
      {"action",
       prepared || d.kind == env::dp::DataParallelDecision::Kind::keep ? to_string(d.kind)
                                                                       : "keep"},
      {"policy", dp_policy->name()},
      {"policy_action", d.action},
      {"reason", d.reason},
      {pipeline ? "split" : "shares", counts_text(dp->counts())},
      {"compression", to_string(dp->compression())},
      {"step_ms", d.current_step_ms},
      {"samples_per_s", sps},
      {"slow_ranks", beliefs.slow_ranks},
      {"missing_fraction", beliefs.missing_fraction},
      {"telemetry_rejected", rejected},
      {"evidence", evidence}};
  if (d.kind != env::dp::DataParallelDecision::Kind::keep) {
    j[pipeline ? "target_split" : "target_shares"] = counts_text(d.counts);
    if (pipeline) j["target_layout"] = plan_for(dp->layout_of(d.counts)).layout_name;
    if (!pipeline) j["target_compression"] = to_string(d.compression);
    if (d.kind == env::dp::DataParallelDecision::Kind::rebalance ||
        d.kind == env::dp::DataParallelDecision::Kind::compress) {
      j["predicted_gain"] = d.predicted_new_ms > 0 ? d.predicted_now_ms / d.predicted_new_ms : 1.0;
      j["predicted_compute_ms"] = {d.predicted_now_ms, d.predicted_new_ms};
    }
    if (!prepared && blocked.empty()) j["not_sent"] = "a switch is already in flight";
  }
  log(j.dump());
}

bool DeployAgent::Impl::prepare_switch(const Strategy& target, const std::set<uint32_t>& ranks,
                                       transport::PlanExecutor::Clock::time_point now) {
  // Held across the prepare so that an outcome arriving at once finds the layout recorded.
  std::lock_guard lock(targets_mutex);
  const auto plan_id = executor->prepare(plan_for(target), ranks, now);
  if (!plan_id.ok()) return false;
  targets[*plan_id] = target;
  return true;
}

void DeployAgent::Impl::on_outcome(const transport::PlanOutcome& outcome) {
  MigrationOutcome r;
  static_cast<transport::PlanOutcome&>(r) = outcome;
  {
    std::lock_guard lock(targets_mutex);
    auto it = targets.find(outcome.plan_id);
    if (it != targets.end()) {
      r.target = std::move(it->second);
      targets.erase(it);
    }
  }
  bool revert = false;
  {
    std::lock_guard lock(mutex);
    revert = pending_revert;
    pending_revert = false;
  }
  std::lock_guard decide_lock(decide_mutex);
  if (r.committed) {
    if (decider) decider->committed(r.target);
    if (dp) {
      dp->committed(pipeline ? r.target.stage_layers : r.target.dp_shares, r.switch_at_step,
                    revert, r.target.compression);
    }
    if (decider) {
      // Peers are ranks at the same pipeline stage on the same GPU type, as in the simulator.
      monitor.load()->layout_changed(
          monitor::peer_groups(o.job->planner->cost_model().topology(), r.target));
    } else {
      monitor.load()->layout_changed();
    }
  } else if (dp) {
    dp->aborted();
  }
  {
    std::lock_guard lock(mutex);
    ++(r.committed ? stats.migrations_committed : stats.migrations_aborted);
    if (r.committed && revert) ++stats.reverts_committed;
    push_bounded(stats.outcomes, r, 1000);
  }
  nlohmann::json j = {{"event", "migration"},
                      {"plan_id", r.plan_id},
                      {"outcome", r.committed ? "committed" : "aborted"},
                      {"layout", layout_name(r.target)},
                      {"switch_at_step", r.switch_at_step},
                      {"reason", r.reason},
                      {"prepare_ms", r.prepare_ms},
                      {"total_ms", r.total_ms}};
  if (dp) {
    j[pipeline ? "split" : "shares"] =
        counts_text(pipeline ? r.target.stage_layers : r.target.dp_shares);
    j["revert"] = revert;
    if (!pipeline) j["compression"] = to_string(r.target.compression);
  }
  log(j.dump());
}

void DeployAgent::Impl::count_inputs(const policy::InputReport& inputs) {
  if (inputs.clipped.empty() && inputs.unseen.empty()) return;
  std::lock_guard lock(mutex);
  stats.features_clipped += inputs.clipped.size();
  for (int i : inputs.clipped) ++stats.features_clipped_by_input[env::input_name(i)];
  stats.features_unseen += inputs.unseen.size();
  for (int i : inputs.unseen) ++stats.features_unseen_by_input[env::input_name(i)];
}

void DeployAgent::Impl::record_decision(monitor::Clock::time_point last_arrival,
                                        monitor::Clock::time_point callback_start,
                                        monitor::Clock::time_point decide_start, monitor::Clock::time_point decided,
                                        monitor::Clock::time_point sent, bool prepared) {
  auto ms = [](monitor::Clock::time_point a, monitor::Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  std::lock_guard lock(mutex);
  ++stats.decisions;
  push_bounded(stats.step_close_ms, ms(last_arrival, callback_start), 100000);
  push_bounded(stats.decide_ms, ms(decide_start, decided), 100000);
  push_bounded(stats.decision_latency_ms, ms(last_arrival, decided), 100000);
  if (prepared) {
    ++stats.switches_decided;
    push_bounded(stats.prepare_latency_ms, ms(last_arrival, sent), 100000);
  }
}

std::string DeployAgent::Impl::render() const {
  const monitor::Monitor* mon = monitor.load();
  MetricsSnapshot m;
  m.counters = mon ? mon->counters() : monitor::MonitorCounters{};
  m.beliefs = mon ? mon->beliefs() : monitor::Beliefs{};
  {
    std::lock_guard lock(mutex);
    m.stats = stats;
    m.stats.connected_ranks = static_cast<int>(live.size());
  }
  m.usage = process_usage();
  if (o.job) {
    m.tokens_per_rank_step =
        static_cast<double>(o.job->global_batch) * o.job->scenario.model.seq_len / o.job->gpus();
  }
  return render_prometheus(m);
}

DeployAgent::DeployAgent() : impl_(std::make_unique<Impl>()) {}

StatusOr<std::unique_ptr<DeployAgent>> DeployAgent::start(AgentOptions options) {
  if (options.interval_steps < 1) return Status::invalid_argument("--interval-steps must be >= 1");
  if (options.job) {
    if (Status st = options.job->start_layout(options.decider.initial_layout).status(); !st.ok())
      return Status::invalid_argument("initial layout " + st.message());
  }
  std::unique_ptr<DeployAgent> agent(new DeployAgent());
  Impl& m = *agent->impl_;
  m.o = std::move(options);
  if (m.o.job) {
    const Job& job = *m.o.job;
    const ClusterTopology& topology = job.planner->cost_model().topology();
    monitor::MonitorOptions mo = monitor::options_for(topology, m.o.monitor);
    mo.peer_group =
        monitor::peer_groups(topology, job.start_layout(m.o.decider.initial_layout).value());
    m.monitor_owner = std::make_unique<monitor::Monitor>(mo);
    m.monitor.store(m.monitor_owner.get());
  }
  // One policy decides for either kind of job: the Decider's for a described job, dp_policy for
  // a learned one.
  LoadedPolicy policy = load_policy_or_reactive(m.o.policy_path, m.o.loader);
  m.stats.fallback = !policy.fallback.ok();
  m.stats.fallback_reason = policy.fallback.message();
  if (!policy.fallback.ok()) {
    nlohmann::json j = {
        {"event", "policy_fallback"}, {"policy", "reactive"}, {"reason", policy.fallback.message()}};
    m.log(j.dump());
  }
  m.stats.policy = policy.policy->name();
  if (m.o.job) {
    DeciderOptions decider = m.o.decider;
    decider.interval_steps = m.o.interval_steps;
    m.decider = std::make_unique<Decider>(m.o.job, std::move(policy), decider);
  } else {
    m.dp_policy = std::move(policy.policy);
  }
  m.executor = std::make_unique<transport::PlanExecutor>(
      m.o.migration,
      [&m](const transport::Message& msg) {
        if (m.server) m.server->broadcast(msg);
      },
      [&m](const transport::PlanOutcome& r) { m.on_outcome(r); });
  if (m.monitor_owner) {
    m.monitor_owner->set_step_callback(
        [&m](uint64_t step, monitor::Clock::time_point t) { m.on_step(step, t); });
  }

  transport::ServerHandlers h;
  h.on_connect = [&m](const transport::PeerInfo& p) { m.on_connect(p); };
  h.on_disconnect = [&m](transport::PeerId id, std::string_view reason) {
    m.on_disconnect(id, reason);
  };
  h.on_message = [&m](transport::PeerId id, transport::Message&& msg) {
    m.on_message(id, std::move(msg));
  };
  if (m.o.hub) {
    auto s = m.o.hub->make_server(std::move(h));
    if (!s) return Status(s.status().code(), "deploy: " + s.status().message());
    m.server = std::move(*s);
  } else {
    transport::ServerOptions so;
    so.listen_address = m.o.listen_address;
    so.port = m.o.port;
    so.secret = m.o.secret;
    so.io_threads = m.o.io_threads;
    so.max_unauthenticated = 4096;
    so.max_connections = 1u << 16;
    auto s = transport::make_tcp_server(std::move(so), std::move(h));
    if (!s) return Status(s.status().code(), "--listen: " + s.status().message());
    m.server = std::move(*s);
  }
  if (m.o.serve_metrics) {
    auto ms = MetricsHttpServer::start(m.o.metrics_address, m.o.metrics_port,
                                       [&m] { return m.render(); });
    if (!ms) return Status(ms.status().code(), "--metrics-port: " + ms.status().message());
    m.metrics = std::move(*ms);
  }
  m.ticker = std::thread([&m] {
    while (!m.stopping) {
      m.executor->tick(monitor::Clock::now());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  nlohmann::json j = {{"event", "agent_started"},
                      {"port", agent->port()},
                      {"metrics_port", agent->metrics_port()},
                      {"policy", m.stats.policy},
                      {"fallback", m.stats.fallback},
                      {"ranks", m.o.job ? nlohmann::json(m.o.job->gpus()) : nlohmann::json()},
                      {"job", m.o.job ? "described by the scenario"
                                      : "learned from the ranks' JobInfo when they connect"},
                      {"layout", m.decider ? layout_name(m.decider->current()) : "the job's own"}};
  m.log(j.dump());
  return agent;
}

DeployAgent::~DeployAgent() { stop(); }

void DeployAgent::stop() {
  Impl& m = *impl_;
  if (m.stopped.exchange(true)) return;
  m.stopping = true;
  if (m.metrics) m.metrics->stop();
  if (m.server) m.server->stop();
  if (m.ticker.joinable()) m.ticker.join();
}

uint16_t DeployAgent::port() const { return impl_->server ? impl_->server->port() : 0; }
uint16_t DeployAgent::metrics_port() const { return impl_->metrics ? impl_->metrics->port() : 0; }
std::string DeployAgent::metrics_text() const { return impl_->render(); }
monitor::Monitor* DeployAgent::monitor() { return impl_->monitor.load(); }
Decider& DeployAgent::decider() { return *impl_->decider; }
Strategy DeployAgent::current_layout() const {
  if (impl_->decider) return impl_->decider->current();
  std::lock_guard lock(impl_->decide_mutex);
  std::lock_guard state_lock(impl_->mutex);
  if (!impl_->dp || !impl_->job_info) return Strategy{};
  if (impl_->pipeline) return impl_->dp->layout_of(impl_->dp->counts());
  Strategy s = shares_layout(impl_->dp->counts(), static_cast<int>(impl_->job_info->global_batch));
  s.compression = impl_->dp->compression();
  return s;
}

JobPace DeployAgent::pace() const {
  const Impl& m = *impl_;
  JobPace p;
  std::vector<double> before, after;
  {
    std::lock_guard lock(m.mutex);
    // Switches that took effect: committed for a step the job reached.
    const uint64_t newest = m.step_ms.empty() ? 0 : m.step_ms.back().first;
    uint64_t first = UINT64_MAX, last = UINT64_MAX;
    for (const MigrationOutcome& r : m.stats.outcomes) {
      if (!r.committed || m.step_ms.empty() || r.switch_at_step > newest) continue;
      if (first == UINT64_MAX) first = r.switch_at_step;
      last = r.switch_at_step;
    }
    for (const auto& [step, ms] : m.step_ms) {
      if (first == UINT64_MAX || step < first) before.push_back(ms);
      if (last != UINT64_MAX && step >= last) after.push_back(ms);
    }
    if (m.o.job) p.global_batch = m.o.job->global_batch;
    if (m.job_info) p.global_batch = static_cast<int>(m.job_info->global_batch);
  }
  p.steps_before = before.size();
  p.steps_after = after.size();
  if (!before.empty()) p.step_ms_before = monitor::median(before);
  if (!after.empty()) p.step_ms_after = monitor::median(after);
  return p;
}

AgentStats DeployAgent::stats() const {
  AgentStats s;
  {
    std::lock_guard lock(impl_->mutex);
    s = impl_->stats;
    s.connected_ranks = static_cast<int>(impl_->live.size());
  }
  if (impl_->server) s.bus = impl_->server->stats();
  return s;
}

bool DeployAgent::request_switch(const Strategy& target) {
  std::set<uint32_t> ranks;
  {
    std::lock_guard lock(impl_->mutex);
    ranks = impl_->live;
  }
  return impl_->prepare_switch(target, ranks, monitor::Clock::now());
}

}  // namespace parapilot::agent::deploy
