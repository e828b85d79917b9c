#include "core/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace parapilot {
namespace {

// Slicing-by-8 tables: kTables[0] is the classic byte-wise table.
using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[0][i] = c;
  }
  for (std::uint32_t i = 0; i < 256; ++i) {
    for (std::size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  }
  return t;
}

constexpr Tables kTables = make_tables();

#if defined(__x86_64__)
// The SSE4.2 CRC32 instruction computes exactly CRC32C; used when the CPU has it.
__attribute__((target("sse4.2"))) std::uint32_t crc32c_hw(const std::uint8_t* p, std::size_t n,
                                                          std::uint32_t crc) {
  std::uint64_t c = ~crc;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}

const bool kHaveHwCrc = __builtin_cpu_supports("sse4.2");
#endif

std::uint32_t crc32c_sw(std::span<const std::uint8_t> data, std::uint32_t crc);

}  // namespace

std::uint32_t crc32c(std::span<const std::uint8_t> data, std::uint32_t crc) {
#if defined(__x86_64__)
  if (kHaveHwCrc) return crc32c_hw(data.data(), data.size(), crc);
#endif
  return crc32c_sw(data, crc);
}

std::uint32_t crc32c_portable(std::span<const std::uint8_t> data, std::uint32_t crc) {
  return crc32c_sw(data, crc);
}

namespace {

std::uint32_t crc32c_sw(std::span<const std::uint8_t> data, std::uint32_t crc) {
  std::uint32_t c = ~crc;
  const std::uint8_t* p = data.data();
  std::size_t n = data.size();
  while (n >= 8) {
    const std::uint32_t lo = c ^ (std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 |
                                  std::uint32_t{p[2]} << 16 | std::uint32_t{p[3]} << 24);
    const std::uint32_t hi = std::uint32_t{p[4]} | std::uint32_t{p[5]} << 8 |
                             std::uint32_t{p[6]} << 16 | std::uint32_t{p[7]} << 24;
    c = kTables[7][lo & 0xFFu] ^ kTables[6][(lo >> 8) & 0xFFu] ^ kTables[5][(lo >> 16) & 0xFFu] ^
        kTables[4][lo >> 24] ^ kTables[3][hi & 0xFFu] ^ kTables[2][(hi >> 8) & 0xFFu] ^
        kTables[1][(hi >> 16) & 0xFFu] ^ kTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xFFu];
  return ~c;
}

}  // namespace

}  // namespace parapilot
