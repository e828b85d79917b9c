// Shared helpers of the transport tests (no Asio here; see raw_peer.h for sockets).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/bus.h"
#include "transport/frame.h"
#include "transport/messages.h"
#include "transport/telemetry_keys.h"

namespace parapilot::transport::testing {

inline constexpr const char* kTestSecret = "test-secret-0123456789-abcdef";
inline constexpr std::uint32_t kTestMaxFrameBytes = 4096;

/// A ~200-byte telemetry message (two collectives, three layers).
inline Telemetry make_telemetry(std::uint32_t rank, std::uint64_t step) {
  Telemetry t;
  t.rank = rank;
  t.step = step;
  t.step_start_ns = 1'700'000'000'000'000'000ULL + step * 1'000'000ULL;
  t.step_end_ns = t.step_start_ns + 950'000ULL;
  t.send_time_ns = t.step_end_ns + 10;
  t.compute_ms = 0.75;
  t.queue_depth = 3;
  t.collectives[telemetry_keys::kAllReduceDp] = CollectiveStat{0.125, 64u << 20, 4};
  t.collectives["all_gather/tp"] = CollectiveStat{0.0625, 8u << 20, 24};
  t.layers = {{0, 1.5F, 0.03125F, 0}, {1, 2.25F, 0.0625F, 0}, {2, 0.5F, 0.015625F, 1}};
  telemetry_keys::set_info(t, telemetry_keys::kSamples, 32 + step);
  telemetry_keys::set_loss(t, 2.0 - 0.001 * static_cast<double>(step));
  return t;
}

/// Polls `pred` every millisecond until it holds or `timeout` passes.
inline bool wait_until(const std::function<bool()>& pred,
                       std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// Collects log lines (thread-safe) for assertions such as "the secret never appears".
class LogCapture {
 public:
  Logger logger() {
    return [this](LogLevel, std::string_view line) {
      std::lock_guard lk(mu_);
      lines_.emplace_back(line);
    };
  }
  bool contains(std::string_view needle) const {
    std::lock_guard lk(mu_);
    for (const auto& l : lines_) {
      if (l.find(needle) != std::string::npos) return true;
    }
    return false;
  }
  std::string all() const {
    std::lock_guard lk(mu_);
    std::string s;
    for (const auto& l : lines_) s += l + "\n";
    return s;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> lines_;
};

/// One malformed input and the reason the decoder must give.
struct MalformedCase {
  std::string name;
  std::string bytes;
  std::string reason;          ///< substring of the error
  bool closes_stream = false;  ///< the bytes end mid-frame; the sender then closes
};

inline std::string payload_of(const Message& m) {
  std::string p;
  encode_payload(m, p);
  return p;
}
inline std::string framed(MessageType type, const std::string& payload) {
  return frame_raw(
      static_cast<std::uint8_t>(type),
      std::span(reinterpret_cast<const std::uint8_t*>(payload.data()), payload.size()));
}

inline std::vector<MalformedCase> malformed_cases() {
  const std::string good = *encode_frame(make_telemetry(1, 1));
  std::vector<MalformedCase> v;
  auto with = [&](std::size_t at, char value) {
    std::string s = good;
    s[at] = value;
    return s;
  };
  v.push_back({"wrong magic", with(0, 'X'), "bad magic"});
  v.push_back({"wrong version", with(4, static_cast<char>(kWireVersion - 1)), "unsupported version"});
  v.push_back({"unknown type", with(5, static_cast<char>(200)), "unknown message type 200"});
  v.push_back({"reserved flags", with(6, 1), "reserved flags"});
  {
    std::string s = good;
    const std::uint32_t len = kTestMaxFrameBytes;  // + 16 header bytes > limit
    for (int i = 0; i < 4; ++i) s[8 + i] = static_cast<char>((len >> (8 * i)) & 0xFF);
    v.push_back({"oversized", s, "oversized frame"});
  }
  {
    std::string s = good.substr(0, kFrameHeaderBytes);
    for (int i = 0; i < 4; ++i) s[8 + i] = 0;
    v.push_back({"zero length", s, "empty payload"});
  }
  v.push_back({"bad checksum", with(good.size() - 1, static_cast<char>(good.back() ^ 0x40)),
               "bad checksum"});
  {
    std::string s;
    std::uint32_t x = 12345;
    for (int i = 0; i < 200; ++i) {
      x = x * 1664525u + 1013904223u;
      s.push_back(static_cast<char>(x >> 24));
    }
    v.push_back({"garbage", s, "bad magic"});
  }
  {
    const std::string p = payload_of(make_telemetry(1, 1));
    v.push_back({"undecodable payload (truncated telemetry)",
                 framed(MessageType::telemetry, p.substr(0, 20)), "truncated"});
    v.push_back(
        {"trailing bytes in payload", framed(MessageType::telemetry, p + "zz"), "trailing bytes"});
    std::string e = p;
    e[0] = 0;
    v.push_back({"big-endian marker", framed(MessageType::telemetry, e), "endianness"});
  }
  {
    Telemetry t = make_telemetry(1, 1);
    t.compute_ms = std::numeric_limits<double>::quiet_NaN();
    v.push_back(
        {"NaN compute_ms", framed(MessageType::telemetry, payload_of(t)), "compute_ms is NaN"});
    t = make_telemetry(1, 1);
    t.compute_ms = -3;
    v.push_back({"negative compute_ms", framed(MessageType::telemetry, payload_of(t)), "negative"});
    t = make_telemetry(kMaxRanks + 5, 1);
    v.push_back(
        {"rank out of range", framed(MessageType::telemetry, payload_of(t)), "out of range"});
  }
  {
    std::string p = payload_of(PlanReady{1, 2, true, ""});
    p[1 + 8 + 4] = 2;  // the bool
    v.push_back({"boolean not 0/1", framed(MessageType::plan_ready, p), "not a boolean"});
  }
  {
    std::string p = payload_of(PlanAbort{1, "x"});
    p[1 + 8 + 7] = 0x40;  // length 2^62 + 1
    v.push_back({"huge string length", framed(MessageType::plan_abort, p), "exceeds limit"});
  }
  {
    std::string p = payload_of(Ack{MessageType::plan_commit, 1, 1});
    p[1] = 99;
    v.push_back({"enum out of range", framed(MessageType::ack, p), "not a message type"});
  }
  v.push_back({"truncated frame", good.substr(0, good.size() / 2), "truncated frame", true});
  v.push_back({"truncated header", good.substr(0, 9), "truncated frame", true});
  return v;
}

/// The case called `name` (empty bytes if there is none).
inline MalformedCase malformed_case(std::string_view name) {
  for (auto& c : malformed_cases()) {
    if (c.name == name) return c;
  }
  return {};
}

}  // namespace parapilot::transport::testing
