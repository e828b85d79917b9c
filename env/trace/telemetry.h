// parapilot telemetry recordings: one CSV row per rank per training step, written by the
// simulator and live environments and read back by `parapilot trace analyze` and the trace
// replay environment. Format (docs/trace-analysis.md), header row exactly:
//
//   rank,dp_rank,stage,step,start_s,end_s,microbatches,compute_ms,
//   dp_comm_ms,dp_comm_bytes,pp_comm_ms,pp_comm_bytes,tp_comm_ms,tp_comm_bytes
//
// (one line). Times are seconds on the recorder's clock (start_s/end_s bound the step on that
// rank); compute_ms is forward + backward compute of all the rank's microbatches; *_comm_ms is
// the time spent in that kind of collective excluding waiting for peers where known, *_bytes
// what the rank sent in it. Readers reject missing columns, non-numbers, NaN, negatives and
// end_s < start_s with a kInvalidArgument naming file, line and column.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "env/trace/op_trace.h"

namespace parapilot::trace {

struct CollectiveSample {
  double ms = 0;
  double bytes = 0;

  bool operator==(const CollectiveSample&) const = default;
};

struct TelemetrySample {
  int rank = 0;
  int dp_rank = 0;
  int stage = 0;
  std::int64_t step = 0;
  double start_s = 0;
  double end_s = 0;
  int microbatches = 1;
  double compute_ms = 0;
  CollectiveSample dp_comm;  // data-parallel gradient reduction / parameter gathers
  CollectiveSample pp_comm;  // pipeline sends and receives
  CollectiveSample tp_comm;  // tensor/sequence-parallel collectives

  bool operator==(const TelemetrySample&) const = default;
};

struct TelemetryTrace {
  std::string source;
  std::vector<TelemetrySample> samples;
};

inline constexpr const char* kTelemetryColumns =
    "rank,dp_rank,stage,step,start_s,end_s,microbatches,compute_ms,dp_comm_ms,dp_comm_bytes,"
    "pp_comm_ms,pp_comm_bytes,tp_comm_ms,tp_comm_bytes";

// Writes the header and one row per sample, with round-trip precision.
void write_telemetry(const std::vector<TelemetrySample>& samples, std::ostream& out);

bool looks_like_telemetry(const std::string& path);
// Reads a telemetry CSV: kNotFound when the file cannot be opened, kInvalidArgument naming the
// source, line and column at fault.
StatusOr<TelemetryTrace> read_telemetry(const std::string& path);
StatusOr<TelemetryTrace> read_telemetry(std::istream& in, const std::string& source);

// The layout implied by a recording: dp_size = max dp_rank + 1, pp_size = max stage + 1,
// world_size = max rank + 1.
JobMeta telemetry_layout(const TelemetryTrace& t);

// Mean over steps of (latest end_s - earliest start_s) across the step's ranks.
double mean_recorded_step_s(const TelemetryTrace& t);

// An op trace with the same per-rank compute and communication, laid out as a 1F1B schedule
// (forward:backward = 1:2 of compute_ms, split evenly over microbatches; pipeline time split
// over the sends; tensor-parallel time folded into compute), so that the op-level analysis
// applies. Ranks keep their recorded numbers. kInvalidArgument when a (step, dp_rank, stage)
// is recorded twice or the layout has holes.
StatusOr<OpTrace> telemetry_to_op_trace(const TelemetryTrace& t, const JobMeta& meta);

}  // namespace parapilot::trace
