#include "env/dp/dp_env.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "core/random.h"
#include "env/pp/pipeline_sim.h"

namespace parapilot::env::dp {

namespace {

constexpr Family kFamilies[] = {Family::straggler, Family::comm, Family::flap, Family::mixed};

monitor::Clock::time_point sim_time(uint64_t ns) {
  return monitor::Clock::time_point(
      std::chrono::duration_cast<monitor::Clock::duration>(std::chrono::nanoseconds(ns)));
}

}  // namespace

DataParallelEnv::DataParallelEnv(DataParallelEnvOptions options, std::string id)
    : o_(options), id_(std::move(id)) {
  assert(o_.ranks >= 0 && o_.horizon >= 1 && o_.decision_steps >= 1);
}

DataParallelEnv::~DataParallelEnv() = default;

std::unique_ptr<SplitJobSim> DataParallelEnv::make_sim() const {
  if (!o_.pipeline) return std::make_unique<DataParallelJobSim>(episode_, splitmix64(seed_ + 2));
  return std::make_unique<pp::PipelineJobSim>(
      episode_, pp::draw_pipeline(stages_, splitmix64(seed_ + 3)), splitmix64(seed_ + 2));
}

StatusOr<Observation> DataParallelEnv::reset(uint64_t seed, const ResetOptions& /*options*/) {
  seed_ = seed;
  family_ = o_.family ? *o_.family : kFamilies[splitmix64(seed) % 4];
  int ranks = o_.ranks;
  if (o_.pipeline && ranks == 0) ranks = 2 + static_cast<int>(splitmix64(seed + 4) % 15);
  stages_ = ranks;
  episode_ = draw_episode({family_, ranks, o_.decision_steps, o_.horizon}, splitmix64(seed + 1));
  sim_ = make_sim();
  const int n = sim_->ranks();
  interval_s_ = o_.decision_steps * sim_->nominal_step_ms() / 1e3;
  // As the deploy agent watches a learned job (agent/deploy/agent.cc): one peer group, one
  // "node", standard errors for the decider's noise band.
  monitor::MonitorOptions mo;
  mo.ranks = n;
  mo.gpus_per_node = n;
  mo.compute_standard_errors = true;
  monitor_ = std::make_unique<monitor::Monitor>(mo);
  for (int r = 0; r < n; ++r) monitor_->rank_connected(r);
  DataParallelOptions dpo;
  dpo.ranks = n;
  dpo.global_batch = sim_->global_batch();
  dpo.decision_steps = o_.decision_steps;
  dpo.verify_steps = std::max(dpo.verify_steps, o_.decision_steps);
  decider_ = std::make_unique<DataParallelDecider>(dpo, sim_->decider_model(dpo));
  batch_.clear();
  batch_.reserve(static_cast<size_t>(o_.decision_steps) * n);
  t_ = 0;
  run_interval(nullptr);
  return decider_->observe(monitor_->beliefs(), /*staging=*/false);
}

std::pair<double, double> DataParallelEnv::run_interval(const DataParallelDecision* commit) {
  double wall_ms = 0, best_ms = 0;
  for (int i = 0; i < o_.decision_steps; ++i) {
    if (i == 0 && commit) {
      // The switch takes effect at the next step boundary; the monitor's per-rank levels
      // restart, as the agent restarts them on a commit.
      decider_->committed(commit->counts, sim_->next_step(),
                          commit->kind == DataParallelDecision::Kind::revert);
      sim_->set_counts(commit->counts);
      monitor_->layout_changed();
    }
    SplitJobSim::Step& s = sim_->step();
    wall_ms += s.wall_ms;
    best_ms += s.best_ms;
    decider_->observe_step(s.step, s.wall_ms);
    for (monitor::StepSample& x : s.samples) batch_.push_back(std::move(x));
  }
  const uint64_t last_ns = batch_.empty() ? 0 : batch_.back().end_ns;
  monitor_->ingest(std::move(batch_), sim_time(last_ns));
  batch_.clear();  // ingest leaves it empty; this states it
  return {wall_ms, best_ms};
}

double DataParallelEnv::tokens(double wall_ms) const {
  const double samples = static_cast<double>(o_.decision_steps) * sim_->global_batch();
  return wall_ms > 0 ? samples * interval_s_ * 1e3 / wall_ms : 0;
}

StepResult DataParallelEnv::step(int action) {
  assert(sim_ && t_ < o_.horizon);  // precondition: reset, episode not over
  StepResult r;
  const DataParallelDecision d = decider_->decide(action);
  const bool commit = d.kind != DataParallelDecision::Kind::keep;
  const auto [wall_ms, best_ms] = run_interval(commit ? &d : nullptr);
  r.observation = decider_->observe(monitor_->beliefs(), /*staging=*/false);
  r.reward = wall_ms > 0 ? best_ms / wall_ms : 0;
  r.info.tokens = tokens(wall_ms);
  r.info.best_tokens = tokens(best_ms);
  r.info.tokens_per_s = r.info.tokens / interval_s_;
  r.info.migration_started = commit;
  r.info.migration_committed = commit;
  r.info.interval = t_;
  ++t_;
  r.truncated = t_ >= o_.horizon;
  return r;
}

std::optional<OracleResult> DataParallelEnv::oracle() {
  if (!sim_) return std::nullopt;
  const std::unique_ptr<SplitJobSim> replay = make_sim();
  SplitJobSim& sim = *replay;
  const uint64_t k = static_cast<uint64_t>(o_.decision_steps);
  for (uint64_t i = 0; i < k; ++i) sim.step();  // reset's interval, on even shares
  OracleResult out;
  std::vector<double> before, now;
  double comm_before = 1, comm_now = 1;
  before = episode_.job.base_slowdown;  // interval 0 is compared with the nominal job
  for (int t = 0; t < o_.horizon; ++t) {
    const uint64_t first = sim.next_step();
    // Candidates: the shares in force and the best shares of each of the interval's steps;
    // each scored on the noiseless steps ahead, a change paying one step's pause.
    std::vector<std::vector<int>> candidates = {sim.counts()};
    bool changed = false;
    for (uint64_t s = first; s < first + k; ++s) {
      sim.truth_at(s, &now, &comm_now);
      changed = changed || now != before || comm_now != comm_before;
      before = now;
      comm_before = comm_now;
      std::vector<int> best = sim.best_counts_at(s);
      if (std::find(candidates.begin(), candidates.end(), best) == candidates.end()) {
        candidates.push_back(std::move(best));
      }
    }
    out.truth_changed.push_back(changed);
    double best_cost = 0;
    size_t pick = 0;
    for (size_t c = 0; c < candidates.size(); ++c) {
      double cost = c == 0 ? 0 : sim.switch_pause_ms_at(first, sim.counts(), candidates[c]);
      for (uint64_t s = first; s < first + k; ++s) cost += sim.true_step_ms_at(s, candidates[c]);
      if (c == 0 || cost < best_cost) {
        best_cost = cost;
        pick = c;
      }
    }
    if (pick != 0) {
      sim.set_counts(candidates[pick]);
      ++out.migrations;
    }
    double wall_ms = 0;
    for (uint64_t i = 0; i < k; ++i) wall_ms += sim.step().wall_ms;
    out.tokens_per_interval.push_back(tokens(wall_ms));
  }
  return out;
}

std::vector<std::pair<int, std::string>> DataParallelEnv::events() const {
  std::vector<std::pair<int, std::string>> out;
  const uint64_t k = static_cast<uint64_t>(o_.decision_steps);
  for (const FailSlow& e : episode_.events) {
    // Interval t runs steps (t + 1) K .. (t + 2) K - 1 (reset runs the first K).
    const uint64_t interval = e.start_step / k;
    char what[128];
    std::snprintf(what, sizeof what, "%s fail-slow x%.2f%s%s for %llu steps", to_string(e.kind),
                  e.factor, e.rank >= 0 ? " on rank " : "",
                  e.rank >= 0 ? std::to_string(e.rank).c_str() : "",
                  static_cast<unsigned long long>(e.end_step - e.start_step));
    out.emplace_back(static_cast<int>(interval == 0 ? 0 : interval - 1), what);
  }
  return out;
}

namespace {

std::unique_ptr<Env> make_split_env_or_throw(const EnvId& id, bool pipeline) {
  const char* kind = pipeline ? "pp" : "dp";
  const char* ranks = pipeline ? "stages" : "ranks";
  reject_unknown(id, {ranks, "horizon", "decision_steps"});
  DataParallelEnvOptions o;
  o.pipeline = pipeline;
  if (id.variant == "random") {
    o.family = std::nullopt;
  } else {
    bool known = false;
    for (Family f : kFamilies) {
      if (id.variant == to_string(f)) {
        o.family = f;
        known = true;
      }
    }
    if (!known) {
      throw InputError(std::string("env ") + kind + ": unknown family \"" + id.variant +
                       "\" (straggler, comm, flap, mixed, random)");
    }
  }
  o.ranks = int_param(id, ranks, 0, 2, pipeline ? 256 : 4096);
  o.horizon = int_param(id, "horizon", o.horizon, 1, 1 << 20);
  o.decision_steps = int_param(id, "decision_steps", o.decision_steps, 1, 1 << 16);
  std::string canonical = std::string(kind) + ":" + id.variant;
  if (!id.params.empty()) {
    canonical += "(";
    bool first = true;
    for (const auto& [key, value] : id.params) {
      canonical += (first ? "" : ",") + key + "=" + value;
      first = false;
    }
    canonical += ")";
  }
  return std::make_unique<DataParallelEnv>(o, canonical);
}

}  // namespace

StatusOr<std::unique_ptr<Env>> make_dp_env(const EnvId& id) {
  return catch_input_error([&] { return make_split_env_or_throw(id, false); });
}

StatusOr<std::unique_ptr<Env>> make_pp_env(const EnvId& id) {
  return catch_input_error([&] { return make_split_env_or_throw(id, true); });
}

}  // namespace parapilot::env::dp
