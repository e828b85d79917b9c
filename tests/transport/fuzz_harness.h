// One fuzz input through the frame decoder and the payload parser.
//
// Shared by the libFuzzer target (tests/transport/fuzz/fuzz_transport.cc, built by
// scripts/fuzz-transport.sh) and by the doctest that replays tests/data/fuzz-transport/.
// Byte 0 selects the mode:
//   0: the rest is a TCP byte stream, cut into chunks whose size comes from byte 1;
//   1: byte 1 is a message type, the rest a payload for decode_payload();
//   2: like 1 but wrapped into a frame with a correct checksum and decoded by decode_frame().
// Every decoded message must re-encode and decode to an equal message; a mismatch aborts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "transport/frame.h"
#include "transport/messages.h"

namespace parapilot::transport::fuzz {

inline void check_round_trip(const Message& m) {
  auto f = encode_frame(m);
  if (!f) std::abort();  // a decoded message must always be encodable
  auto back = decode_frame(std::span(reinterpret_cast<const std::uint8_t*>(f->data()), f->size()));
  if (!back || !(*back == m)) std::abort();
}

inline void run_one_input(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return;
  const std::uint8_t mode = data[0] % 3;
  const std::span<const std::uint8_t> rest(data + 2, size - 2);
  if (mode == 0) {
    FrameDecoder d(4096);
    const std::size_t chunk = std::size_t{data[1]} + 1;
    for (std::size_t off = 0; off < rest.size(); off += chunk) {
      d.feed(rest.subspan(off, std::min(chunk, rest.size() - off)));
      Message m;
      for (;;) {
        const auto st = d.next(m);
        if (st != FrameDecoder::Status::message) break;
        check_round_trip(m);
      }
      if (!d.error().empty()) return;
    }
  } else if (mode == 1) {
    auto m = decode_payload(static_cast<MessageType>(data[1]), rest);
    if (m) check_round_trip(*m);
  } else {
    const std::string f = frame_raw(data[1], rest);
    auto m = decode_frame(std::span(reinterpret_cast<const std::uint8_t*>(f.data()), f.size()));
    if (m) check_round_trip(*m);
  }
}

}  // namespace parapilot::transport::fuzz
