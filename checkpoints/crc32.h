// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320) — the checksum of checkpoint files.
#pragma once

#include <cstddef>
#include <cstdint>

namespace parapilot::checkpoints {

// CRC of `size` bytes, continuing from `crc` (0 to start). crc32("123456789") == 0xCBF43926.
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);

}  // namespace parapilot::checkpoints
