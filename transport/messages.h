// Messages of the parapilot bus: what workers and the agent say to each other.
//
// Purpose: plain structs for every message (handshake, heartbeat, telemetry, the layout-switch
// protocol PlanPrepare -> PlanReady -> PlanCommit / PlanAbort, Ack, Shutdown), the variant
// Message that carries any of them, value-range validation, and the payload codec (cereal
// PortableBinaryArchive, little-endian; the exact byte layout is in docs/wire-format.md).
// decode_payload() is safe on arbitrary bytes: it never throws, never crashes and never
// allocates more than the input could describe; it rejects anything that validate() rejects.
//
// Thread-safety: all functions are pure (no shared state) and may be called from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "core/status.h"

namespace parapilot::transport {

/// Wire message type ids (frame header byte 5). Values are part of the wire format.
enum class MessageType : std::uint8_t {
  hello = 1,
  challenge = 2,
  auth = 3,
  welcome = 4,
  heartbeat = 5,
  telemetry = 6,
  plan_prepare = 7,
  plan_ready = 8,
  plan_commit = 9,
  plan_abort = 10,
  ack = 11,
  shutdown = 12,
  job_info = 13,
};
inline constexpr std::uint8_t kMinMessageType = 1;
inline constexpr std::uint8_t kMaxMessageType = 13;

/// Which kind of adapter a client is. Values are part of the wire format.
enum class PeerRole : std::uint8_t { worker = 1, trace_replay = 2, simulator = 3, tool = 4 };

// Value limits enforced by validate() and by the decoder (before any allocation).
inline constexpr std::size_t kMaxNameBytes = 128;      ///< Hello::name.
inline constexpr std::size_t kMaxTextBytes = 1024;     ///< free-text reasons and details.
inline constexpr std::size_t kMaxCollectives = 256;    ///< Telemetry::collectives entries.
inline constexpr std::size_t kMaxFacts = 64;  ///< Telemetry::counts and Telemetry::measures entries.
inline constexpr std::size_t kMaxLayers = 16384;       ///< Telemetry::layers entries.
inline constexpr std::uint32_t kMaxRanks = 1u << 20;   ///< ranks are < kMaxRanks.
inline constexpr std::uint32_t kNoRank = 0xFFFFFFFFu;  ///< Hello::rank of a non-rank peer.
inline constexpr double kMaxDurationMs = 1e9;          ///< ~11.6 days; durations are in [0, this].
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kProofBytes = 32;  ///< HMAC-SHA256 output.

using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Proof = std::array<std::uint8_t, kProofBytes>;

/// Client -> server, first frame of a connection.
struct Hello {
  PeerRole role = PeerRole::worker;
  std::uint32_t rank = kNoRank;  ///< < kMaxRanks, or kNoRank.
  std::string name;              ///< 1..kMaxNameBytes printable ASCII bytes (0x21-0x7E).
  Nonce client_nonce{};          ///< fresh random bytes.
  bool operator==(const Hello&) const = default;
};

/// Server -> client, answer to Hello. server_proof lets the client check the server knows the
/// secret: HMAC-SHA256(secret, "parapilot/1 server" || client_nonce || server_nonce).
struct Challenge {
  Nonce server_nonce{};
  Proof server_proof{};
  bool operator==(const Challenge&) const = default;
};

/// Client -> server: HMAC-SHA256(secret, "parapilot/1 client" || server_nonce || client_nonce).
struct Auth {
  Proof client_proof{};
  bool operator==(const Auth&) const = default;
};

/// Server -> client: authentication succeeded; the connection is now usable.
struct Welcome {
  std::uint64_t peer_id = 0;                ///< id the server uses for this connection, >= 1.
  std::uint32_t heartbeat_interval_ms = 0;  ///< the server's heartbeat period, informational.
  std::uint32_t max_frame_bytes = 0;        ///< largest frame the server accepts.
  bool operator==(const Welcome&) const = default;
};

/// Either direction, every heartbeat interval. Consumed by the transport, never delivered.
struct Heartbeat {
  std::uint64_t seq = 0;
  std::uint64_t send_time_ns = 0;  ///< sender's steady clock, for RTT estimates only.
  bool operator==(const Heartbeat&) const = default;
};

/// Time and volume of one collective during a step.
struct CollectiveStat {
  double ms = 0;            ///< total time in [0, kMaxDurationMs], finite.
  std::uint64_t bytes = 0;  ///< total bytes moved.
  std::uint32_t calls = 0;  ///< number of calls.
  bool operator==(const CollectiveStat&) const = default;
};

/// Gradient statistics of one layer during a step.
struct LayerGradStat {
  std::uint32_t layer = 0;
  float norm = 0;                     ///< L2 norm, finite, >= 0.
  float max_abs = 0;                  ///< max |g|, finite, >= 0.
  std::uint32_t nonfinite_count = 0;  ///< NaN/Inf elements seen (the stats above exclude them).
  bool operator==(const LayerGradStat&) const = default;
};

/// Worker -> agent, once per step per rank (high rate; may be dropped when buffers overflow).
struct Telemetry {
  std::uint32_t rank = 0;  ///< < kMaxRanks.
  std::uint64_t step = 0;
  std::uint64_t step_start_ns = 0;  ///< worker wall clock, ns since the Unix epoch.
  std::uint64_t step_end_ns = 0;    ///< >= step_start_ns.
  std::uint64_t send_time_ns = 0;   ///< sender clock when handed to the bus (latency probes).
  double compute_ms = 0;            ///< finite, in [0, kMaxDurationMs].
  std::uint32_t queue_depth = 0;    ///< pending work items in the data/comm queues.
  /// Timings of collectives and phases; key: e.g. "all_reduce/dp"; <= kMaxCollectives.
  std::map<std::string, CollectiveStat> collectives;
  std::vector<LayerGradStat> layers;  ///< <= kMaxLayers.
  /// Facts about the step that are whole numbers (plan id, samples, position in the layout);
  /// key: e.g. "info/samples"; <= kMaxFacts.
  std::map<std::string, std::uint64_t> counts;
  /// Facts about the step that are real numbers (the loss); finite; <= kMaxFacts.
  std::map<std::string, double> measures;
  bool operator==(const Telemetry&) const = default;
};

/// How a range of layers' gradients travel in the data-parallel reduction.
enum class CompressionMethod : std::uint8_t { none = 0, fp16 = 1, topk = 2, powersgd = 3 };

/// Compression of the inclusive layer range [first_layer, last_layer].
struct LayerCompression {
  std::uint32_t first_layer = 0;  ///< <= last_layer < kMaxLayers.
  std::uint32_t last_layer = 0;
  CompressionMethod method = CompressionMethod::none;
  float parameter = 0;  ///< topk: kept fraction in (0, 1); powersgd: rank in [1, 1024]; else 0.
  bool operator==(const LayerCompression&) const = default;
};

/// One hybrid-parallel layout: degrees, per-replica batch shares, per-layer compression.
struct Layout {
  std::uint32_t dp = 1;  ///< each >= 1; dp*tp*pp <= kMaxRanks.
  std::uint32_t tp = 1;
  std::uint32_t pp = 1;
  std::uint32_t micro_batches = 1;  ///< in [1, 65536].
  /// Samples per data-parallel replica (elastic data parallel; gradients averaged with these
  /// weights). Empty: uniform. Otherwise dp entries, each in [1, 2^24].
  std::vector<std::uint32_t> dp_shares;
  /// Later entries override earlier ones; layers not covered are uncompressed. <= kMaxLayers.
  std::vector<LayerCompression> compression;
  bool operator==(const Layout&) const = default;
};

/// Agent -> workers: get ready to switch to `layout`.
struct PlanPrepare {
  std::uint64_t plan_id = 0;
  Layout layout;
  std::string layout_name;        ///< <= kMaxNameBytes.
  std::uint32_t deadline_ms = 0;  ///< time allowed to answer PlanReady.
  bool operator==(const PlanPrepare&) const = default;
};

/// Worker -> agent: this rank is (or cannot be) ready for plan_id.
struct PlanReady {
  std::uint64_t plan_id = 0;
  std::uint32_t rank = 0;  ///< < kMaxRanks.
  bool ok = true;
  std::string detail;  ///< <= kMaxTextBytes.
  bool operator==(const PlanReady&) const = default;
};

/// Agent -> workers: switch at the start of step `switch_at_step`.
struct PlanCommit {
  std::uint64_t plan_id = 0;
  std::uint64_t switch_at_step = 0;
  bool operator==(const PlanCommit&) const = default;
};

/// Agent -> workers: forget plan_id, keep the current layout.
struct PlanAbort {
  std::uint64_t plan_id = 0;
  std::string reason;  ///< <= kMaxTextBytes.
  bool operator==(const PlanAbort&) const = default;
};

/// Either direction: acknowledges the message of type `acked` with id `id` (plan id or seq).
struct Ack {
  MessageType acked = MessageType::plan_commit;  ///< a valid MessageType.
  std::uint64_t id = 0;
  std::uint32_t rank = kNoRank;  ///< < kMaxRanks, or kNoRank.
  bool operator==(const Ack&) const = default;
};

/// Either direction: the sender is going away (agent: stop the job; worker: leaving).
struct Shutdown {
  std::string reason;  ///< <= kMaxTextBytes.
  bool operator==(const Shutdown&) const = default;
};

/// What a job can switch without stopping (JobInfo::capabilities, a bit set). Values are part of
/// the wire format.
enum Capability : std::uint32_t {
  kCapDpShares = 1u << 0,     ///< per-replica batch shares (Layout::dp_shares).
  kCapCompression = 1u << 1,  ///< per-layer gradient compression (Layout::compression).
  kCapTensor = 1u << 2,       ///< tensor-parallel degree (Layout::tp).
  kCapPipeline = 1u << 3,     ///< pipeline-parallel degree and stages (Layout::pp).
  kCapMicroBatches = 1u << 4, ///< micro-batches per step (Layout::micro_batches).
};
inline constexpr std::uint32_t kKnownCapabilities = (1u << 5) - 1;

/// Size of one layer's parameters, as the job sees them.
struct LayerInfo {
  std::uint64_t params = 0;      ///< parameter count.
  std::uint64_t grad_bytes = 0;  ///< bytes of its gradient in the data-parallel reduction.
  bool operator==(const LayerInfo&) const = default;
};

/// Worker -> agent, once per connection before its first telemetry: what the job is and what it
/// can switch, so the agent can plan for it without a scenario file.
struct JobInfo {
  std::uint32_t rank = 0;          ///< < kMaxRanks, < world_size.
  std::uint32_t world_size = 1;    ///< ranks of the job, in [1, kMaxRanks].
  std::uint32_t global_batch = 0;  ///< samples per step over all ranks, <= 2^30; 0: unknown.
  std::uint32_t capabilities = 0;  ///< Capability bits; no unknown bits.
  std::string framework;           ///< e.g. "pytorch-ddp 1.13.1"; <= kMaxNameBytes.
  std::vector<LayerInfo> layers;   ///< per layer of the agent's layer numbering; <= kMaxLayers.
  bool operator==(const JobInfo&) const = default;
};

/// Any message. The variant index + 1 equals the MessageType value.
using Message = std::variant<Hello, Challenge, Auth, Welcome, Heartbeat, Telemetry, PlanPrepare,
                             PlanReady, PlanCommit, PlanAbort, Ack, Shutdown, JobInfo>;

/// Type id of a message.
MessageType type_of(const Message& m);

/// "hello", "telemetry", ...; "unknown" for ids outside the enum.
std::string_view type_name(MessageType t);

/// True when `t` is a type id this version knows.
constexpr bool is_known_type(std::uint8_t t) {
  return t >= kMinMessageType && t <= kMaxMessageType;
}

/// True for the messages the transport sends on its own (handshake and heartbeat); Server and
/// Client refuse to send them on behalf of users.
constexpr bool is_internal_type(MessageType t) {
  return t == MessageType::hello || t == MessageType::challenge || t == MessageType::auth ||
         t == MessageType::welcome || t == MessageType::heartbeat;
}

/// Checks value ranges (see field comments). OK when valid, otherwise kInvalidArgument naming
/// the first violation, e.g. "telemetry.compute_ms is NaN".
Status validate(const Message& m);

/// Appends the cereal PortableBinary payload of `m` to `out`. Does not validate.
void encode_payload(const Message& m, std::string& out);

/// Parses a payload of the given type. Never throws; fails on truncated input, trailing bytes,
/// lengths beyond kMax* limits or the remaining input, non-0/1 booleans, a first byte other than
/// 0x01 (little-endian marker), unknown types, and anything validate() rejects.
StatusOr<Message> decode_payload(MessageType type, std::span<const std::uint8_t> payload);

}  // namespace parapilot::transport
