#include "agent/deploy/metrics.h"

#include <algorithm>
#include <sstream>

#include <sys/resource.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <thread>

namespace parapilot::agent::deploy {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

ProcessUsage process_usage() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  ProcessUsage p;
  p.cpu_s = static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
            static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  p.max_rss_bytes = static_cast<double>(u.ru_maxrss) * 1024.0;  // Linux: KiB
  return p;
}

namespace {

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, MetricsHttpServer::Render render)
      : stream_(std::move(socket)), render_(std::move(render)) {}

  void run() {
    stream_.expires_after(std::chrono::seconds(5));
    http::async_read(stream_, buffer_, request_,
                     [self = shared_from_this()](beast::error_code ec, std::size_t) {
                       if (!ec) self->respond();
                     });
  }

 private:
  void respond() {
    response_.version(request_.version());
    response_.keep_alive(false);
    if (request_.method() == http::verb::get && request_.target() == "/metrics") {
      response_.result(http::status::ok);
      response_.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
      response_.body() = render_();
    } else {
      response_.result(http::status::not_found);
      response_.set(http::field::content_type, "text/plain");
      response_.body() = "not found; try /metrics\n";
    }
    response_.prepare_payload();
    http::async_write(stream_, response_,
                      [self = shared_from_this()](beast::error_code, std::size_t) {
                        beast::error_code ignored;
                        self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
                      });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  http::request<http::string_body> request_;
  http::response<http::string_body> response_;
  MetricsHttpServer::Render render_;
};

}  // namespace

struct MetricsHttpServer::Impl {
  asio::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  Render render;
  std::thread thread;
  uint16_t port = 0;

  void accept() {
    acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
      if (ec) return;  // closed
      std::make_shared<Session>(std::move(socket), render)->run();
      accept();
    });
  }
};

StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::start(
    const std::string& address, uint16_t port, Render render) {
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->impl_ = std::make_unique<Impl>();
  Impl& m = *server->impl_;
  m.render = std::move(render);
  beast::error_code ec;
  const auto ip = asio::ip::make_address(address, ec);
  if (ec) return Status::invalid_argument("metrics address \"" + address + "\": " + ec.message());
  const tcp::endpoint endpoint(ip, port);
  m.acceptor.open(endpoint.protocol(), ec);
  if (!ec) m.acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) m.acceptor.bind(endpoint, ec);
  if (!ec) m.acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::unavailable("metrics endpoint " + address + ":" + std::to_string(port) + ": " +
                            ec.message());
  }
  m.port = m.acceptor.local_endpoint().port();
  m.accept();
  m.thread = std::thread([&m] { m.ioc.run(); });
  return server;
}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

uint16_t MetricsHttpServer::port() const { return impl_->port; }

void MetricsHttpServer::stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  asio::post(impl_->ioc, [m = impl_.get()] {
    beast::error_code ignored;
    m->acceptor.close(ignored);
    m->ioc.stop();
  });
  impl_->thread.join();
}

StatusOr<std::string> http_get(uint16_t port, const std::string& path) {
  try {
    asio::io_context ioc;
    beast::tcp_stream stream(ioc);
    stream.expires_after(std::chrono::seconds(5));
    stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
    http::request<http::empty_body> req(http::verb::get, path, 11);
    req.set(http::field::host, "127.0.0.1");
    http::write(stream, req);
    beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    if (res.result() != http::status::ok) {
      return Status::unavailable("HTTP " + std::to_string(res.result_int()));
    }
    return std::string(res.body());
  } catch (const std::exception& e) {
    return Status::unavailable(e.what());
  }
}

namespace {

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i =
      std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

std::string render_prometheus(const MetricsSnapshot& m) {
  const AgentStats& s = m.stats;
  const monitor::MonitorCounters& mc = m.counters;
  const monitor::Beliefs& b = m.beliefs;
  const ProcessUsage& usage = m.usage;
  std::ostringstream out;
  auto metric = [&](const char* name, const char* type, const char* help) {
    out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  };
  // A metric of one unlabelled sample.
  auto single = [&](const char* name, const char* type, const char* help, const auto& value) {
    metric(name, type, help);
    out << name << ' ' << value << '\n';
  };
  metric("parapilot_decisions_total", "counter", "Decisions taken, by action.");
  out << "parapilot_decisions_total{action=\"keep\"} " << s.decisions - s.switches_decided << '\n';
  out << "parapilot_decisions_total{action=\"switch\"} " << s.switches_decided << '\n';
  single("parapilot_features_clipped_total", "counter",
         "Policy inputs read at the normaliser's clip (saturated), by input.", s.features_clipped);
  for (const auto& [name, n] : s.features_clipped_by_input) {
    out << "parapilot_features_clipped_total{input=\"" << name << "\"} " << n << '\n';
  }
  single("parapilot_features_unseen_total", "counter",
         "Policy inputs outside the range training produced, by input.", s.features_unseen);
  for (const auto& [name, n] : s.features_unseen_by_input) {
    out << "parapilot_features_unseen_total{input=\"" << name << "\"} " << n << '\n';
  }
  metric("parapilot_migrations_total", "counter", "Layout switches, by outcome.");
  out << "parapilot_migrations_total{outcome=\"committed\"} " << s.migrations_committed << '\n';
  out << "parapilot_migrations_total{outcome=\"aborted\"} " << s.migrations_aborted << '\n';
  single("parapilot_migration_aborts_total", "counter", "Layout switches aborted.",
         s.migrations_aborted);
  single("parapilot_reverts_total", "counter", "Switches undone after they measured slower.",
         s.reverts_committed);
  single("parapilot_stragglers_detected_total", "counter", "Slow-rank detections.",
         s.stragglers_detected);
  single("parapilot_congested_links_detected_total", "counter", "Congested-link detections.",
         s.congested_links_detected);
  single("parapilot_ranks_lost_total", "counter", "Ranks that disconnected.", s.ranks_lost);
  single("parapilot_connected_ranks", "gauge", "Ranks connected now.", s.connected_ranks);
  single("parapilot_telemetry_accepted_total", "counter", "Telemetry samples used.", mc.accepted);
  metric("parapilot_telemetry_rejected_total", "counter", "Telemetry samples rejected, by reason.");
  for (const auto& [reason, n] : mc.rejected_by_reason) {
    out << "parapilot_telemetry_rejected_total{reason=\"" << reason << "\"} " << n << '\n';
  }
  single("parapilot_telemetry_outliers_total", "counter", "Samples not averaged in (outliers).",
         mc.outliers);
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
  if (m.tokens_per_rank_step > 0) {
    const double tokens_per_step = m.tokens_per_rank_step;
    metric("parapilot_rank_tokens_per_second", "gauge",
           "Per-rank tokens per second (equal shares).");
    for (size_t r = 0; r < b.rank_steps_per_s.size(); ++r) {
      out << "parapilot_rank_tokens_per_second{rank=\"" << r << "\"} "
          << b.rank_steps_per_s[r] * tokens_per_step << '\n';
    }
  }
  metric("parapilot_rank_samples", "gauge", "Samples in each rank's last step.");
  for (size_t r = 0; r < b.rank_samples.size(); ++r) {
    out << "parapilot_rank_samples{rank=\"" << r << "\"} " << b.rank_samples[r] << '\n';
  }
  metric("parapilot_rank_speed", "gauge",
         "Believed per-rank compute speed (1 = as fast as peers).");
  for (size_t r = 0; r < b.conditions.gpu_speed.size(); ++r) {
    out << "parapilot_rank_speed{rank=\"" << r << "\"} " << b.conditions.gpu_speed[r] << '\n';
  }
  single("process_cpu_seconds_total", "counter", "CPU time of the agent process.", usage.cpu_s);
  single("process_max_resident_memory_bytes", "gauge", "Peak resident memory of the agent.",
         usage.max_rss_bytes);
  return out.str();
}

}  // namespace parapilot::agent::deploy
