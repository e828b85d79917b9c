#include "transport/messages.h"

#include <cereal/archives/portable_binary.hpp>

#include <cmath>
#include <istream>
#include <ostream>
#include <streambuf>
#include <type_traits>

namespace parapilot::transport {
namespace {

// ---- streams over caller memory (no copies) ----

class StringSink final : public std::streambuf {
 public:
  explicit StringSink(std::string* out) : out_(out) {}
  void target(std::string* out) { out_ = out; }

 protected:
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    out_->append(s, static_cast<std::size_t>(n));
    return n;
  }
  int_type overflow(int_type ch) override {
    if (!traits_type::eq_int_type(ch, traits_type::eof()))
      out_->push_back(traits_type::to_char_type(ch));
    return traits_type::not_eof(ch);
  }

 private:
  std::string* out_;
};

class SpanSource final : public std::streambuf {
 public:
  explicit SpanSource(std::span<const std::uint8_t> in) { reset(in); }
  void reset(std::span<const std::uint8_t> in) {
    // std::streambuf wants char*; the buffer is only read.
    char* p = const_cast<char*>(reinterpret_cast<const char*>(in.data()));
    setg(p, p, p + in.size());
  }
  std::size_t remaining() const { return static_cast<std::size_t>(egptr() - gptr()); }
};

struct DecodeFailure {
  std::string reason;
};

// ---- field visitors: one list of fields per message, used by both directions ----

// Field lists. `M` is const-qualified for writing, mutable for reading.
template <class V, class M>
requires std::is_same_v<std::remove_const_t<M>, CollectiveStat>
void visit_fields(V& v, M& m, const char*) {
  v(m.ms, "collective.ms");
  v(m.bytes, "collective.bytes");
  v(m.calls, "collective.calls");
}
template <class V, class M>
requires std::is_same_v<std::remove_const_t<M>, LayerGradStat>
void visit_fields(V& v, M& m, const char*) {
  v(m.layer, "layer.layer");
  v(m.norm, "layer.norm");
  v(m.max_abs, "layer.max_abs");
  v(m.nonfinite_count, "layer.nonfinite_count");
}

template <class V, class M>
requires std::is_same_v<std::remove_const_t<M>, LayerCompression>
void visit_fields(V& v, M& m, const char*) {
  v(m.first_layer, "compression.first_layer");
  v(m.last_layer, "compression.last_layer");
  v(m.method, "compression.method");
  v(m.parameter, "compression.parameter");
}
template <class V, class M>
requires std::is_same_v<std::remove_const_t<M>, LayerInfo>
void visit_fields(V& v, M& m, const char*) {
  v(m.params, "layer_info.params");
  v(m.grad_bytes, "layer_info.grad_bytes");
}
// Plain numbers as vector elements (dp_shares).
template <class V, class M>
requires std::is_arithmetic_v<std::remove_const_t<M>>
void visit_fields(V& v, M& m, const char* name) { v(m, name); }

// Smallest encoded size of one element, to bound counts before allocating.
constexpr std::size_t min_encoded_bytes(const CollectiveStat*) { return 8 + 8 + 4; }
constexpr std::size_t min_encoded_bytes(const LayerGradStat*) { return 4 + 4 + 4 + 4; }
constexpr std::size_t min_encoded_bytes(const LayerCompression*) { return 4 + 4 + 1 + 4; }
constexpr std::size_t min_encoded_bytes(const LayerInfo*) { return 8 + 8; }
constexpr std::size_t min_encoded_bytes(const std::uint32_t*) { return 4; }
constexpr std::size_t min_encoded_bytes(const std::uint64_t*) { return 8; }
constexpr std::size_t min_encoded_bytes(const double*) { return 8; }

struct Writer {
  cereal::PortableBinaryOutputArchive& ar;

  template <class T>
  requires std::is_arithmetic_v<T>
  void operator()(const T& v, const char* /*name*/) {
    if constexpr (std::is_same_v<T, bool>) {
      ar(static_cast<std::uint8_t>(v ? 1 : 0));
    } else {
      ar(v);
    }
  }
  template <class E>
  requires std::is_enum_v<E>
  void operator()(const E& v, const char* /*name*/) {
    ar(static_cast<std::underlying_type_t<E>>(v));
  }
  void operator()(const std::string& s, const char* /*name*/, std::size_t /*max*/) {
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(s.size())));
    ar(cereal::binary_data(s.data(), s.size()));
  }
  template <std::size_t N>
  void operator()(const std::array<std::uint8_t, N>& a, const char* /*name*/) {
    ar(cereal::binary_data(a.data(), N));
  }
  template <class T>
  void operator()(const std::vector<T>& v, const char* name, std::size_t /*max*/) {
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(v.size())));
    for (const auto& e : v) visit_fields(*this, e, name);
  }
  template <class T>
  void operator()(const std::map<std::string, T>& m, const char* name, std::size_t max) {
    ar(cereal::make_size_tag(static_cast<cereal::size_type>(m.size())));
    for (const auto& [k, v] : m) {
      (*this)(k, name, max);
      visit_fields(*this, v, name);
    }
  }
};

struct Reader {
  cereal::PortableBinaryInputArchive& ar;
  SpanSource& src;

  [[noreturn]] static void fail(std::string reason) { throw DecodeFailure{std::move(reason)}; }

  std::size_t read_count(const char* name, std::size_t max, std::size_t min_elem_bytes) {
    cereal::size_type n = 0;
    ar(cereal::make_size_tag(n));
    if (n > max)
      fail(std::string(name) + " length " + std::to_string(n) + " exceeds limit " +
           std::to_string(max));
    if (n * min_elem_bytes > src.remaining()) {
      fail(std::string(name) + " length " + std::to_string(n) + " exceeds the remaining payload");
    }
    return static_cast<std::size_t>(n);
  }

  template <class T>
  requires std::is_arithmetic_v<T>
  void operator()(T& v, const char* name) {
    if constexpr (std::is_same_v<T, bool>) {
      std::uint8_t b = 0;
      ar(b);
      if (b > 1) fail(std::string(name) + " is not a boolean (" + std::to_string(b) + ")");
      v = b != 0;
    } else {
      ar(v);
    }
  }
  template <class E>
  requires std::is_enum_v<E>
  void operator()(E& v, const char* /*name*/) {
    std::underlying_type_t<E> raw{};
    ar(raw);
    v = static_cast<E>(raw);  // range checked by validate()
  }
  void operator()(std::string& s, const char* name, std::size_t max) {
    const std::size_t n = read_count(name, max, 1);
    s.resize(n);
    ar(cereal::binary_data(s.data(), n));
  }
  template <std::size_t N>
  void operator()(std::array<std::uint8_t, N>& a, const char* /*name*/) {
    ar(cereal::binary_data(a.data(), N));
  }
  template <class T>
  void operator()(std::vector<T>& v, const char* name, std::size_t max) {
    const std::size_t n = read_count(name, max, min_encoded_bytes(static_cast<const T*>(nullptr)));
    v.resize(n);
    for (auto& e : v) visit_fields(*this, e, name);
  }
  template <class T>
  void operator()(std::map<std::string, T>& m, const char* name, std::size_t max) {
    const std::size_t n =
        read_count(name, max, 8 + min_encoded_bytes(static_cast<const T*>(nullptr)));
    m.clear();
    for (std::size_t i = 0; i < n; ++i) {
      std::string key;
      (*this)(key, name, kMaxNameBytes);
      T value;
      visit_fields(*this, value, name);
      if (!m.emplace(std::move(key), std::move(value)).second) {
        fail(std::string(name) + " has a duplicate key");
      }
    }
  }
};

template <class V, class M>
void visit_message(V& v, M& m) {
  using T = std::remove_const_t<M>;
  if constexpr (std::is_same_v<T, Hello>) {
    v(m.role, "hello.role");
    v(m.rank, "hello.rank");
    v(m.name, "hello.name", kMaxNameBytes);
    v(m.client_nonce, "hello.client_nonce");
  } else if constexpr (std::is_same_v<T, Challenge>) {
    v(m.server_nonce, "challenge.server_nonce");
    v(m.server_proof, "challenge.server_proof");
  } else if constexpr (std::is_same_v<T, Auth>) {
    v(m.client_proof, "auth.client_proof");
  } else if constexpr (std::is_same_v<T, Welcome>) {
    v(m.peer_id, "welcome.peer_id");
    v(m.heartbeat_interval_ms, "welcome.heartbeat_interval_ms");
    v(m.max_frame_bytes, "welcome.max_frame_bytes");
  } else if constexpr (std::is_same_v<T, Heartbeat>) {
    v(m.seq, "heartbeat.seq");
    v(m.send_time_ns, "heartbeat.send_time_ns");
  } else if constexpr (std::is_same_v<T, Telemetry>) {
    v(m.rank, "telemetry.rank");
    v(m.step, "telemetry.step");
    v(m.step_start_ns, "telemetry.step_start_ns");
    v(m.step_end_ns, "telemetry.step_end_ns");
    v(m.send_time_ns, "telemetry.send_time_ns");
    v(m.compute_ms, "telemetry.compute_ms");
    v(m.queue_depth, "telemetry.queue_depth");
    v(m.collectives, "telemetry.collectives", kMaxCollectives);
    v(m.layers, "telemetry.layers", kMaxLayers);
    v(m.counts, "telemetry.counts", kMaxFacts);
    v(m.measures, "telemetry.measures", kMaxFacts);
  } else if constexpr (std::is_same_v<T, PlanPrepare>) {
    v(m.plan_id, "plan_prepare.plan_id");
    v(m.layout.dp, "plan_prepare.layout.dp");
    v(m.layout.tp, "plan_prepare.layout.tp");
    v(m.layout.pp, "plan_prepare.layout.pp");
    v(m.layout.micro_batches, "plan_prepare.layout.micro_batches");
    v(m.layout.dp_shares, "plan_prepare.layout.dp_shares", kMaxRanks);
    v(m.layout.compression, "plan_prepare.layout.compression", kMaxLayers);
    v(m.layout_name, "plan_prepare.layout_name", kMaxNameBytes);
    v(m.deadline_ms, "plan_prepare.deadline_ms");
  } else if constexpr (std::is_same_v<T, PlanReady>) {
    v(m.plan_id, "plan_ready.plan_id");
    v(m.rank, "plan_ready.rank");
    v(m.ok, "plan_ready.ok");
    v(m.detail, "plan_ready.detail", kMaxTextBytes);
  } else if constexpr (std::is_same_v<T, PlanCommit>) {
    v(m.plan_id, "plan_commit.plan_id");
    v(m.switch_at_step, "plan_commit.switch_at_step");
  } else if constexpr (std::is_same_v<T, PlanAbort>) {
    v(m.plan_id, "plan_abort.plan_id");
    v(m.reason, "plan_abort.reason", kMaxTextBytes);
  } else if constexpr (std::is_same_v<T, Ack>) {
    v(m.acked, "ack.acked");
    v(m.id, "ack.id");
    v(m.rank, "ack.rank");
  } else if constexpr (std::is_same_v<T, Shutdown>) {
    v(m.reason, "shutdown.reason", kMaxTextBytes);
  } else if constexpr (std::is_same_v<T, JobInfo>) {
    v(m.rank, "job_info.rank");
    v(m.world_size, "job_info.world_size");
    v(m.global_batch, "job_info.global_batch");
    v(m.capabilities, "job_info.capabilities");
    v(m.framework, "job_info.framework", kMaxNameBytes);
    v(m.layers, "job_info.layers", kMaxLayers);
  } else {
    static_assert(!sizeof(T), "message type missing from visit_message");
  }
}

// ---- validation helpers ----

std::string check_duration(double ms, const char* name) {
  if (std::isnan(ms)) return std::string(name) + " is NaN";
  if (!std::isfinite(ms)) return std::string(name) + " is infinite";
  if (ms < 0) return std::string(name) + " is negative";
  if (ms > kMaxDurationMs) return std::string(name) + " is too large";
  return {};
}
std::string check_magnitude(float v, const char* name) {
  if (!std::isfinite(v)) return std::string(name) + " is not finite";
  if (v < 0) return std::string(name) + " is negative";
  return {};
}
std::string check_rank(std::uint32_t rank, const char* name, bool allow_none) {
  if (allow_none && rank == kNoRank) return {};
  if (rank >= kMaxRanks) return std::string(name) + " " + std::to_string(rank) + " is out of range";
  return {};
}
std::string check_len(const std::string& s, std::size_t max, const char* name) {
  if (s.size() > max)
    return std::string(name) + " is longer than " + std::to_string(max) + " bytes";
  return {};
}

std::string validate_one(const Hello& m) {
  const auto role = static_cast<std::uint8_t>(m.role);
  if (role < 1 || role > 4) return "hello.role " + std::to_string(role) + " is unknown";
  if (m.name.empty()) return "hello.name is empty";
  if (auto e = check_len(m.name, kMaxNameBytes, "hello.name"); !e.empty()) return e;
  for (char ch : m.name) {
    if (ch < 0x21 || ch > 0x7E) return "hello.name has a byte outside printable ASCII";
  }
  return check_rank(m.rank, "hello.rank", true);
}
std::string validate_one(const Challenge&) { return {}; }
std::string validate_one(const Auth&) { return {}; }
std::string validate_one(const Welcome& m) {
  if (m.peer_id == 0) return "welcome.peer_id is 0";
  return {};
}
std::string validate_one(const Heartbeat&) { return {}; }
std::string validate_one(const Telemetry& m) {
  if (auto e = check_rank(m.rank, "telemetry.rank", false); !e.empty()) return e;
  if (m.step_end_ns < m.step_start_ns) return "telemetry.step_end_ns is before step_start_ns";
  if (auto e = check_duration(m.compute_ms, "telemetry.compute_ms"); !e.empty()) return e;
  if (m.collectives.size() > kMaxCollectives) return "telemetry.collectives has too many entries";
  for (const auto& [name, c] : m.collectives) {
    if (name.empty()) return "telemetry.collectives has an empty name";
    if (auto e = check_len(name, kMaxNameBytes, "telemetry.collectives name"); !e.empty()) return e;
    if (auto e = check_duration(c.ms, "telemetry.collectives.ms"); !e.empty()) return e;
  }
  if (m.layers.size() > kMaxLayers) return "telemetry.layers has too many entries";
  for (const auto& l : m.layers) {
    if (auto e = check_magnitude(l.norm, "telemetry.layers.norm"); !e.empty()) return e;
    if (auto e = check_magnitude(l.max_abs, "telemetry.layers.max_abs"); !e.empty()) return e;
  }
  if (m.counts.size() > kMaxFacts) return "telemetry.counts has too many entries";
  for (const auto& [name, value] : m.counts) {
    if (name.empty()) return "telemetry.counts has an empty name";
    if (auto e = check_len(name, kMaxNameBytes, "telemetry.counts name"); !e.empty()) return e;
  }
  if (m.measures.size() > kMaxFacts) return "telemetry.measures has too many entries";
  for (const auto& [name, value] : m.measures) {
    if (name.empty()) return "telemetry.measures has an empty name";
    if (auto e = check_len(name, kMaxNameBytes, "telemetry.measures name"); !e.empty()) return e;
    if (!std::isfinite(value)) return "telemetry.measures." + name + " is not finite";
  }
  return {};
}
std::string validate_one(const PlanPrepare& m) {
  const Layout& l = m.layout;
  if (l.dp == 0 || l.tp == 0 || l.pp == 0) return "plan_prepare.layout has a zero degree";
  const std::uint64_t world = std::uint64_t{l.dp} * l.tp * l.pp;
  if (world > kMaxRanks) return "plan_prepare.layout needs too many ranks";
  if (l.micro_batches == 0 || l.micro_batches > 65536) {
    return "plan_prepare.layout.micro_batches is out of range";
  }
  if (!l.dp_shares.empty()) {
    if (l.dp_shares.size() != l.dp) return "plan_prepare.layout.dp_shares does not have dp entries";
    for (std::uint32_t share : l.dp_shares) {
      if (share == 0 || share > (1u << 24))
        return "plan_prepare.layout.dp_shares entry is out of range";
    }
  }
  if (l.compression.size() > kMaxLayers)
    return "plan_prepare.layout.compression has too many entries";
  for (const LayerCompression& c : l.compression) {
    if (c.first_layer > c.last_layer || c.last_layer >= kMaxLayers) {
      return "plan_prepare.layout.compression has a bad layer range";
    }
    const bool finite = std::isfinite(c.parameter);
    switch (c.method) {
      case CompressionMethod::none:
      case CompressionMethod::fp16:
        if (c.parameter != 0) return "plan_prepare.layout.compression parameter must be 0";
        break;
      case CompressionMethod::topk:
        if (!finite || !(c.parameter > 0 && c.parameter < 1)) {
          return "plan_prepare.layout.compression topk ratio is out of (0, 1)";
        }
        break;
      case CompressionMethod::powersgd:
        if (!finite || c.parameter < 1 || c.parameter > 1024 ||
            c.parameter != std::floor(c.parameter)) {
          return "plan_prepare.layout.compression powersgd rank is out of [1, 1024]";
        }
        break;
      default:
        return "plan_prepare.layout.compression method is unknown";
    }
  }
  return check_len(m.layout_name, kMaxNameBytes, "plan_prepare.layout_name");
}
std::string validate_one(const PlanReady& m) {
  if (auto e = check_rank(m.rank, "plan_ready.rank", false); !e.empty()) return e;
  return check_len(m.detail, kMaxTextBytes, "plan_ready.detail");
}
std::string validate_one(const PlanCommit&) { return {}; }
std::string validate_one(const PlanAbort& m) {
  return check_len(m.reason, kMaxTextBytes, "plan_abort.reason");
}
std::string validate_one(const Ack& m) {
  if (!is_known_type(static_cast<std::uint8_t>(m.acked))) return "ack.acked is not a message type";
  return check_rank(m.rank, "ack.rank", true);
}
std::string validate_one(const Shutdown& m) {
  return check_len(m.reason, kMaxTextBytes, "shutdown.reason");
}
std::string validate_one(const JobInfo& m) {
  if (m.world_size == 0 || m.world_size > kMaxRanks) return "job_info.world_size is out of range";
  if (m.rank >= m.world_size) return "job_info.rank is not below job_info.world_size";
  if (m.global_batch > (1u << 30)) return "job_info.global_batch is too large";
  if ((m.capabilities & ~kKnownCapabilities) != 0) return "job_info.capabilities has unknown bits";
  if (auto e = check_len(m.framework, kMaxNameBytes, "job_info.framework"); !e.empty()) return e;
  if (m.layers.size() > kMaxLayers) return "job_info.layers has too many entries";
  return {};
}

template <std::size_t I = 0>
Message make_default(std::size_t index) {
  if constexpr (I < std::variant_size_v<Message>) {
    if (index == I) return Message(std::in_place_index<I>);
    return make_default<I + 1>(index);
  } else {
    return Message{};
  }
}

}  // namespace

MessageType type_of(const Message& m) { return static_cast<MessageType>(m.index() + 1); }

std::string_view type_name(MessageType t) {
  switch (t) {
    case MessageType::hello:
      return "hello";
    case MessageType::challenge:
      return "challenge";
    case MessageType::auth:
      return "auth";
    case MessageType::welcome:
      return "welcome";
    case MessageType::heartbeat:
      return "heartbeat";
    case MessageType::telemetry:
      return "telemetry";
    case MessageType::plan_prepare:
      return "plan_prepare";
    case MessageType::plan_ready:
      return "plan_ready";
    case MessageType::plan_commit:
      return "plan_commit";
    case MessageType::plan_abort:
      return "plan_abort";
    case MessageType::ack:
      return "ack";
    case MessageType::shutdown:
      return "shutdown";
    case MessageType::job_info:
      return "job_info";
  }
  return "unknown";
}

Status validate(const Message& m) {
  std::string why = std::visit([](const auto& x) { return validate_one(x); }, m);
  if (why.empty()) return {};
  return Status::invalid_argument(std::move(why));
}

namespace {

// Streams and archives are expensive to construct (locales, archive registries) compared with a
// 200-byte message, so each thread keeps one set and points it at the next buffer. The archives
// hold no state between messages (no pointers, no versions, no polymorphism); the one-byte
// prologue each archive handles at construction is written/checked by hand per message.
struct EncodeState {
  std::string prologue;
  StringSink sink{&prologue};
  std::ostream os{&sink};
  cereal::PortableBinaryOutputArchive ar{
      os, cereal::PortableBinaryOutputArchive::Options::LittleEndian()};
};

struct DecodeState {
  static constexpr std::uint8_t kPrologue[1] = {0x01};
  SpanSource src{std::span<const std::uint8_t>(kPrologue)};
  std::istream is{&src};
  cereal::PortableBinaryInputArchive ar{
      is, cereal::PortableBinaryInputArchive::Options::LittleEndian()};
};

}  // namespace

void encode_payload(const Message& m, std::string& out) {
  thread_local EncodeState st;
  st.sink.target(&out);
  out.push_back('\x01');  // the archive prologue: data is little-endian
  Writer w{st.ar};
  std::visit([&](const auto& x) { visit_message(w, x); }, m);
  st.sink.target(&st.prologue);
}

StatusOr<Message> decode_payload(MessageType type, std::span<const std::uint8_t> payload) {
  const auto raw = static_cast<std::uint8_t>(type);
  if (!is_known_type(raw)) return Status::invalid_argument("unknown message type " + std::to_string(raw));
  if (payload.empty()) return Status::invalid_argument("empty payload");
  if (payload[0] != 0x01) return Status::invalid_argument("payload endianness marker is not 0x01");
  thread_local DecodeState st;
  try {
    SpanSource& src = st.src;
    src.reset(payload.subspan(1));  // the prologue byte was checked above
    Reader r{st.ar, src};
    Message m = make_default(raw - 1u);
    std::visit([&](auto& x) { visit_message(r, x); }, m);
    if (src.remaining() != 0) {
      return Status::invalid_argument(std::string(type_name(type)) + " payload has " +
                   std::to_string(src.remaining()) + " trailing bytes");
    }
    if (Status valid = validate(m); !valid.ok()) return valid;
    return m;
  } catch (const DecodeFailure& f) {
    return Status::invalid_argument(f.reason);
  } catch (const cereal::Exception&) {
    return Status::invalid_argument(std::string(type_name(type)) + " payload is truncated");
  } catch (const std::exception& e) {
    return Status::invalid_argument(std::string("payload rejected: ") + e.what());
  }
}

}  // namespace parapilot::transport
