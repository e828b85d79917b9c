// The TCP server's hand-off from its I/O threads to their decode threads: a streaming peer's
// reads are decoded on the decode thread in order, a stuck handler stops the server reading
// (bounded memory, backpressure into the peer's socket), and stop() delivers what was read
// before it, then the peer's disconnect, last. No timing assertions beyond generous timeouts.
#include <doctest/doctest.h>

#include <sys/socket.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <variant>

#include "tests/transport/raw_peer.h"
#include "tests/transport/test_util.h"
#include "transport/bus.h"

using namespace parapilot::transport;
using namespace parapilot::transport::testing;
using namespace std::chrono_literals;

namespace {

/// A handler that blocks every message from the `block_at`-th (0-based) on until opened, and
/// records the steps of the telemetry it delivered and whether the peer's disconnect came last.
struct GatedSink {
  std::uint64_t block_at = 0;
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  std::uint64_t seen = 0;             // guarded by mu
  bool blocked = false;               // guarded by mu: a handler waits at the gate
  std::vector<std::uint64_t> steps;   // guarded by mu
  int disconnects = 0;                // guarded by mu
  bool message_after_disconnect = false;  // guarded by mu

  ServerHandlers handlers() {
    ServerHandlers h;
    h.on_message = [this](PeerId, Message&& m) {
      std::unique_lock lk(mu);
      if (disconnects > 0) message_after_disconnect = true;
      if (seen++ >= block_at) {
        blocked = true;
        cv.wait(lk, [&] { return open; });
        blocked = false;
      }
      if (const auto* t = std::get_if<Telemetry>(&m)) steps.push_back(t->step);
    };
    h.on_disconnect = [this](PeerId, std::string_view) {
      std::lock_guard lk(mu);
      ++disconnects;
    };
    return h;
  }
  void release() {
    {
      std::lock_guard lk(mu);
      open = true;
    }
    cv.notify_all();
  }
  bool is_blocked() {
    std::lock_guard lk(mu);
    return blocked;
  }
};

ServerOptions handoff_server_options(LogCapture& log) {
  ServerOptions o;
  o.secret = Secret(kTestSecret);
  o.io_threads = 1;
  o.max_frame_bytes = kTestMaxFrameBytes;
  o.heartbeat_timeout_ms = 60'000;
  o.logger = log.logger();
  return o;
}

/// Frames of consecutive telemetry steps from `*next_step`, about `bytes` of them.
std::string telemetry_frames(std::uint64_t* next_step, std::size_t bytes) {
  std::string out;
  while (out.size() < bytes) {
    if (!append_frame(make_telemetry(0, (*next_step)++), out).ok()) FAIL("cannot frame telemetry");
  }
  return out;
}

/// Streams telemetry frames of consecutive steps into a raw peer's socket.
struct Streamer {
  explicit Streamer(RawPeer& p) : peer(p) {}
  RawPeer& peer;
  std::uint64_t next_step = 0;  // steps [0, next_step) are framed
  std::string pending;          // framed, not yet written
  std::size_t written = 0;

  /// Writes without blocking until the socket stays full for `stall` or `limit` bytes went out.
  void until_stalled(std::size_t limit, std::chrono::milliseconds stall) {
    const int fd = peer.socket().native_handle();
    auto last_progress = std::chrono::steady_clock::now();
    while (written < limit) {
      if (pending.empty()) pending = telemetry_frames(&next_step, 64u << 10);
      const ssize_t n = ::send(fd, pending.data(), pending.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        written += static_cast<std::size_t>(n);
        pending.erase(0, static_cast<std::size_t>(n));
        last_progress = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - last_progress > stall) return;
      std::this_thread::sleep_for(1ms);
    }
  }
  /// Writes what is pending (blocking), so that the stream ends on a frame boundary.
  bool finish() {
    const bool ok = peer.write(pending);
    written += pending.size();
    pending.clear();
    return ok;
  }
};

bool in_order_from_zero(const std::vector<std::uint64_t>& steps) {
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (steps[i] != i) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("tcp hand-off: a streaming client's telemetry is flushed and decoded on the decode "
          "thread, in order") {
  LogCapture log;
  GatedSink sink;
  sink.block_at = ~std::uint64_t{0};  // never blocks
  auto server_r = make_tcp_server(handoff_server_options(log), sink.handlers());
  REQUIRE(server_r.ok());
  auto server = std::move(*server_r);
  ClientOptions co;
  co.port = server->port();
  co.secret = Secret(kTestSecret);
  co.max_frame_bytes = kTestMaxFrameBytes;
  co.telemetry_buffer_capacity = 1'000'000;  // nothing is evicted
  // No heartbeat write while the test runs: the queue is written by the client's own (delayed,
  // for a streaming caller) flushes only.
  co.heartbeat_interval_ms = 60'000;
  co.heartbeat_timeout_ms = 120'000;
  co.logger = log.logger();
  auto client_r = make_tcp_client(co, {});
  REQUIRE(client_r.ok());
  auto client = std::move(*client_r);
  REQUIRE(wait_until([&] { return client->connected(); }));
  constexpr std::uint64_t kMessages = 100'000;  // ~20 MB, sent as fast as the client queues it
  for (std::uint64_t s = 0; s < kMessages; ++s) REQUIRE(client->send(make_telemetry(0, s)));
  REQUIRE(client->flush(60s));
  REQUIRE(wait_until(
      [&] {
        std::lock_guard lk(sink.mu);
        return sink.steps.size() == kMessages;
      },
      60s));
  CHECK(server->stats().reads_handed_off > 0);
  std::lock_guard lk(sink.mu);
  CHECK(in_order_from_zero(sink.steps));
}

TEST_CASE("tcp hand-off: a stuck handler stops the server reading; nothing is lost") {
  LogCapture log;
  GatedSink sink;
  sink.block_at = 2'000;  // ~450 KB in: the peer streams and its reads are handed off
  auto server_r = make_tcp_server(handoff_server_options(log), sink.handlers());
  REQUIRE(server_r.ok());
  auto server = std::move(*server_r);
  RawPeer peer;
  REQUIRE(peer.connect(server->port()));
  REQUIRE(peer.client_handshake(Secret(kTestSecret)) != 0);

  Streamer out{peer};
  // Without a bound the server would read all 128 MiB; with it, the bytes in flight are what
  // the kernel's socket buffers hold (at most 32 MiB received + 4 MiB sent here) plus 256 KiB.
  constexpr std::size_t kLimit = 128u << 20;
  out.until_stalled(kLimit, 500ms);
  REQUIRE(sink.is_blocked());
  MESSAGE("written before the stall: ", out.written, " bytes");
  CHECK(out.written < (48u << 20));
  CHECK(server->stats().reads_handed_off > 0);

  sink.release();  // the handler catches up, the server reads again, everything arrives
  REQUIRE(out.finish());
  const std::uint64_t expected = out.next_step;
  REQUIRE(wait_until(
      [&] {
        std::lock_guard lk(sink.mu);
        return sink.steps.size() == expected;
      },
      60s));
  std::lock_guard lk(sink.mu);
  CHECK(in_order_from_zero(sink.steps));
  CHECK(sink.disconnects == 0);  // a backed-up peer is not mistaken for a silent one
}

TEST_CASE("tcp hand-off: stop() delivers what was read, then the disconnect, last") {
  LogCapture log;
  GatedSink sink;
  sink.block_at = 2'000;
  auto server_r = make_tcp_server(handoff_server_options(log), sink.handlers());
  REQUIRE(server_r.ok());
  auto server = std::move(*server_r);
  RawPeer peer;
  REQUIRE(peer.connect(server->port()));
  REQUIRE(peer.client_handshake(Secret(kTestSecret)) != 0);
  Streamer out{peer};
  out.until_stalled(64u << 20, 500ms);  // the handler is stuck with frames read behind it
  REQUIRE(sink.is_blocked());
  REQUIRE(server->stats().reads_handed_off > 0);

  std::thread stopper([&] { server->stop(); });
  // stop() closes the connection and waits for the decode thread, stuck in the handler.
  std::this_thread::sleep_for(200ms);
  {
    std::lock_guard lk(sink.mu);
    CHECK(sink.disconnects == 0);  // not before the messages already read
  }
  sink.release();
  stopper.join();
  std::lock_guard lk(sink.mu);
  CHECK(sink.disconnects == 1);
  CHECK_FALSE(sink.message_after_disconnect);
  CHECK(sink.steps.size() > sink.block_at);  // what was read behind the stuck handler arrived
  CHECK(in_order_from_zero(sink.steps));
}
