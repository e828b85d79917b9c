// Prometheus text-format metrics of the deploy agent (render_prometheus), and a minimal HTTP
// endpoint serving them (GET /metrics, Boost.Beast, bound to loopback unless told otherwise).
//
// Thread-safety: render_prometheus is a pure function; MetricsHttpServer serves from its own
// thread and calls `render` there.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "agent/deploy/agent.h"
#include "core/status.h"
#include "env/monitor/monitor.h"

namespace parapilot::agent::deploy {

/// CPU time (user + system) and peak resident memory of this process (getrusage).
struct ProcessUsage {
  double cpu_s = 0;
  double max_rss_bytes = 0;
};
ProcessUsage process_usage();

/// What the metrics are rendered from: one consistent copy of the agent's figures.
struct MetricsSnapshot {
  AgentStats stats;
  monitor::MonitorCounters counters;
  monitor::Beliefs beliefs;
  ProcessUsage usage;
  double tokens_per_rank_step = 0;  ///< a described job's tokens per rank and step; 0: unknown.
};

/// The agent's metrics in the Prometheus text format (version 0.0.4): decisions, switches,
/// telemetry accepted and rejected, decision latency, per-rank levels and speeds, process CPU
/// and memory. Every metric has its # HELP and # TYPE lines.
std::string render_prometheus(const MetricsSnapshot& snapshot);

class MetricsHttpServer {
 public:
  using Render = std::function<std::string()>;
  /// Listens on address:port (port 0 picks a free one) and serves `render()` at /metrics.
  static StatusOr<std::unique_ptr<MetricsHttpServer>> start(const std::string& address,
                                                                     uint16_t port, Render render);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;
  uint16_t port() const;
  void stop();

 private:
  MetricsHttpServer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Fetches http://127.0.0.1:port/path (tests and tools); the body, or an error.
StatusOr<std::string> http_get(uint16_t port, const std::string& path = "/metrics");

}  // namespace parapilot::agent::deploy
