// Writes a seed corpus for the fuzzer: one valid input per message type in each harness mode.
// Usage: make_seeds <output-dir>. Built by scripts/fuzz-transport.sh.
#include <cstdio>
#include <fstream>
#include <string>

#include "transport/frame.h"
#include "transport/messages.h"
#include "transport/telemetry_keys.h"

using namespace parapilot::transport;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds <dir>\n");
    return 2;
  }
  Telemetry t;
  t.rank = 3;
  t.step = 42;
  t.step_start_ns = 1000;
  t.step_end_ns = 2000;
  t.compute_ms = 12.5;
  t.collectives[telemetry_keys::kAllReduceDp] = {3.5, 1 << 20, 2};
  t.layers = {{0, 1.5F, 0.25F, 0}, {1, 2.0F, 0.5F, 1}};
  Hello h;
  h.name = "worker-3";
  h.rank = 3;
  PlanPrepare elastic{10, {2, 1, 1, 4}, "elastic", 500};
  elastic.layout.dp_shares = {3, 5};
  elastic.layout.compression = {{0, 3, CompressionMethod::topk, 0.01F},
                                {4, 7, CompressionMethod::powersgd, 4}};
  const Message all[] = {h,
                         Challenge{},
                         Auth{},
                         Welcome{7, 1000, 1 << 20},
                         Heartbeat{1, 2},
                         t,
                         PlanPrepare{9, {2, 2, 2, 4}, "dp2-tp2-pp2", 500},
                         PlanReady{9, 3, true, "ok"},
                         PlanCommit{9, 100},
                         PlanAbort{9, "timeout"},
                         Ack{MessageType::plan_commit, 9, 3},
                         Shutdown{"done"},
                         JobInfo{1, 4, 64, kCapDpShares | kCapCompression, "pytorch-ddp",
                                 {{1024, 4096}, {16, 64}}},
                         elastic};
  int n = 0;
  for (const Message& m : all) {
    const std::string frame = *encode_frame(m);
    const std::string payload = frame.substr(kFrameHeaderBytes);
    const char type = static_cast<char>(type_of(m));
    const std::string inputs[] = {std::string("\x00\x07", 2) + frame + frame,
                                  std::string("\x01", 1) + type + payload,
                                  std::string("\x02", 1) + type + payload};
    for (const std::string& in : inputs) {
      std::ofstream(std::string(argv[1]) + "/seed-" + std::to_string(n++), std::ios::binary) << in;
    }
  }
  return 0;
}
