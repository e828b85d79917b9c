// The message bus between environment adapters (workers, trace replay, simulators) and the agent.
//
// Purpose: the agent runs one Server; every adapter runs a Client. Both are abstract so that the
// same code runs over TCP (make_tcp_server / make_tcp_client: Boost.Asio, framed cereal messages,
// see docs/wire-format.md) or in-process (InProcHub: same semantics, no sockets, for tests and
// simulation). Secure by default: the TCP server binds to 127.0.0.1 unless told otherwise, both
// sides must hold the same shared secret (HMAC challenge-response, the secret never crosses the
// wire and is never logged), frames are size-limited, and any bad frame closes only the
// connection that sent it, with the reason logged.
//
// Delivery: messages from one peer arrive in the order they were sent. Telemetry is best-effort:
// while a client is disconnected or its connection is backed up, telemetry waits in a bounded
// buffer that drops the oldest telemetry when full; control messages (everything else) are never
// dropped by the buffer. Frames already handed to a socket when its connection drops are lost
// (at-most-once); what is still queued is sent after the reconnect. Heartbeats are internal and
// never delivered.
//
// Batching: a TCP client writes sparse traffic at once from the sending thread (lowest latency);
// when a write is already in progress, or the sending thread streams faster than ~150k msgs/s
// (measured over its last 4096 sends), frames queue up and the I/O thread coalesces them into one
// socket write (up to ClientOptions::max_batch_bytes); a streaming thread's frames wait up to
// 200 µs for more before that write (one wake-up of the I/O thread per batch, not per frame).
// Receivers read up to 64 KiB per system call and decode every frame in it. A TCP server
// decodes a sparse peer's reads on the I/O thread that read them (no hand-off latency); a read of
// 16 KiB or more (a streaming peer) goes to the decode thread paired with that I/O thread, which
// decodes it and runs the handlers while the I/O thread reads on; so do the connection's next
// reads, whatever their size, until that thread has caught up (order). A connection holds at most
// 256 KiB read but not yet decoded; at that limit it stops reading until the decode thread
// catches up, so a slow handler backs up into the peer's socket.
//
// Thread-safety: every member function of Server and Client may be called from any thread,
// including from inside a handler (except stop(), which joins or waits for the transport's
// threads). Handlers run on the transport's threads (a TCP server's on_message and on_disconnect
// on an I/O thread or its decode thread): those of one peer run one at a time, in order, and
// on_disconnect comes after every message read before the close; different peers may run
// concurrently. A slow handler slows its own connection (backpressure), not the others on other
// threads. Server::stop() delivers what was read before it, then each peer's on_disconnect.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "transport/auth.h"
#include "transport/frame.h"
#include "transport/messages.h"
#include "core/status.h"

namespace parapilot::transport {

/// Server-assigned id of a connection, >= 1, never reused by one Server.
using PeerId = std::uint64_t;

enum class LogLevel { debug, info, warn, error };
/// Receives log lines. Lines never contain the secret. Called from I/O threads.
using Logger = std::function<void(LogLevel, std::string_view)>;
/// A logger writing warnings and errors to stderr (the default when no logger is given).
Logger stderr_logger(LogLevel min_level = LogLevel::warn);

struct ServerOptions {
  std::string listen_address = "127.0.0.1";  ///< loopback only unless an address is given.
  std::uint16_t port = 0;                    ///< 0 picks a free port; see Server::port().
  Secret secret;                             ///< required, >= kMinSecretBytes.
  std::size_t io_threads = 0;                ///< io_contexts (one thread each); 0 = cores.
  std::uint32_t max_frame_bytes = kDefaultMaxFrameBytes;  ///< header + payload, 1 MiB.
  /// Open connections, authenticated or not. At the limit the server stops accepting: new
  /// connections wait in the kernel's listen backlog (the client's connect times out and retries
  /// if the wait is long) until one closes. Never refused.
  std::size_t max_connections = 4096;
  /// Connections in the handshake at once. Beyond it an accepted connection waits, unread and
  /// with its handshake timeout not yet running, in a FIFO until a handshake finishes or fails
  /// (a connection storm is paced, not refused). Bounds the work an unauthenticated flood can
  /// cause; the queue itself is bounded by max_connections.
  std::size_t max_unauthenticated = 256;
  std::uint32_t unauthenticated_timeout_ms = 5000;  ///< handshake must finish within this.
  std::uint32_t heartbeat_interval_ms = 1000;       ///< heartbeat sent when idle this long.
  std::uint32_t heartbeat_timeout_ms = 5000;        ///< silence after which a peer is dead.
  std::size_t max_send_queue_bytes = 16u << 20;     ///< per peer; beyond it the peer is dropped.
  Logger logger;                                    ///< empty: stderr_logger().
};

/// What the server knows about an authenticated peer.
struct PeerInfo {
  PeerId id = 0;
  std::string name;  ///< from Hello.
  PeerRole role = PeerRole::worker;
  std::uint32_t rank = kNoRank;
  std::string remote_address;  ///< "ip:port", or "inproc".
};

struct ServerHandlers {
  /// A peer finished authentication.
  std::function<void(const PeerInfo&)> on_connect;
  /// A message from an authenticated peer (never handshake messages or heartbeats).
  std::function<void(PeerId, Message&&)> on_message;
  /// An authenticated peer went away; `reason` says why ("heartbeat timeout", "bad frame: ...").
  std::function<void(PeerId, std::string_view reason)> on_disconnect;
};

struct ServerStats {
  std::uint64_t accepted = 0;           ///< connections accepted.
  std::uint64_t authenticated = 0;      ///< handshakes completed.
  std::uint64_t rejected = 0;  ///< closed: protocol error, auth, handshake timeout, slow peer.
  std::uint64_t messages_received = 0;  ///< delivered to on_message.
  std::uint64_t messages_sent = 0;
  std::uint64_t handshakes_queued = 0;  ///< connections that waited for a handshake slot.
  std::uint64_t reads_handed_off = 0;   ///< socket reads decoded on a decode thread (TCP).
  std::size_t connections = 0;          ///< currently open (waiting ones included).
  std::size_t waiting = 0;              ///< waiting for a handshake slot now.
};

/// The agent side.
class Server {
 public:
  virtual ~Server() = default;
  /// Listening port (TCP); 0 for in-process servers.
  virtual std::uint16_t port() const = 0;
  /// Queues `m` to one peer. False if the peer is unknown/gone, `m` is invalid, or `m` is a
  /// handshake message or heartbeat (is_internal_type()).
  virtual bool send(PeerId peer, const Message& m) = 0;
  /// Queues `m` to every authenticated peer; returns how many.
  virtual std::size_t broadcast(const Message& m) = 0;
  /// Closes one peer's connection (on_disconnect is called with `reason`).
  virtual void disconnect(PeerId peer, std::string_view reason) = 0;
  /// Authenticated peers now.
  virtual std::vector<PeerInfo> peers() const = 0;
  virtual ServerStats stats() const = 0;
  /// Closes every connection and stops the I/O threads. Idempotent; the destructor calls it.
  /// Must not be called from a handler.
  virtual void stop() = 0;
};

/// Creates a TCP server listening on options.listen_address:options.port. Fails on a missing or
/// short secret or when the address cannot be bound.
StatusOr<std::unique_ptr<Server>> make_tcp_server(ServerOptions options, ServerHandlers handlers);

struct ClientOptions {
  std::string server_address = "127.0.0.1";  ///< IP address or host name.
  std::uint16_t port = 0;                    ///< server port, required.
  Secret secret;                             ///< required, >= kMinSecretBytes.
  std::string name = "worker";               ///< sent in Hello, 1..kMaxNameBytes.
  PeerRole role = PeerRole::worker;
  std::uint32_t rank = kNoRank;
  std::uint32_t max_frame_bytes = kDefaultMaxFrameBytes;
  std::uint32_t reconnect_initial_ms = 50;       ///< first retry delay; doubles per failure...
  std::uint32_t reconnect_max_ms = 5000;         ///< ...up to this (with up to 50% jitter off).
  std::uint32_t connect_timeout_ms = 5000;       ///< TCP connect + handshake must finish within.
  std::uint32_t heartbeat_interval_ms = 1000;    ///< heartbeat sent when idle this long.
  /// Silence after which the server is dead; at least twice the heartbeat interval the
  /// server announces in its Welcome (it is silent for up to one interval when healthy).
  std::uint32_t heartbeat_timeout_ms = 5000;
  std::size_t telemetry_buffer_capacity = 8192;  ///< telemetry messages held while backed up.
  std::size_t max_batch_bytes = 256u << 10;      ///< frames coalesced into one socket write.
  Logger logger;                                 ///< empty: stderr_logger().
};

struct ClientHandlers {
  /// Authenticated with the server (after each (re)connect).
  std::function<void(PeerId)> on_connect;
  /// A message from the server.
  std::function<void(Message&&)> on_message;
  /// The connection was lost or refused; the client retries after a backoff.
  std::function<void(std::string_view reason)> on_disconnect;
};

struct ClientStats {
  std::uint64_t connects = 0;       ///< successful handshakes.
  std::uint64_t messages_sent = 0;  ///< frames handed to the socket (or the hub).
  std::uint64_t messages_received = 0;
  std::uint64_t telemetry_dropped = 0;  ///< oldest telemetry evicted from a full buffer.
  std::size_t queued = 0;               ///< messages waiting to be written now.
};

/// The worker side.
class Client {
 public:
  virtual ~Client() = default;
  /// Queues `m` for the server. False if `m` is invalid (see validate()), internal
  /// (is_internal_type()) or the client stopped.
  /// Never blocks on the network; telemetry may later be evicted by newer telemetry.
  virtual bool send(const Message& m) = 0;
  /// True between on_connect and on_disconnect.
  virtual bool connected() const = 0;
  /// Waits until everything queued so far was handed to the socket, up to `timeout`.
  virtual bool flush(std::chrono::milliseconds timeout) = 0;
  virtual ClientStats stats() const = 0;
  /// Closes the connection without flushing. Idempotent; the destructor calls it.
  /// Must not be called from a handler.
  virtual void stop() = 0;
};

/// I/O threads that many clients can share (one thread can serve hundreds of connections).
/// Destroy it after the clients that use it.
class IoRuntime {
 public:
  explicit IoRuntime(std::size_t threads = 1);
  ~IoRuntime();
  IoRuntime(const IoRuntime&) = delete;
  IoRuntime& operator=(const IoRuntime&) = delete;
  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// Creates a TCP client; it connects in the background and keeps reconnecting until stopped.
/// With no runtime it runs its own I/O thread. Fails on a missing/short secret, port 0 or a bad
/// name.
StatusOr<std::unique_ptr<Client>> make_tcp_client(ClientOptions options, ClientHandlers handlers,
                                                std::shared_ptr<IoRuntime> runtime = nullptr);

/// In-process bus: one server and any number of clients in the same process, with the TCP
/// semantics minus sockets (messages are validated and round-tripped through the wire encoding;
/// clients buffer while no server exists; per-peer order; bounded telemetry buffer). Handlers run
/// on one dispatch thread owned by the hub. The hub must outlive its servers and clients.
class InProcHub {
 public:
  InProcHub();
  ~InProcHub();
  InProcHub(const InProcHub&) = delete;
  InProcHub& operator=(const InProcHub&) = delete;

  /// Creates the hub's server (at most one alive at a time; fails otherwise). Waiting clients
  /// connect to it.
  StatusOr<std::unique_ptr<Server>> make_server(ServerHandlers handlers);
  /// Creates a client; only name, role, rank and telemetry_buffer_capacity of `options` apply.
  std::unique_ptr<Client> make_client(const ClientOptions& options, ClientHandlers handlers);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace parapilot::transport
