// The worker's training data (no libtorch): the text it trains on, and which sequences make
// up each step's global batch.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>

namespace parapilot::live {

/// The bytes of `path` (a file, or a folder's .md, .cc, .h, .txt and .toml files in path
/// order); empty: 256 KiB of generated English-like text, the same every time. InputError
/// naming the path when it is neither a file nor a folder.
std::string load_corpus(const std::string& path);

/// Where sequence `index` of step `step`'s global batch starts in a corpus of `corpus_bytes`
/// bytes, for sequences of `seq_bytes` bytes (the input and its next-byte targets). A function
/// of (seed, step, index) only, so a step's batch is the same under every layout, rank count
/// and share. Precondition: corpus_bytes > seq_bytes.
std::int64_t sequence_start(std::uint64_t seed, std::uint64_t step, std::uint64_t index,
                            std::int64_t corpus_bytes, std::int64_t seq_bytes);

}  // namespace parapilot::live
