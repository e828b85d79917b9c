// SplitMix64 (Steele, Lea, Flood 2014): a bijective 64-bit mix that turns one seed into
// independent, well-spread seeds (seed + i for stream i). The project's one seed mixer: the
// same input gives the same output on every platform and standard library.
//
// Pure; safe from any thread.
#pragma once

#include <cstdint>

namespace parapilot {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace parapilot
