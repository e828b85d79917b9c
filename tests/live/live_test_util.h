// Helpers the live cluster tests share: scratch folders, reading what workers wrote, the small
// transformer most tests train, and the check that every rank of a cluster ended cleanly.
// Include after doctest (and, in files that include c10d headers, after undefining glog's
// CHECK; see hybrid_test.cc).
#pragma once

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "env/live/action.h"
#include "env/live/local_cluster.h"

namespace parapilot::live::testing {

/// A fresh, empty folder /tmp/parapilot-live-SUITE-NAME-PID.
inline std::string temp_dir(const std::string& suite, const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("parapilot-live-" + suite + "-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

/// The raw float32 values of a file (a worker's --dump-params).
inline std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// The 4-block transformer of the hybrid and switch tests (stages can be uneven).
inline ModelConfig four_blocks() {
  ModelConfig m;
  m.layers = 4;
  m.d_model = 32;
  m.heads = 2;
  m.seq_len = 16;
  return m;
}

/// Worker flags for four_blocks(): a global batch of 8 microbatches of one sequence (so each
/// replica of a dp=2 layout runs 4 through its pipeline: warm-up, steady 1F1B and cool-down all
/// occur), Adam, one thread.
inline std::vector<std::string> four_block_args() {
  const ModelConfig m = four_blocks();
  return {"--layers",     std::to_string(m.layers), "--d-model", std::to_string(m.d_model),
          "--heads",      std::to_string(m.heads),  "--seq-len", std::to_string(m.seq_len),
          "--global-batch", "8", "--microbatch", "1", "--threads", "1", "--optimizer", "adam",
          "--collective-timeout", "20", "--rendezvous-timeout", "30"};
}

/// A per-layer --compression for four_blocks() under which every tensor keeps error feedback:
/// the matrices alternately PowerSGD and top-k, the vectors top-k.
inline std::string feedback_compression() {
  std::string out;
  bool powersgd = true;
  for (const LayerShape& l : model_layers(four_blocks())) {
    if (!out.empty()) out += ',';
    if (l.shape.size() < 2) {
      out += "topk";
      continue;
    }
    out += powersgd ? "powersgd" : "topk";
    powersgd = !powersgd;
  }
  return out;
}

/// Every rank exited by itself with code 0.
inline void check_all_finished(const std::vector<RankExit>& exits, const std::string& logs) {
  for (const auto& e : exits) {
    INFO(e.describe() << " (logs in " << logs << ")");
    CHECK(e.exited);
    CHECK(e.signal == 0);
    CHECK(e.code == 0);
  }
}

/// Options that start `workers` ranks of this test program as workers (--live-worker) with
/// `args`, under the in-process agent when `agent`, their logs in `logs`.
inline LocalClusterOptions cluster(int workers, std::vector<std::string> args, bool agent,
                                   const std::string& logs) {
  LocalClusterOptions o;
  o.workers = workers;
  o.worker_command = {"/proc/self/exe", "--live-worker"};
  o.worker_args = std::move(args);
  o.host_agent = agent;
  o.log_dir = logs;
  return o;
}

}  // namespace parapilot::live::testing
