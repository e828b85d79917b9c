// A hand-driven TCP peer for tests: writes arbitrary bytes, performs either half of the
// handshake by hand, and observes whether the other side closed the connection.
#pragma once

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <optional>
#include <string>

#include "tests/transport/test_util.h"
#include "transport/auth.h"
#include "transport/frame.h"

namespace parapilot::transport::testing {

class RawPeer {
 public:
  using tcp = boost::asio::ip::tcp;

  RawPeer() = default;

  /// Accepts one connection from `acceptor` (blocking).
  bool accept_from(tcp::acceptor& acceptor) {
    boost::system::error_code ec;
    acceptor.accept(sock_, ec);
    return !ec;
  }

  bool connect(std::uint16_t port) {
    boost::system::error_code ec;
    sock_.connect(tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"), port), ec);
    return !ec;
  }

  bool write(const std::string& bytes) {
    boost::system::error_code ec;
    boost::asio::write(sock_, boost::asio::buffer(bytes), ec);
    return !ec;
  }
  bool send(const Message& m) { return write(*encode_frame(m)); }

  void shutdown_send() {
    boost::system::error_code ec;
    sock_.shutdown(tcp::socket::shutdown_send, ec);
  }

  /// Reads exactly n bytes; nullopt on EOF, error or timeout.
  std::optional<std::string> read_exact(std::size_t n, std::chrono::milliseconds timeout) {
    std::string buf(n, '\0');
    bool done = false;
    boost::system::error_code result;
    boost::asio::async_read(sock_, boost::asio::buffer(buf),
                            [&](const boost::system::error_code& ec, std::size_t) {
                              done = true;
                              result = ec;
                            });
    io_.restart();
    io_.run_for(timeout);
    if (!done) {
      boost::system::error_code ec;
      sock_.cancel(ec);
      io_.restart();
      io_.run();
      return std::nullopt;
    }
    if (result) return std::nullopt;
    return buf;
  }

  /// Reads the next message other than a heartbeat.
  std::optional<Message> read_message(
      std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    for (;;) {
      auto header = read_exact(kFrameHeaderBytes, timeout);
      if (!header) return std::nullopt;
      const FrameHeader h = parse_header(
          std::span(reinterpret_cast<const std::uint8_t*>(header->data()), header->size()));
      if (h.length > (64u << 20)) return std::nullopt;
      auto payload = read_exact(h.length, timeout);
      if (!payload) return std::nullopt;
      const std::string frame = *header + *payload;
      auto m = decode_frame(
          std::span(reinterpret_cast<const std::uint8_t*>(frame.data()), frame.size()), 64u << 20);
      if (!m) return std::nullopt;
      if (!std::holds_alternative<Heartbeat>(*m)) return std::move(*m);
    }
  }

  /// True when the other side closes the connection within `timeout` (frames are discarded).
  bool closed_by_peer(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      std::array<char, 4096> buf{};
      bool done = false;
      boost::system::error_code result;
      sock_.async_read_some(boost::asio::buffer(buf),
                            [&](const boost::system::error_code& ec, std::size_t) {
                              done = true;
                              result = ec;
                            });
      io_.restart();
      io_.run_for(left);
      if (!done) {
        boost::system::error_code ec;
        sock_.cancel(ec);
        io_.restart();
        io_.run();
        return false;
      }
      if (result) return true;  // EOF or reset
    }
  }

  /// Client half of the handshake. Returns the peer id from Welcome, or 0.
  PeerId client_handshake(const Secret& secret, const std::string& name = "raw-peer") {
    Hello hello;
    hello.name = name;
    hello.client_nonce = random_nonce();
    if (!send(hello)) return 0;
    auto ch = read_message();
    if (!ch || !std::holds_alternative<Challenge>(*ch)) return 0;
    const auto& c = std::get<Challenge>(*ch);
    if (server_proof(secret, hello.client_nonce, c.server_nonce) != c.server_proof) return 0;
    if (!send(Auth{client_proof(secret, c.server_nonce, hello.client_nonce)})) return 0;
    auto w = read_message();
    if (!w || !std::holds_alternative<Welcome>(*w)) return 0;
    return std::get<Welcome>(*w).peer_id;
  }

  /// Server half of the handshake (for fake servers). True when the client authenticated.
  bool server_handshake(const Secret& secret, PeerId id) {
    auto h = read_message();
    if (!h || !std::holds_alternative<Hello>(*h)) return false;
    const Nonce cn = std::get<Hello>(*h).client_nonce;
    const Nonce sn = random_nonce();
    if (!send(Challenge{sn, server_proof(secret, cn, sn)})) return false;
    auto a = read_message();
    if (!a || !std::holds_alternative<Auth>(*a)) return false;
    if (std::get<Auth>(*a).client_proof != client_proof(secret, sn, cn)) return false;
    return send(Welcome{id, 1000, kDefaultMaxFrameBytes});
  }

  boost::asio::io_context& io() { return io_; }
  tcp::socket& socket() { return sock_; }

 private:
  boost::asio::io_context io_;
  tcp::socket sock_{io_};
};

}  // namespace parapilot::transport::testing
