// CRC32C (Castagnoli): the project's one checksum, of wire frames, policy checkpoints and live
// training checkpoints.
//
// Purpose: detects corrupted bytes. Not a security measure (authentication is HMAC-SHA256 in
// auth.h). Parameters: reflected polynomial 0x82F63B78, initial value 0xFFFFFFFF, final XOR
// 0xFFFFFFFF; crc32c("123456789") == 0xE3069283. Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace parapilot {

/// Continues a CRC32C: crc32c(b, crc32c(a)) == crc32c(a || b). Start with crc = 0.
/// Uses the SSE4.2 CRC32 instruction when the CPU has it, else a table (slicing-by-8).
std::uint32_t crc32c(std::span<const std::uint8_t> data, std::uint32_t crc = 0);

/// The table implementation only (tests compare both).
std::uint32_t crc32c_portable(std::span<const std::uint8_t> data, std::uint32_t crc = 0);

}  // namespace parapilot
