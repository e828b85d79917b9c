#include "transport/frame.h"

#include <cstring>

#include "core/checksum.h"

namespace parapilot::transport {
namespace {

void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint32_t get_u32(const std::uint8_t* p) {
  return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
         std::uint32_t{p[3]} << 24;
}

std::string hex32(std::uint32_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "0x";
  for (int i = 7; i >= 0; --i) s.push_back(kDigits[(v >> (4 * i)) & 0xFu]);
  return s;
}

// Writes the header for a payload already at out[at + 16 ...].
void finish_header(std::string& out, std::size_t at, std::uint8_t type) {
  auto* p = reinterpret_cast<std::uint8_t*>(out.data() + at);
  const auto length = static_cast<std::uint32_t>(out.size() - at - kFrameHeaderBytes);
  put_u32(p, kFrameMagic);
  p[4] = kWireVersion;
  p[5] = type;
  p[6] = 0;
  p[7] = 0;
  put_u32(p + 8, length);
  std::uint32_t c = crc32c(std::span<const std::uint8_t>(p, 12));
  c = crc32c(std::span<const std::uint8_t>(p + kFrameHeaderBytes, length), c);
  put_u32(p + 12, c);
}

}  // namespace

FrameHeader parse_header(std::span<const std::uint8_t> b) {
  FrameHeader h;
  h.magic = get_u32(b.data());
  h.version = b[4];
  h.type = b[5];
  h.flags = static_cast<std::uint16_t>(b[6] | b[7] << 8);
  h.length = get_u32(b.data() + 8);
  h.checksum = get_u32(b.data() + 12);
  return h;
}

std::string check_header(const FrameHeader& h, std::uint32_t max_frame_bytes) {
  if (h.magic != kFrameMagic) return "bad magic " + hex32(h.magic);
  if (h.version != kWireVersion) return "unsupported version " + std::to_string(h.version);
  if (!is_known_type(h.type)) return "unknown message type " + std::to_string(h.type);
  if (h.flags != 0) return "reserved flags set";
  if (h.length == 0) return "empty payload";
  if (std::uint64_t{h.length} + kFrameHeaderBytes > max_frame_bytes) {
    return "oversized frame (" + std::to_string(std::uint64_t{h.length} + kFrameHeaderBytes) +
           " > " + std::to_string(max_frame_bytes) + " bytes)";
  }
  return {};
}

StatusOr<std::size_t> append_frame(const Message& m, std::string& out,
                                 std::uint32_t max_frame_bytes) {
  if (Status valid = validate(m); !valid.ok()) {
    return Status::invalid_argument("invalid message: " + valid.message());
  }
  const std::size_t at = out.size();
  out.reserve(at + 256);  // typical frames fit; avoids regrowth while the payload is appended
  out.resize(at + kFrameHeaderBytes);
  encode_payload(m, out);
  const std::size_t frame_bytes = out.size() - at;
  if (frame_bytes > max_frame_bytes) {
    out.resize(at);
    return Status::invalid_argument("message too large for a frame (" + std::to_string(frame_bytes) + " > " +
                 std::to_string(max_frame_bytes) + " bytes)");
  }
  finish_header(out, at, static_cast<std::uint8_t>(type_of(m)));
  return frame_bytes;
}

StatusOr<std::string> encode_frame(const Message& m, std::uint32_t max_frame_bytes) {
  std::string out;
  auto r = append_frame(m, out, max_frame_bytes);
  if (!r) return r.status();
  return out;
}

std::string frame_raw(std::uint8_t type, std::span<const std::uint8_t> payload) {
  std::string out(kFrameHeaderBytes, '\0');
  out.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  finish_header(out, 0, type);
  return out;
}

StatusOr<Message> decode_frame(std::span<const std::uint8_t> frame, std::uint32_t max_frame_bytes) {
  FrameDecoder d(max_frame_bytes);
  d.feed(frame);
  Message m;
  switch (d.next(m)) {
    case FrameDecoder::Status::message:
      if (d.buffered_bytes() != 0) return Status::invalid_argument("trailing bytes after the frame");
      return m;
    case FrameDecoder::Status::need_more:
      return Status::invalid_argument("truncated frame");
    case FrameDecoder::Status::error:
      break;
  }
  return Status::invalid_argument(d.error());
}

FrameDecoder::FrameDecoder(std::uint32_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}

std::span<std::uint8_t> FrameDecoder::prepare(std::size_t n) {
  if (begin_ == end_) {
    begin_ = end_ = 0;
  } else if (begin_ > 0 && buf_.size() - end_ < n) {
    std::memmove(buf_.data(), buf_.data() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  if (buf_.size() - end_ < n) buf_.resize(end_ + n);
  return {buf_.data() + end_, n};
}

std::span<std::uint8_t> FrameDecoder::prepare_read() { return prepare(read_bytes_); }

void FrameDecoder::commit(std::size_t n) {
  end_ += n;
  if (n >= read_bytes_ && read_bytes_ < kMaxReadBytes) read_bytes_ *= 2;
}

void FrameDecoder::feed(std::span<const std::uint8_t> bytes) {
  if (bytes.empty()) return;
  auto dst = prepare(bytes.size());
  std::memcpy(dst.data(), bytes.data(), bytes.size());
  commit(bytes.size());
}

FrameDecoder::Status FrameDecoder::next(Message& out) {
  if (!error_.empty()) return Status::error;
  const std::size_t avail = end_ - begin_;
  if (avail < kFrameHeaderBytes) return Status::need_more;
  const std::uint8_t* p = buf_.data() + begin_;
  const FrameHeader h = parse_header(std::span(p, kFrameHeaderBytes));
  if (std::string why = check_header(h, max_frame_bytes_); !why.empty()) {
    error_ = std::move(why);
    return Status::error;
  }
  if (avail < kFrameHeaderBytes + h.length) return Status::need_more;
  std::uint32_t c = crc32c(std::span(p, 12));
  c = crc32c(std::span(p + kFrameHeaderBytes, h.length), c);
  if (c != h.checksum) {
    error_ = "bad checksum (got " + hex32(h.checksum) + ", computed " + hex32(c) + ")";
    return Status::error;
  }
  auto m =
      decode_payload(static_cast<MessageType>(h.type), std::span(p + kFrameHeaderBytes, h.length));
  if (!m) {
    error_ = "bad " + std::string(type_name(static_cast<MessageType>(h.type))) +
             " payload: " + m.status().message();
    return Status::error;
  }
  begin_ += kFrameHeaderBytes + h.length;
  out = std::move(*m);
  return Status::message;
}

}  // namespace parapilot::transport
