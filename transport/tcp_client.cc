// TCP client: reconnects with exponential backoff, buffers while disconnected, heartbeats.
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <random>
#include <vector>

#include <sys/socket.h>

#include "transport/bus.h"
#include "transport/io_runtime.h"

namespace parapilot::transport {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;
using std::chrono::milliseconds;

// send() writes directly from the caller's thread when the previous direct write on the same
// connection is at least this old (sparse traffic); denser traffic is batched by the I/O thread.
constexpr std::int64_t kDirectWriteGapNs = 50'000;
// A thread that calls send() more than kStreamingMsgsPerSecond times per second (measured over
// blocks of kRateWindowSends calls) is streaming: its messages go through the queue, so that the
// I/O thread batches them and the caller does not pay one system call per message.
constexpr std::int64_t kStreamingMsgsPerSecond = 150'000;
constexpr std::int64_t kRateWindowSends = 4096;  // ~10-40 ms: a burst after a stall is not a stream
// ...except on a client it last sent to kFanOutGapNs or longer ago: a thread fanning out to
// many clients (a simulated cluster's ranks, one frame each per step) has nothing for the I/O
// thread to coalesce on each, so it writes directly rather than pay a wake-up per frame.
constexpr std::int64_t kFanOutGapNs = 10'000'000;
// A streaming caller's frames wait this long for more before the I/O thread writes them: the I/O
// thread wakes once per batch instead of racing the caller for the queue a few frames at a time
// (each wake-up and each contended lock is a system call on both threads).
constexpr auto kStreamingFlushDelay = std::chrono::microseconds(200);

bool caller_is_streaming(std::int64_t now_ns) {
  thread_local std::int64_t window_start_ns = 0;
  thread_local std::int64_t count = 0;
  thread_local bool streaming = false;
  if (count == 0) window_start_ns = now_ns;
  if (++count == kRateWindowSends) {
    const std::int64_t elapsed_ns = now_ns - window_start_ns;
    streaming = elapsed_ns * kStreamingMsgsPerSecond < kRateWindowSends * 1'000'000'000LL;
    count = 0;
  }
  return streaming;
}

// The frames a client has queued, oldest first: back to back in one buffer (no allocation or
// copy per frame beyond the append), each frame's size and kind beside them. Evicting the oldest
// telemetry marks it dead; dead frames are skipped when a batch is taken, and compacted away
// once they outweigh the live ones. Not thread-safe (the client guards it with mu_).
class FrameQueue {
 public:
  std::size_t size() const { return live_; }
  bool empty() const { return live_ == 0; }
  std::size_t telemetry() const { return telemetry_; }

  void push(std::string_view frame, bool telemetry) {
    bytes_.append(frame);
    marks_.push_back(Mark{static_cast<std::uint32_t>(frame.size()), telemetry, false});
    ++live_;
    telemetry_ += telemetry ? 1 : 0;
  }

  /// Drops the oldest telemetry frame still queued; false when there is none.
  bool evict_oldest_telemetry() {
    for (std::size_t i = hint_; i < marks_.size(); ++i) {
      Mark& m = marks_[i];
      if (m.dead || !m.telemetry) continue;
      m.dead = true;
      dead_bytes_ += m.bytes;
      --live_;
      --telemetry_;
      hint_ = i + 1;
      if (dead_bytes_ > kCompactBytes && dead_bytes_ > bytes_.size() - begin_ - dead_bytes_) {
        compact();
      }
      return true;
    }
    return false;
  }

  /// Moves whole frames from the front into `out` until it holds at least `max_bytes` or the
  /// queue is empty; returns how many frames moved.
  std::size_t take(std::string& out, std::size_t max_bytes) {
    if (out.empty() && begin_ == 0 && dead_bytes_ == 0 && bytes_.size() <= max_bytes) {
      // Everything, in one piece: hand the buffer over.
      const std::size_t n = live_;
      out.swap(bytes_);
      bytes_.clear();
      marks_.clear();
      live_ = telemetry_ = 0;
      hint_ = 0;
      return n;
    }
    std::size_t n = 0, popped = 0;
    std::size_t run_begin = begin_, run_bytes = 0;  // live frames in a row, copied at once
    while (!marks_.empty() && out.size() + run_bytes < max_bytes) {
      const Mark m = marks_.front();
      marks_.pop_front();
      ++popped;
      if (m.dead) {
        out.append(bytes_, run_begin, run_bytes);
        run_begin = begin_ + m.bytes;
        run_bytes = 0;
        dead_bytes_ -= m.bytes;
      } else {
        run_bytes += m.bytes;
        --live_;
        telemetry_ -= m.telemetry ? 1 : 0;
        ++n;
      }
      begin_ += m.bytes;
    }
    out.append(bytes_, run_begin, run_bytes);
    hint_ = hint_ > popped ? hint_ - popped : 0;
    if (marks_.empty()) {
      bytes_.clear();
      begin_ = 0;
    } else if (begin_ > kCompactBytes && begin_ > bytes_.size() / 2) {
      bytes_.erase(0, begin_);
      begin_ = 0;
    }
    return n;
  }

 private:
  static constexpr std::size_t kCompactBytes = 64u << 10;
  struct Mark {
    std::uint32_t bytes;
    bool telemetry;
    bool dead;
  };
  // Rewrites the buffer with the live frames only.
  void compact() {
    std::string live;
    live.reserve(bytes_.size() - begin_ - dead_bytes_);
    std::deque<Mark> marks;
    std::size_t at = begin_;
    for (const Mark& m : marks_) {
      if (!m.dead) {
        live.append(bytes_, at, m.bytes);
        marks.push_back(m);
      }
      at += m.bytes;
    }
    bytes_.swap(live);
    marks_.swap(marks);
    begin_ = 0;
    dead_bytes_ = 0;
    hint_ = 0;
  }

  std::string bytes_;  // frames at [begin_, size()), dead ones included
  std::size_t begin_ = 0;
  std::deque<Mark> marks_;
  std::size_t live_ = 0, telemetry_ = 0, dead_bytes_ = 0;
  std::size_t hint_ = 0;  // no live telemetry among marks_[0, hint_)
};

class TcpClientImpl : public std::enable_shared_from_this<TcpClientImpl> {
 public:
  TcpClientImpl(ClientOptions options, ClientHandlers handlers, asio::io_context& ctx)
      : opt_(std::move(options)),
        handlers_(std::move(handlers)),
        strand_(asio::make_strand(ctx)),
        resolver_(strand_),
        tick_timer_(strand_),
        retry_timer_(strand_),
        flush_timer_(strand_),
        backoff_ms_(std::max<std::uint32_t>(1, opt_.reconnect_initial_ms)),
        rng_(std::random_device{}()) {
    if (!opt_.logger) opt_.logger = stderr_logger();
  }

  void start() {
    asio::post(strand_, [self = shared_from_this()] {
      self->arm_tick();
      self->connect_now();
    });
  }

  bool send(const Message& m) {
    if (stopped_.load(std::memory_order_acquire) || is_internal_type(type_of(m))) return false;
    // Encoded into a per-thread buffer, then written or appended to the queue: no allocation
    // per message.
    thread_local std::string frame;
    frame.clear();
    if (auto r = append_frame(m, frame, opt_.max_frame_bytes); !r) {
      log(LogLevel::warn, "not sending: " + r.status().message());
      return false;
    }
    const bool telemetry = std::holds_alternative<Telemetry>(m);
    bool post = false;
    bool streaming = false;
    {
      std::lock_guard lk(mu_);
      const std::int64_t now = now_ns();
      const std::int64_t since_send = now - last_send_ns_;
      last_send_ns_ = now;
      streaming = since_send < kFanOutGapNs && caller_is_streaming(now);
      if (fd_ >= 0 && !write_in_flight_ && queue_.empty() &&
          now - last_direct_ns_ >= kDirectWriteGapNs && !streaming) {
        // Fast path for sparse traffic: nothing is pending, so write from the caller's thread
        // without waking the I/O thread. Dense traffic takes the queue, where the I/O thread
        // coalesces frames into large writes. fd_ is only closed under mu_, so it is valid here.
        last_direct_ns_ = now;
        const ssize_t n = ::send(fd_, frame.data(), frame.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
          last_tx_ns_.store(now, std::memory_order_relaxed);
          if (static_cast<std::size_t>(n) == frame.size()) {
            messages_sent_.fetch_add(1, std::memory_order_relaxed);
            return true;
          }
          // The rest of a partly written frame goes first (the queue is empty) and is never
          // evicted.
          queue_.push(std::string_view(frame).substr(static_cast<std::size_t>(n)), false);
          schedule_flush_locked(post);
          if (post) post_flush(false);
          return true;
        }
        // EAGAIN (socket buffer full) or an error the I/O thread will see: queue it.
      }
      if (telemetry) {
        if (opt_.telemetry_buffer_capacity == 0) return true;  // dropped at once
        if (queue_.telemetry() >= opt_.telemetry_buffer_capacity &&
            queue_.evict_oldest_telemetry()) {
          ++telemetry_dropped_;
        }
      }
      queue_.push(frame, telemetry);
      schedule_flush_locked(post);
    }
    if (post) post_flush(streaming);
    return true;
  }

  bool connected() const { return connected_.load(std::memory_order_acquire); }

  bool flush(milliseconds timeout) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, timeout, [&] { return queue_.empty() && !write_in_flight_; });
  }

  ClientStats stats() const {
    ClientStats s;
    s.connects = connects_.load();
    s.messages_sent = messages_sent_.load();
    s.messages_received = messages_received_.load();
    std::lock_guard lk(mu_);
    s.telemetry_dropped = telemetry_dropped_;
    s.queued = queue_.size();
    return s;
  }

  void stop() {
    if (stopped_.exchange(true)) return;
    auto shut = [self = shared_from_this()] {
      self->state_ = State::stopped;
      self->connected_.store(false);
      self->tick_timer_.cancel();
      self->retry_timer_.cancel();
      self->resolver_.cancel();
      self->close_socket();
    };
    if (strand_.running_in_this_thread()) {
      shut();
    } else {
      std::promise<void> done;
      auto fut = done.get_future();
      asio::post(strand_, [&shut, &done] {
        shut();
        done.set_value();
      });
      fut.wait();
    }
    std::lock_guard lk(mu_);
    cv_.notify_all();
  }

 private:
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
  }

  // mu_ held. Sets `post` when the caller must call post_flush() (after unlocking).
  // No post while a write is in flight: its completion calls start_write(), which takes what
  // was queued meanwhile.
  void schedule_flush_locked(bool& post) {
    if (ready_ && !flush_posted_ && !write_in_flight_) {
      flush_posted_ = true;
      post = true;
    }
  }

  // `delay`: the caller streams; its next frames join this batch (kStreamingFlushDelay).
  // flush_posted_ stays set until the flush runs, so no further wake-up is posted meanwhile;
  // flush_timer_ is never cancelled, so the flush always runs.
  void post_flush(bool delay) {
    asio::post(strand_, [self = shared_from_this(), delay] {
      auto flush = [self] {
        {
          std::lock_guard lk(self->mu_);
          self->flush_posted_ = false;
        }
        self->start_write();
      };
      if (!delay) {
        flush();
        return;
      }
      self->flush_timer_.expires_after(kStreamingFlushDelay);
      self->flush_timer_.async_wait([flush](const error_code&) { flush(); });
    });
  }

  // Strand. Forgets the socket for the fast path, then closes it.
  void close_socket() {
    {
      std::lock_guard lk(mu_);
      ready_ = false;
      fd_ = -1;
      write_in_flight_ = false;
    }
    error_code ec;
    if (conn_) conn_->sock.close(ec);
    conn_.reset();
  }

  enum class State { idle, connecting, handshaking, ready, stopped };
  struct Conn {
    explicit Conn(asio::strand<asio::io_context::executor_type>& s, std::uint32_t max_frame)
        : sock(s), decoder(max_frame) {}
    tcp::socket sock;
    FrameDecoder decoder;
  };

  void log(LogLevel level, const std::string& line) const {
    opt_.logger(level, "client '" + opt_.name + "': " + line);
  }

  void connect_now() {
    if (state_ == State::stopped) return;
    state_ = State::connecting;
    phase_start_ = Clock::now();
    auto conn = std::make_shared<Conn>(strand_, opt_.max_frame_bytes);
    conn_ = conn;
    resolver_.async_resolve(
        opt_.server_address, std::to_string(opt_.port),
        [self = shared_from_this(), conn](const error_code& ec,
                                          tcp::resolver::results_type results) {
          if (conn != self->conn_) return;
          if (ec) {
            self->fail("cannot resolve " + self->opt_.server_address + ": " + ec.message());
            return;
          }
          asio::async_connect(conn->sock, results,
                              [self, conn](const error_code& ec2, const tcp::endpoint&) {
                                if (conn != self->conn_) return;
                                if (ec2) {
                                  self->fail("connect failed: " + ec2.message());
                                  return;
                                }
                                self->on_connected();
                              });
        });
  }

  void on_connected() {
    error_code ec;
    conn_->sock.set_option(tcp::no_delay(true), ec);
    state_ = State::handshaking;
    last_rx_ = Clock::now();
    last_tx_ns_.store(now_ns(), std::memory_order_relaxed);
    Hello hello;
    hello.role = opt_.role;
    hello.rank = opt_.rank;
    hello.name = opt_.name;
    client_nonce_ = random_nonce();
    hello.client_nonce = client_nonce_;
    send_priority(hello);
    read();
  }

  void read() {
    auto conn = conn_;
    auto space = conn->decoder.prepare_read();
    conn->sock.async_read_some(
        asio::buffer(space.data(), space.size()),
        [self = shared_from_this(), conn](const error_code& ec, std::size_t n) {
          if (conn != self->conn_) return;
          self->on_read(ec, n);
        });
  }

  void on_read(const error_code& ec, std::size_t n) {
    if (ec) {
      if (state_ == State::handshaking) {
        fail("connection closed during the handshake (wrong secret?): " + ec.message());
      } else {
        fail(ec == asio::error::eof ? "server closed the connection"
                                    : "read error: " + ec.message());
      }
      return;
    }
    auto conn = conn_;
    conn->decoder.commit(n);
    last_rx_ = Clock::now();
    Message m;
    for (;;) {
      const auto st = conn->decoder.next(m);
      if (st == FrameDecoder::Status::need_more) break;
      if (st == FrameDecoder::Status::error) {
        fail("bad frame from server: " + conn->decoder.error());
        return;
      }
      handle(std::move(m));
      if (conn != conn_) return;  // closed while handling
    }
    read();
  }

  void handle(Message&& m) {
    if (state_ == State::handshaking) {
      if (auto* ch = std::get_if<Challenge>(&m)) {
        if (got_challenge_) {
          fail("second challenge from server");
          return;
        }
        const Proof expected = server_proof(opt_.secret, client_nonce_, ch->server_nonce);
        if (!constant_time_equal(expected, ch->server_proof)) {
          fail("server failed authentication");
          return;
        }
        got_challenge_ = true;
        send_priority(Auth{client_proof(opt_.secret, ch->server_nonce, client_nonce_)});
        return;
      }
      if (auto* w = std::get_if<Welcome>(&m); w != nullptr && got_challenge_) {
        state_ = State::ready;
        peer_id_ = w->peer_id;
        backoff_ms_ = std::max<std::uint32_t>(1, opt_.reconnect_initial_ms);
        // A healthy server is silent for up to the interval it announces: twice that at least.
        timeout_ms_ = std::max(opt_.heartbeat_timeout_ms,
                               2 * std::min(w->heartbeat_interval_ms, UINT32_MAX / 2));
        connects_.fetch_add(1);
        {
          std::lock_guard lk(mu_);
          ready_ = true;
          fd_ = conn_->sock.native_handle();
        }
        connected_.store(true, std::memory_order_release);
        log(LogLevel::info, "connected to " + opt_.server_address + ":" +
                                std::to_string(opt_.port) + " as peer " + std::to_string(peer_id_));
        if (handlers_.on_connect) handlers_.on_connect(peer_id_);
        start_write();
        return;
      }
      fail("unexpected " + std::string(type_name(type_of(m))) + " during the handshake");
      return;
    }
    switch (type_of(m)) {
      case MessageType::heartbeat:
        return;
      case MessageType::hello:
      case MessageType::challenge:
      case MessageType::auth:
      case MessageType::welcome:
        fail("unexpected " + std::string(type_name(type_of(m))) + " after the handshake");
        return;
      default:
        messages_received_.fetch_add(1, std::memory_order_relaxed);
        if (handlers_.on_message) handlers_.on_message(std::move(m));
        return;
    }
  }

  // Handshake frames and heartbeats: written before anything queued by users.
  void send_priority(const Message& m) {
    auto frame = encode_frame(m, opt_.max_frame_bytes);
    if (!frame) return;
    priority_out_ += *frame;
    start_write();
  }

  void start_write() {
    if (!conn_ || state_ == State::connecting || state_ == State::stopped) return;
    auto batch = std::make_shared<std::string>();
    std::size_t count = 0;
    {
      // The queue's bytes are handed over whole when they fit (the common case), else copied
      // in runs of live frames, under the lock.
      std::lock_guard lk(mu_);
      if (write_in_flight_) return;
      batch->swap(priority_out_);
      if (state_ == State::ready && !queue_.empty()) {
        count = queue_.take(*batch, opt_.max_batch_bytes);
      }
      if (batch->empty()) {
        cv_.notify_all();
        return;
      }
      write_in_flight_ = true;
    }
    last_tx_ns_.store(now_ns(), std::memory_order_relaxed);
    auto conn = conn_;
    asio::async_write(
        conn->sock, asio::buffer(*batch),
        [self = shared_from_this(), conn, batch, count](const error_code& ec, std::size_t) {
          if (conn != self->conn_) return;
          {
            std::lock_guard lk(self->mu_);
            self->write_in_flight_ = false;
          }
          if (ec) {
            self->fail("write error: " + ec.message());
            return;
          }
          self->messages_sent_.fetch_add(count, std::memory_order_relaxed);
          self->start_write();
        });
  }

  void arm_tick() {
    const std::uint32_t tick_ms = std::clamp<std::uint32_t>(
        std::min({opt_.heartbeat_interval_ms, opt_.heartbeat_timeout_ms / 4,
                  opt_.connect_timeout_ms / 4}),
        5, 1000);
    tick_timer_.expires_after(milliseconds(tick_ms));
    tick_timer_.async_wait([self = shared_from_this()](const error_code& ec) {
      if (ec || self->state_ == State::stopped) return;
      self->on_tick();
      self->arm_tick();
    });
  }

  void on_tick() {
    const auto now = Clock::now();
    if (state_ == State::connecting || state_ == State::handshaking) {
      if (now - phase_start_ > milliseconds(opt_.connect_timeout_ms)) {
        fail("connect/handshake timeout (" + std::to_string(opt_.connect_timeout_ms) + " ms)");
      }
    } else if (state_ == State::ready) {
      if (now - last_rx_ > milliseconds(timeout_ms_)) {
        fail("heartbeat timeout (" + std::to_string(timeout_ms_) + " ms)");
        return;
      }
      const auto idle_ns = now_ns() - last_tx_ns_.load(std::memory_order_relaxed);
      if (idle_ns >= std::int64_t{opt_.heartbeat_interval_ms} * 1'000'000) {
        last_tx_ns_.store(now_ns(), std::memory_order_relaxed);
        const auto ns =
            std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch());
        send_priority(Heartbeat{++heartbeat_seq_, static_cast<std::uint64_t>(ns.count())});
      }
    }
  }

  // Drops the current connection and schedules a reconnect.
  void fail(const std::string& reason) {
    if (state_ == State::stopped || !conn_) return;
    const bool was_ready = state_ == State::ready;
    close_socket();
    resolver_.cancel();
    state_ = State::idle;
    got_challenge_ = false;
    priority_out_.clear();
    connected_.store(false, std::memory_order_release);
    const std::uint32_t base = backoff_ms_;
    backoff_ms_ = std::min<std::uint32_t>(std::max(opt_.reconnect_max_ms, 1u),
                                          base > 0x7FFFFFFFu ? base : base * 2);
    std::uniform_int_distribution<std::uint32_t> jitter(base / 2, base);
    const std::uint32_t delay = jitter(rng_);
    if (was_ready) {
      log(LogLevel::warn, "disconnected: " + reason);
      if (handlers_.on_disconnect) handlers_.on_disconnect(reason);
    } else {
      log(LogLevel::info, reason + "; retrying in " + std::to_string(delay) + " ms");
    }
    retry_timer_.expires_after(milliseconds(delay));
    retry_timer_.async_wait([self = shared_from_this()](const error_code& e) {
      if (e || self->state_ == State::stopped) return;
      self->connect_now();
    });
  }

  ClientOptions opt_;
  ClientHandlers handlers_;
  asio::strand<asio::io_context::executor_type> strand_;
  tcp::resolver resolver_;
  asio::steady_timer tick_timer_;
  asio::steady_timer retry_timer_;
  asio::steady_timer flush_timer_;  // a streaming caller's delayed flush (post_flush)

  // Strand only.
  State state_ = State::idle;
  std::shared_ptr<Conn> conn_;
  Nonce client_nonce_{};
  bool got_challenge_ = false;
  PeerId peer_id_ = 0;
  std::uint32_t backoff_ms_;
  // The silence after which the server is dead on this connection (ClientOptions).
  std::uint32_t timeout_ms_ = 0;
  std::mt19937 rng_;
  Clock::time_point phase_start_{}, last_rx_{};
  std::atomic<std::int64_t> last_tx_ns_{0};  // steady clock; written by senders and the strand
  std::uint64_t heartbeat_seq_ = 0;

  std::atomic<bool> stopped_{false};
  std::atomic<bool> connected_{false};
  std::atomic<std::uint64_t> connects_{0}, messages_sent_{0}, messages_received_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  FrameQueue queue_;                     // guarded by mu_
  std::string priority_out_;             // guarded by mu_ when swapped; strand writes
  std::uint64_t telemetry_dropped_ = 0;  // guarded by mu_
  bool ready_ = false;                   // guarded by mu_
  bool flush_posted_ = false;            // guarded by mu_
  bool write_in_flight_ = false;         // guarded by mu_
  int fd_ = -1;  // guarded by mu_: the authenticated socket for the send() fast path, or -1
  std::int64_t last_direct_ns_ = 0;  // guarded by mu_: time of the last fast-path write
  std::int64_t last_send_ns_ = 0;    // guarded by mu_: time of the last send()
};

class TcpClient final : public Client {
 public:
  TcpClient(std::shared_ptr<IoRuntime> runtime, std::shared_ptr<TcpClientImpl> impl)
      : runtime_(std::move(runtime)), impl_(std::move(impl)) {}
  ~TcpClient() override { stop(); }
  bool send(const Message& m) override { return impl_->send(m); }
  bool connected() const override { return impl_->connected(); }
  bool flush(std::chrono::milliseconds timeout) override { return impl_->flush(timeout); }
  ClientStats stats() const override { return impl_->stats(); }
  void stop() override { impl_->stop(); }

 private:
  std::shared_ptr<IoRuntime> runtime_;  // destroyed after impl_ is stopped
  std::shared_ptr<TcpClientImpl> impl_;
};

}  // namespace

StatusOr<std::unique_ptr<Client>> make_tcp_client(ClientOptions options, ClientHandlers handlers,
                                                std::shared_ptr<IoRuntime> runtime) {
  if (options.secret.size() < kMinSecretBytes) {
    return Status::invalid_argument("client needs a shared secret of at least " + std::to_string(kMinSecretBytes) +
                 " bytes");
  }
  if (options.port == 0) return Status::invalid_argument("client needs the server port");
  if (options.name.empty() || options.name.size() > kMaxNameBytes) {
    return Status::invalid_argument("client name must have 1.." + std::to_string(kMaxNameBytes) + " bytes");
  }
  if (options.heartbeat_timeout_ms <= options.heartbeat_interval_ms) {
    return Status::invalid_argument("heartbeat_timeout_ms must exceed heartbeat_interval_ms");
  }
  if (!runtime) runtime = std::make_shared<IoRuntime>(1);
  auto impl =
      std::make_shared<TcpClientImpl>(std::move(options), std::move(handlers), runtime->impl().ctx);
  impl->start();
  return std::unique_ptr<Client>(std::make_unique<TcpClient>(std::move(runtime), std::move(impl)));
}

}  // namespace parapilot::transport
