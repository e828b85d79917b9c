#include "agent/runtime/agent.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "agent/runtime/metrics.h"
#include "agent/runtime/robust_stats.h"
#include "strategy/error.h"

namespace parapilot::agent::runtime {

namespace {

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i =
      std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

template <class T>
void push_bounded(std::vector<T>& v, T x, size_t cap) {
  if (v.size() >= cap) v.erase(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(cap / 10));
  v.push_back(std::move(x));
}

}  // namespace

struct DeployAgent::Impl {
  AgentOptions o;
  std::unique_ptr<Monitor> monitor;
  std::unique_ptr<Decider> decider;
  std::unique_ptr<MigrationExecutor> executor;
  std::unique_ptr<transport::Server> server;
  std::unique_ptr<MetricsHttpServer> metrics;
  std::thread ticker;
  std::atomic<bool> stopping{false};
  std::atomic<bool> stopped{false};

  mutable std::mutex mutex;  // guards the fields below
  std::map<transport::PeerId, uint32_t> peer_rank;
  std::map<uint32_t, int> rank_connections;
  std::set<uint32_t> live;
  AgentStats stats;
  std::deque<std::string> recent_evidence;
  double staging_predicted_s = 0;
  double step_wall_ms_ = 0;  // EWMA of the wall time between closed steps
  Clock::time_point last_close{};
  std::mutex decide_mutex;

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
  void on_step(uint64_t step, Clock::time_point last_arrival);
  void on_outcome(const MigrationOutcome& r);
  std::string render() const;
};

void DeployAgent::Impl::on_connect(const transport::PeerInfo& p) {
  if (p.rank == transport::kNoRank || p.rank >= static_cast<uint32_t>(o.job->gpus())) return;
  {
    std::lock_guard lock(mutex);
    peer_rank[p.id] = p.rank;
    ++rank_connections[p.rank];
    live.insert(p.rank);
  }
  monitor->rank_connected(static_cast<int>(p.rank));
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
  monitor->rank_lost(static_cast<int>(rank));
  nlohmann::json j = {{"event", "rank_lost"}, {"rank", rank}, {"reason", std::string(reason)}};
  log(j.dump());
  executor->on_rank_lost(rank, Clock::now());
}

void DeployAgent::Impl::on_message(transport::PeerId id, transport::Message&& m) {
  const auto now = Clock::now();
  if (auto* t = std::get_if<transport::Telemetry>(&m)) {
    // A rank may only speak for itself.
    {
      std::lock_guard lock(mutex);
      auto it = peer_rank.find(id);
      if (it == peer_rank.end() || it->second != t->rank) return;
    }
    monitor->ingest(*t, now);
  } else if (auto* r = std::get_if<transport::PlanReady>(&m)) {
    double step_wall_ms = 0;
    {
      std::lock_guard lock(mutex);
      step_wall_ms = step_wall_ms_;
    }
    executor->on_ready(*r, monitor->newest_step(), now, step_wall_ms);
  } else if (auto* a = std::get_if<transport::Ack>(&m)) {
    executor->on_ack(*a, now);
  }
}

void DeployAgent::Impl::on_step(uint64_t step, Clock::time_point last_arrival) {
  if (stopping) return;
  const auto callback_start = Clock::now();
  const Beliefs beliefs = monitor->beliefs();
  decider->update_beliefs(beliefs);
  std::vector<MonitorEvent> events = monitor->take_events();
  {
    std::lock_guard lock(mutex);
    if (last_close.time_since_epoch().count() != 0 && callback_start > last_close) {
      const double ms =
          std::chrono::duration<double, std::milli>(callback_start - last_close).count();
      step_wall_ms_ = step_wall_ms_ == 0 ? ms : 0.9 * step_wall_ms_ + 0.1 * ms;
    }
    last_close = callback_start;
    for (const MonitorEvent& e : events) {
      if (e.kind == MonitorEvent::Kind::slow_rank) ++stats.stragglers_detected;
      if (e.kind == MonitorEvent::Kind::congested_link) ++stats.congested_links_detected;
      push_bounded(stats.events, e, 1000);
      std::string who =
          e.rank >= 0 ? "rank " + std::to_string(e.rank) : "node " + std::to_string(e.node);
      recent_evidence.push_back(std::string(to_string(e.kind)) + " " + who + ": " + e.evidence);
      while (recent_evidence.size() > 8) recent_evidence.pop_front();
    }
  }
  for (const MonitorEvent& e : events) {
    nlohmann::json j = {
        {"event", to_string(e.kind)}, {"step", e.step},        {"rank", e.rank}, {"node", e.node},
        {"value", e.value},           {"evidence", e.evidence}};
    log(j.dump());
  }
  if (o.interval_steps <= 0 || (step + 1) % static_cast<uint64_t>(o.interval_steps) != 0) return;

  std::lock_guard decide_lock(decide_mutex);
  const auto now = Clock::now();
  const bool staging = executor->busy();
  std::vector<std::string> evidence;
  std::set<uint32_t> ranks;
  double staging_left = 0;
  {
    std::lock_guard lock(mutex);
    evidence.assign(recent_evidence.begin(), recent_evidence.end());
    recent_evidence.clear();
    ranks = live;
    staging_left =
        staging ? std::max(0.0, staging_predicted_s - executor->staging_elapsed_s(now)) : 0.0;
  }
  const auto decide_start = Clock::now();
  Decision d = decider->decide(step, staging, staging_left, evidence);
  const auto decided = Clock::now();
  bool prepared = false;
  if (d.action > 0 && d.target) {
    {
      std::lock_guard lock(mutex);
      staging_predicted_s = std::max(0.0, d.target->migration_s - kSwitchPauseS);
    }
    prepared = executor->prepare(d.target->strategy, ranks, decided);
  }
  const auto sent = Clock::now();
  {
    std::lock_guard lock(mutex);
    ++stats.decisions;
    push_bounded(stats.step_close_ms,
                 std::chrono::duration<double, std::milli>(callback_start - last_arrival).count(),
                 100000);
    push_bounded(stats.decide_ms,
                 std::chrono::duration<double, std::milli>(decided - decide_start).count(), 100000);
    push_bounded(stats.decision_latency_ms,
                 std::chrono::duration<double, std::milli>(decided - last_arrival).count(), 100000);
    if (prepared) {
      ++stats.switches_decided;
      push_bounded(stats.prepare_latency_ms,
                   std::chrono::duration<double, std::milli>(sent - last_arrival).count(), 100000);
    }
  }
  log(d.log_line);
}

void DeployAgent::Impl::on_outcome(const MigrationOutcome& r) {
  if (r.committed) {
    decider->committed(r.target);
    monitor->layout_changed();
  }
  {
    std::lock_guard lock(mutex);
    ++(r.committed ? stats.migrations_committed : stats.migrations_aborted);
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
  log(j.dump());
}

std::string DeployAgent::Impl::render() const {
  const MonitorCounters mc = monitor->counters();
  const Beliefs b = monitor->beliefs();
  AgentStats s;
  {
    std::lock_guard lock(mutex);
    s = stats;
    s.connected_ranks = static_cast<int>(live.size());
  }
  const ProcessUsage usage = process_usage();
  std::ostringstream out;
  auto metric = [&](const char* name, const char* type, const char* help) {
    out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  };
  metric("parapilot_decisions_total", "counter", "Decisions taken, by action.");
  out << "parapilot_decisions_total{action=\"keep\"} " << s.decisions - s.switches_decided << '\n';
  out << "parapilot_decisions_total{action=\"switch\"} " << s.switches_decided << '\n';
  metric("parapilot_migrations_total", "counter", "Layout switches, by outcome.");
  out << "parapilot_migrations_total{outcome=\"committed\"} " << s.migrations_committed << '\n';
  out << "parapilot_migrations_total{outcome=\"aborted\"} " << s.migrations_aborted << '\n';
  metric("parapilot_migration_aborts_total", "counter", "Layout switches aborted.");
  out << "parapilot_migration_aborts_total " << s.migrations_aborted << '\n';
  metric("parapilot_stragglers_detected_total", "counter", "Slow-rank detections.");
  out << "parapilot_stragglers_detected_total " << s.stragglers_detected << '\n';
  metric("parapilot_congested_links_detected_total", "counter", "Congested-link detections.");
  out << "parapilot_congested_links_detected_total " << s.congested_links_detected << '\n';
  metric("parapilot_ranks_lost_total", "counter", "Ranks that disconnected.");
  out << "parapilot_ranks_lost_total " << s.ranks_lost << '\n';
  metric("parapilot_connected_ranks", "gauge", "Ranks connected now.");
  out << "parapilot_connected_ranks " << s.connected_ranks << '\n';
  metric("parapilot_telemetry_accepted_total", "counter", "Telemetry samples used.");
  out << "parapilot_telemetry_accepted_total " << mc.accepted << '\n';
  metric("parapilot_telemetry_rejected_total", "counter", "Telemetry samples rejected, by reason.");
  for (const auto& [reason, n] : mc.rejected_by_reason) {
    out << "parapilot_telemetry_rejected_total{reason=\"" << reason << "\"} " << n << '\n';
  }
  metric("parapilot_telemetry_outliers_total", "counter", "Samples not averaged in (outliers).");
  out << "parapilot_telemetry_outliers_total " << mc.outliers << '\n';
  metric("parapilot_policy_fallback", "gauge",
         "1 when the reactive baseline stands in for the requested policy.");
  out << "parapilot_policy_fallback{policy=\"" << s.policy << "\"} " << (s.fallback ? 1 : 0)
      << '\n';
  metric("parapilot_decision_latency_ms", "summary",
         "Last telemetry of an interval to the decision, milliseconds.");
  out << "parapilot_decision_latency_ms{quantile=\"0.5\"} " << quantile(s.decision_latency_ms, 0.5)
      << '\n';
  out << "parapilot_decision_latency_ms{quantile=\"0.99\"} "
      << quantile(s.decision_latency_ms, 0.99) << '\n';
  out << "parapilot_decision_latency_ms_count " << s.decision_latency_ms.size() << '\n';
  metric("parapilot_rank_steps_per_second", "gauge", "Per-rank training steps per second.");
  for (size_t r = 0; r < b.rank_steps_per_s.size(); ++r) {
    out << "parapilot_rank_steps_per_second{rank=\"" << r << "\"} " << b.rank_steps_per_s[r]
        << '\n';
  }
  const double tokens_per_step =
      static_cast<double>(o.job->global_batch) * o.job->scenario.model.seq_len / o.job->gpus();
  metric("parapilot_rank_tokens_per_second", "gauge", "Per-rank tokens per second (equal shares).");
  for (size_t r = 0; r < b.rank_steps_per_s.size(); ++r) {
    out << "parapilot_rank_tokens_per_second{rank=\"" << r << "\"} "
        << b.rank_steps_per_s[r] * tokens_per_step << '\n';
  }
  metric("parapilot_rank_speed", "gauge",
         "Believed per-rank compute speed (1 = as fast as peers).");
  for (size_t r = 0; r < b.conditions.gpu_speed.size(); ++r) {
    out << "parapilot_rank_speed{rank=\"" << r << "\"} " << b.conditions.gpu_speed[r] << '\n';
  }
  metric("process_cpu_seconds_total", "counter", "CPU time of the agent process.");
  out << "process_cpu_seconds_total " << usage.cpu_s << '\n';
  metric("process_max_resident_memory_bytes", "gauge", "Peak resident memory of the agent.");
  out << "process_max_resident_memory_bytes " << usage.max_rss_bytes << '\n';
  return out.str();
}

DeployAgent::DeployAgent(AgentOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.o = std::move(options);
  if (!m.o.job) throw InputError("deploy: no job");
  if (m.o.interval_steps < 1) throw InputError("--interval-steps must be >= 1");
  const Job& job = *m.o.job;
  MonitorOptions mo = m.o.monitor;
  mo.ranks = job.gpus();
  mo.gpus_per_node =
      job.scenario.cluster.groups.empty() ? 8 : job.scenario.cluster.groups.front().gpus_per_node;
  mo.peer_group = job.planner->cost_model().topology().type_of_gpu;
  m.monitor = std::make_unique<Monitor>(mo);
  LoadedPolicy policy = load_policy_or_reactive(m.o.policy_path, m.o.loader);
  m.stats.fallback = policy.fallback;
  m.stats.fallback_reason = policy.fallback_reason;
  if (policy.fallback) {
    nlohmann::json j = {
        {"event", "policy_fallback"}, {"policy", "reactive"}, {"reason", policy.fallback_reason}};
    m.log(j.dump());
  }
  m.decider = std::make_unique<Decider>(m.o.job, std::move(policy), m.o.decider);
  m.stats.policy = m.decider->policy_name();
  m.executor = std::make_unique<MigrationExecutor>(
      m.o.migration,
      [&m](const transport::Message& msg) {
        if (m.server) m.server->broadcast(msg);
      },
      [&m](const MigrationOutcome& r) { m.on_outcome(r); });
  m.monitor->set_step_callback([&m](uint64_t step, Clock::time_point t) { m.on_step(step, t); });

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
    if (!s) throw InputError("deploy: " + s.error());
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
    if (!s) throw InputError("--listen: " + s.error());
    m.server = std::move(*s);
  }
  if (m.o.serve_metrics) {
    auto ms = MetricsHttpServer::start(m.o.metrics_address, m.o.metrics_port,
                                       [&m] { return m.render(); });
    if (!ms) {
      m.server->stop();
      throw InputError("--metrics-port: " + ms.error());
    }
    m.metrics = std::move(*ms);
  }
  m.ticker = std::thread([&m] {
    while (!m.stopping) {
      m.executor->tick(Clock::now());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  nlohmann::json j = {{"event", "agent_started"},
                      {"port", port()},
                      {"metrics_port", metrics_port()},
                      {"policy", m.stats.policy},
                      {"fallback", m.stats.fallback},
                      {"ranks", job.gpus()},
                      {"layout", layout_name(m.decider->current())}};
  m.log(j.dump());
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
Monitor& DeployAgent::monitor() { return *impl_->monitor; }
Decider& DeployAgent::decider() { return *impl_->decider; }
Strategy DeployAgent::current_layout() const { return impl_->decider->current(); }

AgentStats DeployAgent::stats() const {
  std::lock_guard lock(impl_->mutex);
  AgentStats s = impl_->stats;
  s.connected_ranks = static_cast<int>(impl_->live.size());
  return s;
}

bool DeployAgent::request_switch(const Strategy& target) {
  std::set<uint32_t> ranks;
  {
    std::lock_guard lock(impl_->mutex);
    ranks = impl_->live;
  }
  return impl_->executor->prepare(target, ranks, Clock::now());
}

}  // namespace parapilot::agent::runtime
