#include "agent/deploy/metrics.h"

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

}  // namespace parapilot::agent::deploy
