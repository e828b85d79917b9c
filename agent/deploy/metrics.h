// Prometheus text-format metrics of the deploy agent, and a minimal HTTP endpoint serving them
// (GET /metrics, Boost.Beast, bound to loopback unless told otherwise).
//
// Thread-safety: MetricsHttpServer serves from its own thread and calls `render` there.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/status.h"

namespace parapilot::agent::deploy {

/// CPU time (user + system) and peak resident memory of this process (getrusage).
struct ProcessUsage {
  double cpu_s = 0;
  double max_rss_bytes = 0;
};
ProcessUsage process_usage();

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
