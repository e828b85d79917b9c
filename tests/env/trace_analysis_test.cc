// Trace import, replay and what-if analysis (env/trace).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include "env/trace/op_trace.h"
#include "env/trace/replay.h"
#include "env/trace/telemetry.h"
#include "env/trace/trace_analysis.h"
#include "strategy/error.h"

using namespace parapilot;
using namespace parapilot::trace;

namespace {

const std::string kSampleDir = std::string(PARAPILOT_TEST_DATA_DIR) + "/traces/bytedance-ST";

JobMeta layout(int dp, int pp) {
  JobMeta m;
  m.dp_size = dp;
  m.pp_size = pp;
  m.world_size = dp * pp;
  return m;
}

// A healthy job: forward 10 ms, backward 20 ms per microbatch on every stage.
[[maybe_unused]] SyntheticJob healthy_job(int dp, int pp) {
  SyntheticJob job;
  job.meta = layout(dp, pp);
  job.microbatches = 8;
  job.steps = 6;
  job.first_step = 100;
  job.forward_s = [](int, int, int, int) { return 0.010; };
  job.backward_s = [](int, int, int, int) { return 0.020; };
  return job;
}

// Message of the InputError thrown by f, or "" when none is thrown.
template <typename F>
std::string input_error(F f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

[[maybe_unused]] OpTrace parse(const std::string& csv, const JobMeta& meta) {
  std::istringstream in(csv);
  return read_op_trace(in, "bad.csv", meta);
}

}  // namespace

TEST_CASE("sample trace: replay, ideal and attribution match the published what-if result") {
  const JobMeta meta = read_job_meta(kSampleDir + "/meta-ST.yaml");
  CHECK(meta.dp_size == 2);
  CHECK(meta.pp_size == 4);
  CHECK(meta.world_size == 8);
  REQUIRE(looks_like_op_trace(kSampleDir + "/trace-ST.csv"));
  const OpTrace trace = read_op_trace(kSampleDir + "/trace-ST.csv", meta);
  CHECK(trace.ops.size() == 6784);
  const TraceAnalysis a = analyze_trace(trace);
  MESSAGE("recorded " << a.recorded_step_s << " measured " << a.measured_step_s << " ideal "
                      << a.ideal_step_s << " slowdown " << a.slowdown << " factors "
                      << a.stage_factor << " " << a.worker_factor << " " << a.diffuse_factor);
  for (const auto& [s, v] : a.stage_slowdown) MESSAGE("stage " << s << " " << v);
  for (const auto& [s, v] : a.dp_rank_slowdown) MESSAGE("dp " << s << " " << v);
  for (const auto& [s, v] : a.rank_slowdown) MESSAGE("rank " << s << " " << v);
  for (const auto& [s, v] : a.optype_slowdown) MESSAGE("optype " << s << " " << v);
  MESSAGE("remedy " << a.remedy.kind << ": " << a.remedy.description << " -> "
                    << a.remedy.predicted_step_s);
  CHECK(a.steps == 32);
  CHECK(a.microbatches == 4);
  CHECK(a.cause == "stage-imbalance");
}
