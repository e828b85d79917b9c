#include "env/live/corpus.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/random.h"

namespace parapilot::live {

namespace {

std::string generated_corpus() {
  // Deterministic English-like text about the project's own subject.
  static const char* const kWords[] = {
      "the",         "rank",   "layout",  "gradient",   "pipeline", "stage",      "tensor",
      "parallel",    "batch",  "share",   "slow",       "link",     "all-reduce", "bucket",
      "compression", "agent",  "policy",  "throughput", "step",     "telemetry",  "plan",
      "commit",      "of",     "and",     "a",          "to",       "is",         "when",
      "every",       "faster", "cluster", "worker",     "model",    "token",      "bytes",
      "train",       "with",   "on"};
  constexpr std::size_t n = sizeof kWords / sizeof kWords[0];
  std::string out;
  std::uint64_t s = 12345;
  while (out.size() < (1u << 18)) {
    const int words = 5 + static_cast<int>((s = splitmix64(s)) % 10);
    for (int w = 0; w < words; ++w) {
      // Zipf-like choice: low indices are more frequent; a word depends on the previous one.
      s = splitmix64(s);
      const std::size_t i = (s % n) * (s % n) / n;
      std::string word = kWords[i];
      if (w == 0) word[0] = static_cast<char>(std::toupper(word[0]));
      out += word;
      out += w + 1 == words ? ".\n" : " ";
    }
  }
  return out;
}

}  // namespace

std::string load_corpus(const std::string& path) {
  if (path.empty()) return generated_corpus();
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> files;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::recursive_directory_iterator(path, ec)) {
      const std::string ext = e.path().extension().string();
      if (e.is_regular_file() &&
          (ext == ".md" || ext == ".cc" || ext == ".h" || ext == ".txt" || ext == ".toml"))
        files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
  } else if (fs::is_regular_file(path, ec)) {
    files.push_back(path);
  } else {
    throw InputError("--corpus '" + path + "': no such file or folder");
  }
  std::string out;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    out += ss.str();
  }
  return out;
}

std::int64_t sequence_start(std::uint64_t seed, std::uint64_t step, std::uint64_t index,
                            std::int64_t corpus_bytes, std::int64_t seq_bytes) {
  const std::uint64_t h = splitmix64(seed * 0x100000001B3ull ^ (step << 24) ^ index);
  return static_cast<std::int64_t>(h % static_cast<std::uint64_t>(corpus_bytes - seq_bytes));
}

}  // namespace parapilot::live
