// TCP server: one acceptor, N io_contexts (one thread each), connections spread round-robin.
// Each io_context has a decode thread beside it: a connection whose reads come in large (a
// streaming peer) hands the bytes it read to that thread, which decodes them and runs the
// handlers while the I/O thread reads on; sparse reads are decoded on the I/O thread.
#include <boost/asio/bind_executor.hpp>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "transport/bus.h"

namespace parapilot::transport {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

class TcpServer;
class ServerConn;

// A read of at least this many bytes on an authenticated connection is decoded on the decode
// thread (the peer streams); smaller reads are decoded at once on the I/O thread (no hand-off
// latency for sparse traffic).
constexpr std::size_t kHandOffReadBytes = 16u << 10;
// Bytes a connection may have read but not yet decoded. At the limit it stops reading until the
// decode thread catches up, so a slow handler backs up into the peer's socket (backpressure) and
// the server's memory per connection stays bounded.
constexpr std::size_t kMaxHandOffBytes = 256u << 10;
// Read buffers a connection keeps for reuse.
constexpr std::size_t kSpareReadBuffers = 4;

// The decode thread beside one I/O thread: runs connections' handed-off work, each connection's
// in order, connections round-robin (one batch of a connection at a time).
class DecodeThread {
 public:
  void start() {
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "pp-server-dec");
      run();
    });
  }
  /// Any thread: `c` has work (it is scheduled at most once at a time; see ServerConn::hand_off).
  void schedule(std::shared_ptr<ServerConn> c) {
    bool wake = false;
    {
      std::lock_guard lk(mu_);
      ready_.push_back(std::move(c));
      wake = idle_;
    }
    if (wake) cv_.notify_one();
  }
  /// Runs what is scheduled (and what that schedules), then joins. Call after the I/O threads
  /// stopped.
  void finish() {
    {
      std::lock_guard lk(mu_);
      stopping_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<ServerConn>> ready_;  // guarded by mu_
  bool idle_ = false;                              // guarded by mu_: waiting on cv_
  bool stopping_ = false;                          // guarded by mu_
  std::thread thread_;
};

class ServerConn : public std::enable_shared_from_this<ServerConn> {
 public:
  ServerConn(TcpServer& server, asio::io_context& ctx, DecodeThread& decode, tcp::socket sock,
             PeerId id, std::string remote);
  void start();
  /// Decode thread: runs the work handed off so far; true if more arrived meanwhile.
  bool drain();
  /// Any thread: start() on the connection's I/O thread.
  void start_async() {
    asio::post(ctx_, [self = shared_from_this()] { self->start(); });
  }
  /// Any thread. Appends an encoded frame to the send queue.
  bool enqueue(std::string_view frame);
  /// Any thread.
  void close_async(std::string reason, bool protocol_error);

  PeerId id() const { return id_; }
  /// Where the connection stands in admission; read and written under the server's mu_ only.
  enum class Admission { waiting, handshaking, done };
  Admission admission = Admission::handshaking;
  bool authenticated() const { return authenticated_.load(std::memory_order_acquire); }
  const PeerInfo& info() const { return info_; }  // stable once authenticated()

 private:
  enum class State { hello, auth, ready, closed };
  // What the I/O thread hands to the decode thread, in order.
  struct HandOff {
    enum class Kind { bytes, decode_buffered, end, closed } kind;
    std::vector<std::uint8_t> data;  // bytes: the read buffer
    std::size_t used = 0;            // bytes read (bytes, decode_buffered)
    std::string reason;              // end: why reading stopped; closed: why it closed
    bool protocol_error = false;     // closed
  };
  void read();
  void on_read(const error_code& ec, std::size_t n);
  void on_read_handed_off(const error_code& ec, std::size_t n);
  // I/O thread: queues `h` for the decode thread; true when reading must pause (backpressure).
  bool hand_off(HandOff h);
  // Decode thread: decodes what the decoder holds and delivers it.
  void decode_buffered();
  std::string read_end_reason(const error_code& ec) const;
  void handle(Message&& m);
  // An authenticated peer's message: delivered, or the reason to close the connection.
  std::string deliver(Message&& m);
  void send_internal(const Message& m);
  void start_write();
  void arm_timer();
  void on_tick();
  void close(std::string reason, bool protocol_error);

  TcpServer& server_;
  asio::io_context& ctx_;
  DecodeThread& decode_;
  tcp::socket sock_;
  asio::steady_timer timer_;
  FrameDecoder decoder_;
  PeerId id_;
  State state_ = State::hello;
  std::atomic<bool> authenticated_{false};
  PeerInfo info_;
  Nonce client_nonce_{};
  Nonce server_nonce_{};
  Clock::time_point opened_{}, last_rx_{}, last_tx_{};
  std::uint64_t heartbeat_seq_ = 0;

  std::mutex out_mu_;
  bool out_closed_ = false;       // guarded by out_mu_
  bool write_scheduled_ = false;  // guarded by out_mu_: a write is posted or in flight
  std::string out_pending_;       // guarded by out_mu_
  std::string out_writing_;       // I/O thread only

  // The hand-off to the decode thread. While in_busy_, the decode thread owns decoder_ and
  // the I/O thread reads into separate buffers that it queues in in_; only the I/O thread sets
  // in_busy_, only the decode thread clears it (when in_ is empty).
  std::mutex in_mu_;
  std::deque<HandOff> in_;                         // guarded by in_mu_
  std::vector<std::vector<std::uint8_t>> spare_;   // guarded by in_mu_: read buffers to reuse
  std::size_t in_bytes_ = 0;                       // guarded by in_mu_: read, not yet decoded
  bool in_busy_ = false;                           // guarded by in_mu_
  bool read_paused_ = false;  // guarded by in_mu_: no read pending until the decode thread resumes it
  std::vector<std::uint8_t> reading_;  // I/O thread: the buffer of a handed-off read in flight
  bool reading_handed_off_ = false;    // I/O thread: the read in flight goes to reading_
  bool decode_failed_ = false;         // decode thread: a bad frame or the end was seen
};

class TcpServer final : public Server {
 public:
  TcpServer(ServerOptions options, ServerHandlers handlers)
      : opt_(std::move(options)), handlers_(std::move(handlers)) {
    if (!opt_.logger) opt_.logger = stderr_logger();
    std::size_t n = opt_.io_threads;
    if (n == 0) n = std::max(1u, std::thread::hardware_concurrency());
    for (std::size_t i = 0; i < n; ++i) workers_.push_back(std::make_unique<Worker>());
    acceptor_.emplace(workers_[0]->ctx);
    accept_retry_.emplace(workers_[0]->ctx);
  }
  ~TcpServer() override { stop(); }

  StatusOr<bool> listen() {
    error_code ec;
    const auto addr = asio::ip::make_address(opt_.listen_address, ec);
    if (ec) return Status::invalid_argument("bad listen address '" + opt_.listen_address + "': " + ec.message());
    const tcp::endpoint ep(addr, opt_.port);
    acceptor_->open(ep.protocol(), ec);
    if (!ec) acceptor_->set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_->bind(ep, ec);
    if (!ec) acceptor_->listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      return Status::unavailable("cannot listen on " + opt_.listen_address + ":" + std::to_string(opt_.port) +
                   ": " + ec.message());
    }
    port_ = acceptor_->local_endpoint().port();
    for (auto& w : workers_) {
      w->decode.start();
      w->guard.emplace(w->ctx.get_executor());
      w->thread = std::thread([ctx = &w->ctx] {
        pthread_setname_np(pthread_self(), "pp-server-io");
        ctx->run();
      });
    }
    asio::post(workers_[0]->ctx, [this] { accept(); });
    log(LogLevel::info, "listening on " + opt_.listen_address + ":" + std::to_string(port_) +
                            " with " + std::to_string(workers_.size()) + " I/O threads");
    return true;
  }

  std::uint16_t port() const override { return port_; }

  bool send(PeerId peer, const Message& m) override {
    if (is_internal_type(type_of(m))) return false;
    auto frame = encode_frame(m, opt_.max_frame_bytes);
    if (!frame) {
      log(LogLevel::warn, "not sending to peer " + std::to_string(peer) + ": " + frame.status().message());
      return false;
    }
    std::shared_ptr<ServerConn> c;
    {
      std::lock_guard lk(mu_);
      auto it = conns_.find(peer);
      if (it == conns_.end() || !it->second->authenticated()) return false;
      c = it->second;
    }
    if (!c->enqueue(*frame)) return false;
    messages_sent_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  std::size_t broadcast(const Message& m) override {
    if (is_internal_type(type_of(m))) return 0;
    auto frame = encode_frame(m, opt_.max_frame_bytes);
    if (!frame) {
      log(LogLevel::warn, "not broadcasting: " + frame.status().message());
      return 0;
    }
    std::vector<std::shared_ptr<ServerConn>> targets;
    {
      std::lock_guard lk(mu_);
      for (auto& [id, c] : conns_) {
        if (c->authenticated()) targets.push_back(c);
      }
    }
    std::size_t n = 0;
    for (auto& c : targets) n += c->enqueue(*frame) ? 1 : 0;
    messages_sent_.fetch_add(n, std::memory_order_relaxed);
    return n;
  }

  void disconnect(PeerId peer, std::string_view reason) override {
    std::shared_ptr<ServerConn> c;
    {
      std::lock_guard lk(mu_);
      auto it = conns_.find(peer);
      if (it == conns_.end()) return;
      c = it->second;
    }
    c->close_async(std::string(reason), false);
  }

  std::vector<PeerInfo> peers() const override {
    std::vector<PeerInfo> out;
    std::lock_guard lk(mu_);
    for (const auto& [id, c] : conns_) {
      if (c->authenticated()) out.push_back(c->info());
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
    return out;
  }

  ServerStats stats() const override {
    ServerStats s;
    s.accepted = accepted_.load();
    s.authenticated = authenticated_.load();
    s.rejected = rejected_.load();
    s.messages_received = messages_received_.load();
    s.messages_sent = messages_sent_.load();
    s.handshakes_queued = handshakes_queued_.load();
    s.reads_handed_off = reads_handed_off_.load();
    std::lock_guard lk(mu_);
    s.connections = conns_.size();
    s.waiting = handshake_queue_.size() - handshake_queue_closed_;
    return s;
  }

  void stop() override {
    std::vector<std::shared_ptr<ServerConn>> all;
    {
      std::lock_guard lk(mu_);
      if (stopped_) return;
      stopped_ = true;
      for (auto& [id, c] : conns_) all.push_back(c);
    }
    if (workers_.empty() || !workers_[0]->thread.joinable()) return;  // never started
    asio::post(workers_[0]->ctx, [this] {
      error_code ec;
      acceptor_->close(ec);
      accept_retry_->cancel();
    });
    for (auto& c : all) c->close_async("server stopping", false);
    for (auto& w : workers_) w->guard.reset();
    for (auto& w : workers_) {
      if (w->thread.joinable()) w->thread.join();
    }
    // The I/O threads are gone, so nothing more is handed off: the decode threads deliver what
    // was read before the connections closed, then each connection's disconnect.
    for (auto& w : workers_) w->decode.finish();
    std::lock_guard lk(mu_);
    conns_.clear();
    handshake_queue_.clear();
    handshake_queue_closed_ = 0;
  }

  // ---- used by connections (on their I/O thread) ----

  const ServerOptions& options() const { return opt_; }
  const ServerHandlers& handlers() const { return handlers_; }
  void log(LogLevel level, const std::string& line) const { opt_.logger(level, line); }
  void count_message() { messages_received_.fetch_add(1, std::memory_order_relaxed); }
  void count_hand_off() { reads_handed_off_.fetch_add(1, std::memory_order_relaxed); }

  void on_authenticated(const std::shared_ptr<ServerConn>& c) {
    {
      std::lock_guard lk(mu_);
      c->admission = ServerConn::Admission::done;
      release_handshake_slot();
    }
    authenticated_.fetch_add(1);
    log(LogLevel::info, "peer " + std::to_string(c->id()) + " '" + c->info().name + "' (" +
                            c->info().remote_address + ") authenticated");
  }

  void on_closed(const std::shared_ptr<ServerConn>& c, bool was_authenticated,
                 const std::string& reason, bool protocol_error) {
    bool resume_accept = false;
    {
      std::lock_guard lk(mu_);
      conns_.erase(c->id());
      if (c->admission == ServerConn::Admission::handshaking) {
        release_handshake_slot();
      } else if (c->admission == ServerConn::Admission::waiting) {
        ++handshake_queue_closed_;  // skipped when it reaches the queue's front
      }
      c->admission = ServerConn::Admission::done;
      if (accept_paused_ && !stopped_ && conns_.size() < opt_.max_connections) {
        accept_paused_ = false;
        resume_accept = true;
      }
    }
    if (resume_accept) asio::post(workers_[0]->ctx, [this] { accept(); });
    if (protocol_error) rejected_.fetch_add(1);
    const std::string who = "peer " + std::to_string(c->id()) +
                            (was_authenticated ? " '" + c->info().name + "'" : std::string()) +
                            " (" + c->info().remote_address + ")";
    log(protocol_error ? LogLevel::warn : LogLevel::info, who + " closed: " + reason);
    if (was_authenticated && handlers_.on_disconnect) handlers_.on_disconnect(c->id(), reason);
  }

 private:
  struct Worker {
    asio::io_context ctx{1};
    std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
    std::thread thread;
    DecodeThread decode;
  };

  // Under mu_: a handshake slot frees; the longest-waiting connection (if any) takes it.
  void release_handshake_slot() {
    --unauthenticated_;
    while (!stopped_ && !handshake_queue_.empty()) {
      std::shared_ptr<ServerConn> next = std::move(handshake_queue_.front());
      handshake_queue_.pop_front();
      if (next->admission != ServerConn::Admission::waiting) {  // closed while it waited
        --handshake_queue_closed_;
        continue;
      }
      next->admission = ServerConn::Admission::handshaking;
      ++unauthenticated_;
      next->start_async();
      return;
    }
  }

  // Worker 0 only. At max_connections the acceptor pauses (the kernel's listen backlog holds new
  // connections) until a connection closes (on_closed resumes it).
  void accept() {
    {
      std::lock_guard lk(mu_);
      if (stopped_) return;
      if (conns_.size() >= opt_.max_connections) {
        accept_paused_ = true;
        log(LogLevel::warn, "connection limit (" + std::to_string(opt_.max_connections) +
                                ") reached: new connections wait in the listen backlog");
        return;
      }
    }
    Worker& target = *workers_[next_worker_++ % workers_.size()];
    acceptor_->async_accept(target.ctx, [this, &target](const error_code& ec, tcp::socket sock) {
      if (ec == asio::error::operation_aborted) return;
      if (ec) {
        // e.g. out of file descriptors: back off briefly instead of spinning.
        log(LogLevel::warn, "accept failed: " + ec.message());
        accept_retry_->expires_after(std::chrono::milliseconds(50));
        accept_retry_->async_wait([this](const error_code& e) {
          if (!e) accept();
        });
        return;
      }
      on_accept(target, std::move(sock));
      accept();
    });
  }

  // Admits every connection while the server runs: it starts its handshake at once while fewer
  // than max_unauthenticated are in one, else it waits (unread, its handshake timeout not yet
  // running) in a FIFO for a slot.
  void on_accept(Worker& worker, tcp::socket sock) {
    accepted_.fetch_add(1);
    error_code ec;
    const auto remote_ep = sock.remote_endpoint(ec);
    const std::string remote =
        ec ? std::string("?")
           : remote_ep.address().to_string() + ":" + std::to_string(remote_ep.port());
    std::shared_ptr<ServerConn> c;
    bool start = false;
    {
      std::lock_guard lk(mu_);
      if (!stopped_) {
        const PeerId id = next_id_++;
        c = std::make_shared<ServerConn>(*this, worker.ctx, worker.decode, std::move(sock), id,
                                         remote);
        conns_.emplace(id, c);
        if (unauthenticated_ < opt_.max_unauthenticated) {
          ++unauthenticated_;
          c->admission = ServerConn::Admission::handshaking;
          start = true;
        } else {
          c->admission = ServerConn::Admission::waiting;
          handshake_queue_.push_back(c);
          handshakes_queued_.fetch_add(1, std::memory_order_relaxed);
        }
      }
    }
    if (!c) {
      log(LogLevel::info, "closed connection from " + remote + ": server stopping");
      sock.close(ec);
      return;
    }
    if (start) c->start_async();
  }

  ServerOptions opt_;
  ServerHandlers handlers_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::optional<tcp::acceptor> acceptor_;
  std::optional<asio::steady_timer> accept_retry_;
  std::size_t next_worker_ = 0;  // acceptor thread only
  std::uint16_t port_ = 0;

  mutable std::mutex mu_;
  bool stopped_ = false;                                           // guarded by mu_
  PeerId next_id_ = 1;                                             // guarded by mu_
  std::size_t unauthenticated_ = 0;  // guarded by mu_: connections holding a handshake slot
  bool accept_paused_ = false;       // guarded by mu_: at max_connections, no accept pending
  // Guarded by mu_: connections waiting for a handshake slot, oldest first, and how many of
  // those closed while waiting (skipped when they reach the front).
  std::deque<std::shared_ptr<ServerConn>> handshake_queue_;
  std::size_t handshake_queue_closed_ = 0;
  std::unordered_map<PeerId, std::shared_ptr<ServerConn>> conns_;  // guarded by mu_

  std::atomic<std::uint64_t> accepted_{0}, authenticated_{0}, rejected_{0};
  std::atomic<std::uint64_t> messages_received_{0}, messages_sent_{0};
  std::atomic<std::uint64_t> handshakes_queued_{0};
  std::atomic<std::uint64_t> reads_handed_off_{0};
};

// ---- ServerConn ----

ServerConn::ServerConn(TcpServer& server, asio::io_context& ctx, DecodeThread& decode,
                       tcp::socket sock, PeerId id, std::string remote)
    : server_(server),
      ctx_(ctx),
      decode_(decode),
      sock_(std::move(sock)),
      timer_(ctx),
      decoder_(server.options().max_frame_bytes),
      id_(id) {
  info_.id = id;
  info_.remote_address = std::move(remote);
}

void ServerConn::start() {
  if (state_ == State::closed) return;  // closed (the server stopping) before it started
  error_code ec;
  sock_.set_option(tcp::no_delay(true), ec);
  opened_ = last_rx_ = last_tx_ = Clock::now();
  read();
  arm_timer();
}

void ServerConn::read() {
  {
    std::lock_guard lk(in_mu_);
    reading_handed_off_ = in_busy_;
    if (reading_handed_off_ && reading_.empty() && !spare_.empty()) {
      reading_ = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  std::span<std::uint8_t> space;
  if (reading_handed_off_) {
    if (reading_.size() < FrameDecoder::kMaxReadBytes) reading_.resize(FrameDecoder::kMaxReadBytes);
    space = reading_;
  } else {
    space = decoder_.prepare_read();
  }
  sock_.async_read_some(
      asio::buffer(space.data(), space.size()),
      [self = shared_from_this()](const error_code& ec, std::size_t n) { self->on_read(ec, n); });
}

std::string ServerConn::read_end_reason(const error_code& ec) const {
  return ec == asio::error::eof ? "peer closed the connection" : "read error: " + ec.message();
}

void ServerConn::on_read(const error_code& ec, std::size_t n) {
  if (state_ == State::closed) return;
  if (reading_handed_off_) {
    on_read_handed_off(ec, n);
    return;
  }
  if (ec) {
    if (decoder_.buffered_bytes() > 0) {
      close("truncated frame (connection ended inside a frame, " +
                std::to_string(decoder_.buffered_bytes()) + " bytes pending)",
            true);
    } else {
      close(read_end_reason(ec), false);
    }
    return;
  }
  decoder_.commit(n);
  last_rx_ = Clock::now();
  if (state_ == State::ready && n >= kHandOffReadBytes) {
    // A streaming peer: the decode thread decodes this read while the I/O thread reads on.
    if (!hand_off(HandOff{HandOff::Kind::decode_buffered, {}, n, {}, false})) read();
    return;
  }
  Message m;
  for (;;) {
    const auto st = decoder_.next(m);
    if (st == FrameDecoder::Status::need_more) break;
    if (st == FrameDecoder::Status::error) {
      close("bad frame: " + decoder_.error(), true);
      return;
    }
    handle(std::move(m));
    if (state_ == State::closed) return;
  }
  read();
}

void ServerConn::on_read_handed_off(const error_code& ec, std::size_t n) {
  if (ec) {
    // The decode thread decides whether the stream ended inside a frame.
    hand_off(HandOff{HandOff::Kind::end, {}, 0, read_end_reason(ec), false});
    return;
  }
  last_rx_ = Clock::now();
  if (!hand_off(HandOff{HandOff::Kind::bytes, std::move(reading_), n, {}, false})) read();
}

bool ServerConn::hand_off(HandOff h) {
  if (h.kind == HandOff::Kind::bytes || h.kind == HandOff::Kind::decode_buffered) {
    server_.count_hand_off();
  }
  bool schedule = false, pause = false;
  const std::size_t h_used = h.used;
  {
    std::lock_guard lk(in_mu_);
    in_bytes_ += h_used;
    in_.push_back(std::move(h));
    schedule = !in_busy_;
    in_busy_ = true;
    pause = h_used > 0 && in_bytes_ >= kMaxHandOffBytes;
    read_paused_ = read_paused_ || pause;
  }
  if (schedule) decode_.schedule(shared_from_this());
  return pause;
}

bool ServerConn::drain() {
  std::deque<HandOff> items;
  {
    std::lock_guard lk(in_mu_);
    items.swap(in_);
  }
  std::size_t consumed = 0;
  for (HandOff& h : items) {
    consumed += h.used;
    switch (h.kind) {
      case HandOff::Kind::bytes:
        if (!decode_failed_) {
          decoder_.feed(std::span<const std::uint8_t>(h.data.data(), h.used));
          decode_buffered();
        }
        break;
      case HandOff::Kind::decode_buffered:
        if (!decode_failed_) decode_buffered();
        break;
      case HandOff::Kind::end:
        if (!decode_failed_) {
          decode_failed_ = true;
          if (decoder_.buffered_bytes() > 0) {
            close_async("truncated frame (connection ended inside a frame, " +
                            std::to_string(decoder_.buffered_bytes()) + " bytes pending)",
                        true);
          } else {
            close_async(std::move(h.reason), false);
          }
        }
        break;
      case HandOff::Kind::closed:
        // Last: everything read before the close was delivered.
        server_.on_closed(shared_from_this(), true, h.reason, h.protocol_error);
        break;
    }
  }
  bool resume = false, more = false;
  {
    std::lock_guard lk(in_mu_);
    in_bytes_ -= consumed;
    for (HandOff& h : items) {
      if (h.kind == HandOff::Kind::bytes && spare_.size() < kSpareReadBuffers) {
        spare_.push_back(std::move(h.data));
      }
    }
    if (read_paused_ && in_bytes_ < kMaxHandOffBytes) {
      read_paused_ = false;
      resume = true;
    }
    more = !in_.empty();
    if (!more) in_busy_ = false;  // from here on the I/O thread owns decoder_ again
  }
  if (resume) {
    asio::post(ctx_, [self = shared_from_this()] {
      if (self->state_ == State::closed) return;
      self->last_rx_ = Clock::now();  // the peer was not silent: the server was not reading
      self->read();
    });
  }
  return more;
}

void ServerConn::decode_buffered() {
  Message m;
  for (;;) {
    const auto st = decoder_.next(m);
    if (st == FrameDecoder::Status::need_more) return;
    std::string why = st == FrameDecoder::Status::error ? "bad frame: " + decoder_.error()
                                                        : deliver(std::move(m));
    if (!why.empty()) {
      decode_failed_ = true;
      close_async(std::move(why), true);
      return;
    }
  }
}

void DecodeThread::run() {
  std::unique_lock lk(mu_);
  for (;;) {
    if (ready_.empty()) {
      if (stopping_) return;
      idle_ = true;
      cv_.wait(lk, [&] { return stopping_ || !ready_.empty(); });
      idle_ = false;
      continue;
    }
    std::shared_ptr<ServerConn> c = std::move(ready_.front());
    ready_.pop_front();
    lk.unlock();
    const bool more = c->drain();
    lk.lock();
    if (more) ready_.push_back(std::move(c));  // behind the others: one batch at a time
  }
}

void ServerConn::handle(Message&& m) {
  const ServerOptions& opt = server_.options();
  switch (state_) {
    case State::hello: {
      auto* hello = std::get_if<Hello>(&m);
      if (hello == nullptr) {
        close("expected hello, got " + std::string(type_name(type_of(m))), true);
        return;
      }
      info_.name = hello->name;
      info_.role = hello->role;
      info_.rank = hello->rank;
      client_nonce_ = hello->client_nonce;
      server_nonce_ = random_nonce();
      send_internal(
          Challenge{server_nonce_, server_proof(opt.secret, client_nonce_, server_nonce_)});
      state_ = State::auth;
      return;
    }
    case State::auth: {
      auto* auth = std::get_if<Auth>(&m);
      if (auth == nullptr) {
        close("expected auth, got " + std::string(type_name(type_of(m))), true);
        return;
      }
      const Proof expected = client_proof(opt.secret, server_nonce_, client_nonce_);
      if (!constant_time_equal(expected, auth->client_proof)) {
        close("authentication failed", true);
        return;
      }
      state_ = State::ready;
      authenticated_.store(true, std::memory_order_release);
      auto self = shared_from_this();
      server_.on_authenticated(self);
      send_internal(Welcome{id_, opt.heartbeat_interval_ms, opt.max_frame_bytes});
      if (server_.handlers().on_connect) server_.handlers().on_connect(info_);
      return;
    }
    case State::ready:
      if (std::string why = deliver(std::move(m)); !why.empty()) close(std::move(why), true);
      return;
    case State::closed:
      return;
  }
}

std::string ServerConn::deliver(Message&& m) {
  switch (type_of(m)) {
    case MessageType::heartbeat:
      return {};  // liveness only; last_rx_ is already updated
    case MessageType::hello:
    case MessageType::challenge:
    case MessageType::auth:
    case MessageType::welcome:
      return "unexpected " + std::string(type_name(type_of(m))) + " after authentication";
    default:
      server_.count_message();
      if (server_.handlers().on_message) server_.handlers().on_message(id_, std::move(m));
      return {};
  }
}

void ServerConn::send_internal(const Message& m) {
  auto frame = encode_frame(m, server_.options().max_frame_bytes);
  if (frame) enqueue(*frame);
}

bool ServerConn::enqueue(std::string_view frame) {
  bool post_write = false;
  {
    std::lock_guard lk(out_mu_);
    if (out_closed_) return false;
    if (out_pending_.size() + frame.size() > server_.options().max_send_queue_bytes) {
      out_closed_ = true;
      out_pending_.clear();
      post_write = false;
    } else {
      out_pending_.append(frame);
      if (!write_scheduled_) {
        write_scheduled_ = true;
        post_write = true;
      }
      if (post_write) {
        asio::post(ctx_, [self = shared_from_this()] { self->start_write(); });
      }
      return true;
    }
  }
  close_async("send queue over " + std::to_string(server_.options().max_send_queue_bytes) +
                  " bytes (peer too slow)",
              true);
  return false;
}

void ServerConn::start_write() {
  if (state_ == State::closed) return;
  {
    std::lock_guard lk(out_mu_);
    if (out_pending_.empty()) {
      write_scheduled_ = false;
      return;
    }
    out_writing_.clear();
    std::swap(out_pending_, out_writing_);
  }
  last_tx_ = Clock::now();
  asio::async_write(sock_, asio::buffer(out_writing_),
                    [self = shared_from_this()](const error_code& ec, std::size_t) {
                      if (self->state_ == State::closed) return;
                      if (ec) {
                        self->close("write error: " + ec.message(), false);
                        return;
                      }
                      self->start_write();
                    });
}

void ServerConn::arm_timer() {
  const ServerOptions& o = server_.options();
  const std::uint32_t tick_ms =
      std::clamp<std::uint32_t>(std::min({o.heartbeat_interval_ms, o.heartbeat_timeout_ms / 4,
                                          o.unauthenticated_timeout_ms / 4}),
                                5, 1000);
  timer_.expires_after(std::chrono::milliseconds(tick_ms));
  timer_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (ec || self->state_ == State::closed) return;
    self->on_tick();
  });
}

void ServerConn::on_tick() {
  const ServerOptions& o = server_.options();
  const auto now = Clock::now();
  using std::chrono::milliseconds;
  if (state_ != State::ready) {
    if (now - opened_ > milliseconds(o.unauthenticated_timeout_ms)) {
      close("unauthenticated for more than " + std::to_string(o.unauthenticated_timeout_ms) + " ms",
            true);
      return;
    }
  } else {
    {
      std::lock_guard lk(in_mu_);
      if (read_paused_) last_rx_ = now;  // backpressure: the server is not reading, not the peer
    }
    if (now - last_rx_ > milliseconds(o.heartbeat_timeout_ms)) {
      close("heartbeat timeout (" + std::to_string(o.heartbeat_timeout_ms) + " ms)", false);
      return;
    }
    if (now - last_tx_ >= milliseconds(o.heartbeat_interval_ms)) {
      last_tx_ = now;  // one heartbeat per interval even if the write is still queued
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch());
      send_internal(Heartbeat{++heartbeat_seq_, static_cast<std::uint64_t>(ns.count())});
    }
  }
  arm_timer();
}

void ServerConn::close_async(std::string reason, bool protocol_error) {
  asio::post(ctx_, [self = shared_from_this(), reason = std::move(reason),
                    protocol_error]() mutable { self->close(std::move(reason), protocol_error); });
}

void ServerConn::close(std::string reason, bool protocol_error) {
  if (state_ == State::closed) return;
  const bool was_ready = state_ == State::ready;
  state_ = State::closed;
  authenticated_.store(false, std::memory_order_release);
  {
    std::lock_guard lk(out_mu_);
    out_closed_ = true;
    out_pending_.clear();
  }
  error_code ec;
  sock_.shutdown(tcp::socket::shutdown_both, ec);
  sock_.close(ec);
  timer_.cancel();
  {
    // While the decode thread holds bytes of this peer, it delivers them first, then reports
    // the close (handlers of one peer run in order).
    std::lock_guard lk(in_mu_);
    if (in_busy_) {
      in_.push_back(HandOff{HandOff::Kind::closed, {}, 0, std::move(reason), protocol_error});
      return;
    }
  }
  server_.on_closed(shared_from_this(), was_ready, reason, protocol_error);
}

}  // namespace

StatusOr<std::unique_ptr<Server>> make_tcp_server(ServerOptions options, ServerHandlers handlers) {
  if (options.secret.size() < kMinSecretBytes) {
    return Status::invalid_argument("server needs a shared secret of at least " + std::to_string(kMinSecretBytes) +
                 " bytes");
  }
  if (options.max_frame_bytes < 1024) return Status::invalid_argument("max_frame_bytes must be >= 1024");
  if (options.heartbeat_timeout_ms <= options.heartbeat_interval_ms) {
    return Status::invalid_argument("heartbeat_timeout_ms must exceed heartbeat_interval_ms");
  }
  auto server = std::make_unique<TcpServer>(std::move(options), std::move(handlers));
  auto ok = server->listen();
  if (!ok) return ok.status();
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace parapilot::transport
