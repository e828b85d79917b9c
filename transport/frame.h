// Frames: the unit on the wire. A 16-byte header followed by a cereal payload.
//
// Purpose: framing, integrity and size limits for any byte stream (TCP or in-memory).
// Header (all little-endian):
//   offset 0  u32 magic     0x544C5050 (bytes "PPLT")
//   offset 4  u8  version   kWireVersion (2: Telemetry carries counts and measures)
//   offset 5  u8  type      MessageType
//   offset 6  u16 flags     0 (reserved; non-zero is rejected)
//   offset 8  u32 length    payload bytes that follow the header
//   offset 12 u32 checksum  CRC32C over header bytes 0..11 followed by the payload
// FrameDecoder checks magic, version, type, flags and length as soon as the header arrives,
// so an oversized or bogus frame is rejected before its payload is buffered.
//
// Thread-safety: free functions are pure; a FrameDecoder belongs to one connection and is used
// by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "transport/messages.h"
#include "core/status.h"

namespace parapilot::transport {

inline constexpr std::uint32_t kFrameMagic = 0x544C5050u;  // "PPLT" in little-endian order
inline constexpr std::uint8_t kWireVersion = 2;
inline constexpr std::size_t kFrameHeaderBytes = 16;
/// Default limit on header + payload of one frame.
inline constexpr std::uint32_t kDefaultMaxFrameBytes = 1u << 20;

struct FrameHeader {
  std::uint32_t magic = kFrameMagic;
  std::uint8_t version = kWireVersion;
  std::uint8_t type = 0;
  std::uint16_t flags = 0;
  std::uint32_t length = 0;
  std::uint32_t checksum = 0;
};

/// Reads the 16 header bytes (no checks). Precondition: bytes.size() >= kFrameHeaderBytes.
FrameHeader parse_header(std::span<const std::uint8_t> bytes);

/// Checks a header against the limits; empty string when acceptable, else the reason.
std::string check_header(const FrameHeader& h, std::uint32_t max_frame_bytes);

/// Appends one frame carrying `m` to `out`. Fails (and leaves `out` unchanged) if validate(m)
/// fails or the frame would exceed max_frame_bytes.
StatusOr<std::size_t> append_frame(const Message& m, std::string& out,
                                 std::uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

/// One frame carrying `m`, as a string of bytes.
StatusOr<std::string> encode_frame(const Message& m,
                                 std::uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

/// Frames raw bytes as they would be framed for `type` (tests, fuzzing, other encoders). No
/// validation of the payload; the checksum is computed.
std::string frame_raw(std::uint8_t type, std::span<const std::uint8_t> payload);

/// Decodes one complete frame (header + payload, nothing more) into a message.
StatusOr<Message> decode_frame(std::span<const std::uint8_t> frame,
                             std::uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

/// Incremental decoder for a byte stream: write bytes in with prepare()/commit() or feed(),
/// take messages out with next(). After the first error the decoder stays failed.
class FrameDecoder {
 public:
  enum class Status { message, need_more, error };

  explicit FrameDecoder(std::uint32_t max_frame_bytes = kDefaultMaxFrameBytes);

  /// Space for at least `n` more bytes; pass the number actually written to commit().
  std::span<std::uint8_t> prepare(std::size_t n);
  /// Space for the next read from a socket: kFirstReadBytes at first, doubled each time a read
  /// fills it, up to kMaxReadBytes. A sparse peer's buffer stays a few KiB (a server of 16,384
  /// ranks holds 16,384 of them); a streaming peer reads 64 KiB per system call.
  std::span<std::uint8_t> prepare_read();
  static constexpr std::size_t kFirstReadBytes = 4u << 10;
  static constexpr std::size_t kMaxReadBytes = 64u << 10;
  void commit(std::size_t n);
  /// prepare + copy + commit.
  void feed(std::span<const std::uint8_t> bytes);

  /// Extracts the next message. On Status::error, error() tells why.
  Status next(Message& out);

  const std::string& error() const { return error_; }
  /// Bytes received but not yet consumed.
  std::size_t buffered_bytes() const { return end_ - begin_; }

 private:
  std::uint32_t max_frame_bytes_;
  std::vector<std::uint8_t> buf_;
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
  std::size_t read_bytes_ = kFirstReadBytes;  // prepare_read()'s size
  std::string error_;
};

}  // namespace parapilot::transport
