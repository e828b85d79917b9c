// Trace import, replay and what-if analysis (env/trace).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>

#include <unistd.h>

#include "env/trace/op_trace.h"
#include "env/trace/replay.h"
#include "env/trace/telemetry.h"
#include "env/trace/trace_analysis.h"
#include "core/error.h"
#include "tests/test_util.h"

using namespace parapilot;
using namespace parapilot::trace;
using parapilot::testing::ok;

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
SyntheticJob healthy_job(int dp, int pp) {
  SyntheticJob job;
  job.meta = layout(dp, pp);
  job.microbatches = 8;
  job.steps = 6;
  job.first_step = 100;
  job.forward_s = [](int, int, int, int) { return 0.010; };
  job.backward_s = [](int, int, int, int) { return 0.020; };
  return job;
}

StatusOr<OpTrace> parse(const std::string& csv, const JobMeta& meta) {
  std::istringstream in(csv);
  return read_op_trace(in, "bad.csv", meta);
}

// The message of a reader's failure, or "" when it succeeded.
template <class T>
std::string error_in(const StatusOr<T>& result) {
  return result.ok() ? "" : result.status().message();
}

// Deterministic uniform numbers in [0, 1) (std distributions differ between libraries).
double uniform(std::mt19937& gen) { return static_cast<double>(gen()) / 4294967296.0; }

// A file in a per-process temporary directory holding `text`; returns its path.
std::string temp_file(const std::string& name, const std::string& text) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("parapilot-trace-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / name;
  std::ofstream(path) << text;
  return path.string();
}

const std::string kHeader =
    "dp_rank,stage,rank,step,optype,start_ts,duration,seq_id,mc,mb_id,gmc\n";

}  // namespace

TEST_CASE("sample trace: replayed, ideal and attributed step times match the published what-if") {
  // Reference: tests/data/traces/bytedance-ST/whatif-result-ST.json (mean step_t_nodelay 2.1727,
  // step_t_noblk 1.8433, blocking_slowdown 1.1787, by stage 0.998/0.983/0.982/1.232, by dp rank
  // 1.1731/1.1779). Tolerance: 0.5% on step times, 0.01 on slowdowns.
  const JobMeta meta = ok(read_job_meta(kSampleDir + "/meta-ST.yaml"));
  CHECK(meta.dp_size == 2);
  CHECK(meta.pp_size == 4);
  CHECK(meta.world_size == 8);
  REQUIRE(looks_like_op_trace(kSampleDir + "/trace-ST.csv"));
  CHECK_FALSE(looks_like_telemetry(kSampleDir + "/trace-ST.csv"));
  const OpTrace trace = ok(read_op_trace(kSampleDir + "/trace-ST.csv", meta));
  CHECK(trace.ops.size() == 6784);
  const TraceAnalysis a = ok(analyze_trace(trace));
  CHECK(a.steps == 32);
  CHECK(a.microbatches == 4);
  CHECK(a.recorded_step_s == doctest::Approx(2.2145).epsilon(0.005));
  CHECK(a.measured_step_s == doctest::Approx(2.1727).epsilon(0.005));
  CHECK(a.ideal_step_s == doctest::Approx(1.8433).epsilon(0.005));
  CHECK(a.slowdown == doctest::Approx(1.1787).epsilon(0.01));
  // The replay without launch gaps stays close to the recorded wall time.
  CHECK(a.measured_step_s <= a.recorded_step_s);
  CHECK(a.measured_step_s >= 0.97 * a.recorded_step_s);
  REQUIRE(a.stage_slowdown.size() == 4);
  CHECK(a.stage_slowdown.at(0) == doctest::Approx(0.998).epsilon(0.01));
  CHECK(a.stage_slowdown.at(1) == doctest::Approx(0.983).epsilon(0.01));
  CHECK(a.stage_slowdown.at(2) == doctest::Approx(0.982).epsilon(0.01));
  CHECK(a.stage_slowdown.at(3) == doctest::Approx(1.232).epsilon(0.01));
  CHECK(a.dp_rank_slowdown.at(0) == doctest::Approx(1.1731).epsilon(0.01));
  CHECK(a.dp_rank_slowdown.at(1) == doctest::Approx(1.1779).epsilon(0.01));
  CHECK(a.optype_slowdown.at("forward-compute") == doctest::Approx(1.0875).epsilon(0.01));
  CHECK(a.optype_slowdown.at("backward-compute") == doctest::Approx(1.0742).epsilon(0.01));

  CHECK(a.cause == "stage-imbalance");
  REQUIRE(a.stragglers.size() == 2);
  for (const Straggler& s : a.stragglers) {
    CHECK(s.stage == 3);
    CHECK(s.slowdown > 1.15);
  }
  // The last stage's forward + backward per microbatch is ~1.6x the others'.
  CHECK(a.stage_compute_s[3] > 1.5 * a.stage_compute_s[0]);

  CHECK(a.remedy.kind == "repartition-stages");
  CHECK(a.remedy.layers_assumed);
  REQUIRE(a.remedy.proposed_layers.size() == 4);
  CHECK(a.remedy.proposed_layers[3] < kAssumedLayersPerStage);
  CHECK(a.remedy.predicted_step_s < a.measured_step_s);
  CHECK(a.remedy.predicted_step_s > a.ideal_step_s * 0.9);

  AnalysisOptions with_layers;
  with_layers.layers = 30;
  const TraceAnalysis b = ok(analyze_trace(trace, with_layers));
  CHECK_FALSE(b.remedy.layers_assumed);
  CHECK(b.remedy.current_layers == std::vector<int>{8, 8, 7, 7});
  int total = 0;
  for (int l : b.remedy.proposed_layers) total += l;
  CHECK(total == 30);
}

TEST_CASE("replay of a synthetic trace reproduces its step times; a healthy job has no cause") {
  const OpTrace trace = synthesize_op_trace(healthy_job(2, 4));
  const ReplayGraph graph = ok(ReplayGraph::build(trace));
  CHECK(graph.num_steps() == 6);
  const std::vector<double> replayed = graph.replay(graph.measured());
  for (int s = 0; s < graph.num_steps(); ++s)
    CHECK(replayed[static_cast<std::size_t>(s)] ==
          doctest::Approx(graph.recorded_step_s()[static_cast<std::size_t>(s)]).epsilon(1e-9));
  // 1F1B: (m - 1 + pp) * (f + b) plus the all-gather, p2p, reduce-scatter, clip and optimizer.
  CHECK(replayed[0] > (8 - 1 + 4) * 0.030);
  CHECK(replayed[0] < (8 - 1 + 4) * 0.030 + 0.2);

  const TraceAnalysis a = ok(analyze_trace(trace));
  CHECK(a.slowdown == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(a.cause == "none");
  CHECK(a.stragglers.empty());
  CHECK(a.remedy.kind == "none");
  CHECK(a.microbatches == 8);
}

TEST_CASE("one slow worker: cause worker, that rank flagged, its replica gets fewer microbatches") {
  SyntheticJob job = healthy_job(4, 2);
  std::mt19937 gen(7);
  std::vector<double> noise(10000);
  for (double& x : noise) x = 0.97 + 0.06 * uniform(gen);
  // dp_rank 1 of stage 1 (rank 1 * 4 + 1 = 5) computes 2.5x slower.
  auto slow = [noise](double base) {
    return [noise, base](int step, int dp, int stage, int mb) {
      const double f = noise[static_cast<std::size_t>(((step * 4 + dp) * 2 + stage) * 8 + mb)];
      return base * f * (dp == 1 && stage == 1 ? 2.5 : 1.0);
    };
  };
  job.forward_s = slow(0.010);
  job.backward_s = slow(0.020);
  const OpTrace trace = synthesize_op_trace(job);
  const TraceAnalysis a = ok(analyze_trace(trace));
  MESSAGE("slowdown " << a.slowdown << " factors " << a.stage_factor << " " << a.worker_factor
                      << " " << a.diffuse_factor);
  CHECK(a.slowdown > 1.5);
  CHECK(a.cause == "worker");
  REQUIRE(a.stragglers.size() == 1);
  CHECK(a.stragglers[0].rank == 5);
  CHECK(a.stragglers[0].dp_rank == 1);
  CHECK(a.stragglers[0].stage == 1);
  CHECK(a.stragglers[0].compute_ratio == doctest::Approx(2.5).epsilon(0.05));
  CHECK(a.remedy.kind == "rebalance-dp-shares");
  REQUIRE(a.remedy.proposed_microbatches.size() == 4);
  int total = 0;
  for (int m : a.remedy.proposed_microbatches) total += m;
  CHECK(total == 32);
  CHECK(a.remedy.proposed_microbatches[1] < 8);
  CHECK(a.remedy.replica_speed[1] == doctest::Approx(0.4).epsilon(0.05));
  CHECK(a.remedy.predicted_step_s < 0.85 * a.measured_step_s);

  // The replayed conditions: rank 5 runs at ~0.4 of its stage's typical speed.
  const std::vector<ConditionsInterval> intervals = recorded_conditions(trace, 4);
  REQUIRE(intervals.size() == 2);  // 6 steps in intervals of 4: 4 + 2
  CHECK(intervals[0].first_step == 100);
  CHECK(intervals[0].last_step == 103);
  CHECK(intervals[1].first_step == 104);
  CHECK(intervals[1].last_step == 105);
  CHECK(intervals[0].start_s == 0.0);
  CHECK(intervals[1].start_s > 0.0);
  CHECK(intervals[0].duration_s == doctest::Approx(intervals[1].start_s));
  for (const ConditionsInterval& c : intervals) {
    REQUIRE(c.conditions.gpu_speed.size() == 8);
    for (int g = 0; g < 8; ++g)
      CHECK(c.conditions.speed(g) == doctest::Approx(g == 5 ? 0.4 : 1.0).epsilon(0.06));
  }
}

TEST_CASE("a worker that turns slow mid-trace shows in the later intervals only") {
  SyntheticJob job = healthy_job(2, 2);
  job.forward_s = [](int step, int dp, int stage, int) {
    return (step >= 3 && dp == 0 && stage == 0) ? 0.02 : 0.01;
  };
  const std::vector<ConditionsInterval> intervals = recorded_conditions(synthesize_op_trace(job));
  REQUIRE(intervals.size() == 6);
  // Stage typical = its faster worker; rank 0's forward doubles, backward stays: speed 30/40.
  CHECK(intervals[0].conditions.speed(0) == doctest::Approx(1.0));
  CHECK(intervals[5].conditions.speed(0) == doctest::Approx(0.75).epsilon(0.01));
  CHECK(intervals[5].conditions.speed(1) == doctest::Approx(1.0));
}

TEST_CASE("uniformly noisy compute over all workers: cause diffuse, no stragglers, no remedy") {
  SyntheticJob job = healthy_job(4, 2);
  job.steps = 8;
  std::mt19937 gen(11);
  std::vector<double> noise(20000);
  for (double& x : noise) x = 0.5 + 1.5 * uniform(gen) * uniform(gen) * 2;  // mean ~1.25
  auto noisy = [noise](double base) {
    return [noise, base](int step, int dp, int stage, int mb) {
      return base * noise[static_cast<std::size_t>(((step * 4 + dp) * 2 + stage) * 8 + mb)];
    };
  };
  job.forward_s = noisy(0.010);
  job.backward_s = noisy(0.020);
  const TraceAnalysis a = ok(analyze_trace(synthesize_op_trace(job)));
  MESSAGE("slowdown " << a.slowdown << " factors " << a.stage_factor << " " << a.worker_factor
                      << " " << a.diffuse_factor);
  CHECK(a.slowdown > 1.1);
  CHECK(a.cause == "diffuse");
  CHECK(a.stragglers.empty());
  CHECK(a.remedy.kind == "none");
  CHECK(a.remedy.predicted_step_s == doctest::Approx(a.measured_step_s));
  CHECK(a.diffuse_factor > a.stage_factor);
  CHECK(a.diffuse_factor > a.worker_factor);
}

TEST_CASE(
    "a synthetic last stage with twice the forward compute: stage-imbalance and new boundaries") {
  SyntheticJob job = healthy_job(2, 4);
  job.forward_s = [](int, int, int stage, int) { return stage == 3 ? 0.020 : 0.010; };
  const OpTrace trace = synthesize_op_trace(job);
  AnalysisOptions options;
  options.layers = 32;
  const TraceAnalysis a = ok(analyze_trace(trace, options));
  CHECK(a.cause == "stage-imbalance");
  REQUIRE(a.stragglers.size() == 2);
  CHECK(a.stragglers[0].stage == 3);
  CHECK(a.stragglers[1].stage == 3);
  CHECK(a.stage_slowdown.at(3) > a.stage_slowdown.at(0));
  CHECK(a.remedy.kind == "repartition-stages");
  // Per-layer cost 40/8 = 5 ms on stage 3, 30/8 = 3.75 ms elsewhere: the best split of the
  // 32 layers puts fewer on the last stage.
  REQUIRE(a.remedy.proposed_layers.size() == 4);
  CHECK(a.remedy.proposed_layers[3] < 8);
  const double worst_after =
      *std::max_element(a.remedy.proposed_stage_s.begin(), a.remedy.proposed_stage_s.end());
  CHECK(worst_after < 0.040);
  CHECK(worst_after >= (3 * 0.030 + 0.040) / 4 - 1e-12);
  CHECK(a.remedy.predicted_step_s < a.measured_step_s);
}

TEST_CASE("malformed per-op traces are rejected with file, line and column") {
  const JobMeta meta = layout(2, 4);
  const std::string ok_row = "0,0,0,1,forward-compute,0.5,0.1,0,0,0,0\n";
  CHECK(error_in(parse(kHeader + ok_row, meta)).empty());

  std::string e = error_in(parse("dp_rank,stage,rank,step,optype,start_ts,seq_id,mc,mb_id,gmc\n", meta));
  CHECK(e.find("bad.csv:1") != std::string::npos);
  CHECK(e.find("missing column 'duration'") != std::string::npos);

  e = error_in(parse(kHeader + ok_row + "0,0,0,1,forward-compute,abc,0.1,1,0,1,0\n", meta));
  CHECK(e.find("bad.csv:3: column 'start_ts'") != std::string::npos);
  CHECK(e.find("not a number") != std::string::npos);

  e = error_in(parse(kHeader + "0,0,0,1,forward-compute,0.5,-0.1,0,0,0,0\n", meta));
  CHECK(e.find("bad.csv:2: column 'duration'") != std::string::npos);
  CHECK(e.find("negative") != std::string::npos);

  e = error_in(parse(kHeader + "0,0,0,1,forward-compute,0.5,nan,0,0,0,0\n", meta));
  CHECK(e.find("bad.csv:2: column 'duration'") != std::string::npos);

  e = error_in(parse(kHeader + "0,0,0,1,forward-compute,inf,0.1,0,0,0,0\n", meta));
  CHECK(e.find("bad.csv:2: column 'start_ts'") != std::string::npos);

  e = error_in(parse(kHeader + "5,0,0,1,forward-compute,0.5,0.1,0,0,0,0\n", meta));
  CHECK(e.find("bad.csv:2: column 'dp_rank'") != std::string::npos);

  e = error_in(parse(kHeader + "0,0,0,1.5,forward-compute,0.5,0.1,0,0,0,0\n", meta));
  CHECK(e.find("bad.csv:2: column 'step'") != std::string::npos);

  e = error_in(parse(kHeader + "0,0,0,1,forward-compute,0.5\n", meta));
  CHECK(e.find("bad.csv:2: expected 11 fields") != std::string::npos);

  e = error_in(parse(kHeader, meta));
  CHECK(e.find("empty trace") != std::string::npos);
  e = error_in(parse("", meta));
  CHECK(e.find("empty trace") != std::string::npos);

  e = error_in(read_op_trace("/nonexistent/trace.csv", meta));
  CHECK(e.find("/nonexistent/trace.csv: cannot open") != std::string::npos);

  // Unknown op types and pandas-style float integers are accepted.
  const OpTrace t = ok(parse(kHeader + "0,0,0,1,weird-op,0.5,0.1,0.0,,,\n" + ok_row, meta));
  CHECK(t.ops[0].type == OpType::kOther);
  CHECK(t.ops[0].mc == -1);
}

TEST_CASE("meta files: required keys and integer values") {
  std::string e = error_in(read_job_meta(temp_file("m1.yaml", "dp_size: 2\n")));
  CHECK(e.find("missing key 'pp_size'") != std::string::npos);
  e = error_in(read_job_meta(temp_file("m2.yaml", "pp_size: 2\ndp_size: two\n")));
  CHECK(e.find("m2.yaml:2: key 'dp_size'") != std::string::npos);
  e = error_in(read_job_meta(temp_file("m3.yaml", "pp_size: 2\ndp_size: 0\n")));
  CHECK(e.find("m3.yaml:2") != std::string::npos);
  e = error_in(read_job_meta(temp_file("m4.yaml", "just text\n")));
  CHECK(e.find("m4.yaml:1") != std::string::npos);
  const JobMeta m = ok(read_job_meta(
      temp_file("m5.yaml", "# comment\ntrial_name: X\ndp_size: 3\npp_size: 2\ntp_size: 2\n")));
  CHECK(m.trial_name == "X");
  CHECK(m.world_size == 12);
}

TEST_CASE("telemetry recordings round-trip and reject bad rows") {
  std::vector<TelemetrySample> samples;
  for (int step = 0; step < 3; ++step)
    for (int rank = 0; rank < 4; ++rank) {
      TelemetrySample s;
      s.rank = rank;
      s.dp_rank = rank % 2;
      s.stage = rank / 2;
      s.step = 1000 + step;
      s.start_s = 1.0 / 3.0 + step * 0.123456789012345;
      s.end_s = s.start_s + 0.1 + 1e-17 * rank;
      s.microbatches = 4;
      s.compute_ms = 80.125 + rank;
      s.dp_comm = {12.5, 1.5e9};
      s.pp_comm = {0.3, 4194304};
      s.tp_comm = {1e-300, 0};
      samples.push_back(s);
    }
  std::ostringstream out;
  write_telemetry(samples, out);
  std::istringstream in(out.str());
  const TelemetryTrace back = ok(read_telemetry(in, "t.csv"));
  CHECK(back.samples == samples);
  const std::string path = temp_file("telemetry.csv", out.str());
  CHECK(looks_like_telemetry(path));
  CHECK_FALSE(looks_like_op_trace(path));
  CHECK(ok(read_telemetry(path)).samples == samples);

  const std::string header = std::string(kTelemetryColumns) + "\n";
  auto bad = [&](const std::string& text) {
    std::istringstream s(text);
    return error_in(read_telemetry(s, "t.csv"));
  };
  CHECK(bad(header + "0,0,0,1,2.0,1.0,4,80,0,0,0,0,0,0\n").find("t.csv:2: column 'end_s'") !=
        std::string::npos);
  CHECK(bad(header + "0,0,0,1,1.0,2.0,4,-80,0,0,0,0,0,0\n").find("t.csv:2: column 'compute_ms'") !=
        std::string::npos);
  CHECK(bad(header + "0,0,0,1,1.0,2.0,-1,80,0,0,0,0,0,0\n").find("column 'microbatches'") !=
        std::string::npos);
  // A rank that elastic data parallelism gave a zero share ran no microbatch in the step.
  std::istringstream idle(header + "0,0,0,1,1.0,2.0,0,0,5,0,0,0,0,0\n");
  CHECK(ok(read_telemetry(idle, "t.csv")).samples.front().microbatches == 0);
  CHECK(bad(header + "0,0,0,1,1.0,2.0,4,80,x,0,0,0,0,0\n").find("column 'dp_comm_ms'") !=
        std::string::npos);
  CHECK(bad("rank,step\n").find("t.csv:1") != std::string::npos);
  CHECK(bad(header).find("empty telemetry") != std::string::npos);
}

TEST_CASE("telemetry of a job with one slow rank: analysed through the 1F1B model") {
  std::vector<TelemetrySample> samples;
  for (int step = 0; step < 4; ++step)
    for (int dp = 0; dp < 4; ++dp)
      for (int stage = 0; stage < 2; ++stage) {
        TelemetrySample s;
        s.rank = dp * 2 + stage;  // rank numbering differs from the synthetic default
        s.dp_rank = dp;
        s.stage = stage;
        s.step = step;
        s.start_s = step * 1.0;
        s.end_s = s.start_s + 0.5;
        s.microbatches = 8;
        s.compute_ms = (dp == 2 && stage == 0) ? 600 : 240;
        s.dp_comm = {20, 1e8};
        s.pp_comm = {16, 1e7};
        samples.push_back(s);
      }
  TelemetryTrace t{"t.csv", samples};
  const JobMeta meta = telemetry_layout(t);
  CHECK(meta.dp_size == 4);
  CHECK(meta.pp_size == 2);
  const TraceAnalysis a = ok(analyze_trace(ok(telemetry_to_op_trace(t, meta))));
  CHECK(a.cause == "worker");
  REQUIRE_FALSE(a.stragglers.empty());
  CHECK(a.stragglers[0].rank == 4);
  CHECK(a.stragglers[0].dp_rank == 2);
  CHECK(a.remedy.kind == "rebalance-dp-shares");

  t.samples.pop_back();
  CHECK(error_in(telemetry_to_op_trace(t, meta)).find("one sample per") != std::string::npos);
}

TEST_CASE("gradient reduce-scatters overlapped with the backward passes are replayed in place") {
  OpTrace trace = synthesize_op_trace(healthy_job(2, 2));
  // Move each worker's reduce-scatter to start right after its second-to-last backward.
  int moved = 0;
  for (OpRecord& rs : trace.ops) {
    if (rs.type != OpType::kGradsReduceScatter) continue;
    ++moved;
    double second_last = 0, last = 0;
    for (const OpRecord& r : trace.ops)
      if (r.step == rs.step && r.rank == rs.rank && r.type == OpType::kBackwardCompute &&
          r.end_s() > last) {
        second_last = last;
        last = r.end_s();
      }
    rs.start_s = second_last;
    rs.duration_s = 0.01;
  }
  REQUIRE(moved > 0);
  // Replayed in place, the 10 ms reduce-scatter hides under the last backward: the steps take
  // as long as with a reduce-scatter of no duration. Serialised after the backward, they would
  // take 10 ms longer.
  OpTrace instant = trace;
  for (OpRecord& rs : instant.ops)
    if (rs.type == OpType::kGradsReduceScatter) rs.duration_s = 1e-9;
  const ReplayGraph graph = ok(ReplayGraph::build(trace));
  const ReplayGraph hidden = ok(ReplayGraph::build(instant));
  const std::vector<double> replayed = graph.replay(graph.measured());
  const std::vector<double> without = hidden.replay(hidden.measured());
  REQUIRE(replayed.size() == without.size());
  for (std::size_t s = 0; s < replayed.size(); ++s)
    CHECK(replayed[s] == doctest::Approx(without[s]).epsilon(1e-6));
  const TraceAnalysis a = ok(analyze_trace(trace));
  CHECK(a.measured_step_s > 0);
  CHECK(a.measured_step_s <= a.recorded_step_s + 1e-9);
  CHECK(std::isfinite(a.slowdown));
}

TEST_CASE("intermittent slow worker vs per-step imbalance spread over all workers") {
  SyntheticJob job = healthy_job(8, 2);
  job.steps = 12;
  std::mt19937 gen(3);
  std::vector<double> per_worker_step(12 * 8 * 2);
  for (double& x : per_worker_step) x = 0.6 + 0.9 * uniform(gen);

  SUBCASE("one worker 3x slower in every third step: worker") {
    auto f = [](double base) {
      return [base](int step, int dp, int stage, int) {
        return base * ((dp == 2 && stage == 0 && step % 3 == 0) ? 3.0 : 1.0);
      };
    };
    job.forward_s = f(0.010);
    job.backward_s = f(0.020);
    const TraceAnalysis a = ok(analyze_trace(synthesize_op_trace(job)));
    CHECK(a.cause == "worker");
    REQUIRE(a.stragglers.size() == 1);
    CHECK(a.stragglers[0].rank == 2);
  }
  SUBCASE("each worker's load varies from step to step (uneven sequence lengths): diffuse") {
    auto f = [per_worker_step](double base) {
      return [per_worker_step, base](int step, int dp, int stage, int) {
        return base * per_worker_step[static_cast<std::size_t>((step * 8 + dp) * 2 + stage)];
      };
    };
    job.forward_s = f(0.010);
    job.backward_s = f(0.020);
    const TraceAnalysis a = ok(analyze_trace(synthesize_op_trace(job)));
    MESSAGE("slowdown " << a.slowdown << " factors " << a.stage_factor << " " << a.worker_factor
                        << " " << a.diffuse_factor);
    CHECK(a.slowdown > 1.1);
    CHECK(a.cause == "diffuse");
    CHECK(a.stragglers.empty());
  }
}

TEST_CASE("telemetry: mean recorded step time spans all ranks of a step") {
  TelemetryTrace t;
  t.samples.push_back({0, 0, 0, 5, 1.0, 1.5, 1, 100, {}, {}, {}});
  t.samples.push_back({1, 1, 0, 5, 1.1, 1.7, 1, 100, {}, {}, {}});
  t.samples.push_back({0, 0, 0, 6, 2.0, 2.4, 1, 100, {}, {}, {}});
  CHECK(mean_recorded_step_s(t) == doctest::Approx((0.7 + 0.4) / 2));
}
