// Recorded per-op traces in the schema of the ByteDance straggler study (OSDI'25, sample in
// tests/data/traces/bytedance-ST): one row per operation of one worker in one training step.
//
// read_op_trace() streams the CSV (millions of rows are fine) and validates every value; bad
// input is a kInvalidArgument naming the file, the line and the column. The types here are plain
// values, safe to share between threads once built.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace parapilot::trace {

enum class OpType : std::uint8_t {
  kForwardCompute,
  kBackwardCompute,
  kForwardSend,
  kForwardRecv,
  kBackwardSend,
  kBackwardRecv,
  kGradsReduceScatter,
  kParamsAllGather,
  kSeparateGradsAllReduce,
  kEmbeddingGradsAllReduce,
  kLayernormGradsAllReduce,
  kOptimizerClipMainGrad,
  kOptimizer,
  kGc,
  kOther,  // an op type this version does not model; kept out of the dependency graph
};
inline constexpr int kNumOpTypes = static_cast<int>(OpType::kOther) + 1;

// "forward-compute", ... as in the trace; kOther for unknown names.
OpType parse_op_type(std::string_view name);
const char* op_type_name(OpType t);
bool is_compute(OpType t);        // forward-compute or backward-compute
bool is_communication(OpType t);  // p2p, collectives, layernorm/embedding all-reduce, clip

// The job layout, from the trace's meta file (YAML "key: value" lines).
struct JobMeta {
  std::string trial_name;
  int dp_size = 1;
  int pp_size = 1;
  int tp_size = 1;
  int dsp_size = 1;
  int vpp_size = 1;
  int world_size = 1;
};

// Reads a meta file; dp_size and pp_size are required, the rest default to 1 (world_size to
// the product of the degrees). kInvalidArgument naming the file, line and key.
StatusOr<JobMeta> read_job_meta(const std::string& path);

struct OpRecord {
  std::int64_t step = 0;
  std::int32_t dp_rank = 0;
  std::int32_t stage = 0;  // pipeline rank
  std::int32_t rank = 0;   // global rank
  std::int32_t seq_id = 0;
  std::int32_t mc = -1;     // model chunk within the stage (-1: not a compute op)
  std::int32_t mb_id = -1;  // microbatch
  std::int32_t gmc = -1;    // global model chunk
  OpType type = OpType::kOther;
  double start_s = 0;
  double duration_s = 0;
  double end_s() const { return start_s + duration_s; }
};

struct OpTrace {
  std::string source;  // file it came from ("" when built in memory)
  JobMeta meta;
  std::vector<OpRecord> ops;
};

// The columns of the schema, in the order write_op_trace() writes them.
inline constexpr const char* kOpTraceColumns =
    "dp_rank,stage,rank,step,optype,start_ts,duration,seq_id,mc,mb_id,gmc";

// True when the first line of the file names the columns of this schema (any order).
bool looks_like_op_trace(const std::string& path);

// Reads a trace CSV (header row with at least the columns above, any order, extra columns
// ignored). Checks that every number parses and is finite, durations are >= 0, dp_rank <
// dp_size, stage < pp_size and rank < world_size, and that the trace is not empty;
// kInvalidArgument naming the file, line and column of the first problem.
StatusOr<OpTrace> read_op_trace(const std::string& path, const JobMeta& meta);
// The same from a stream; `source` names it in error messages.
StatusOr<OpTrace> read_op_trace(std::istream& in, const std::string& source, const JobMeta& meta);

void write_op_trace(const OpTrace& trace, std::ostream& out);

}  // namespace parapilot::trace
