#include "env/trace/telemetry.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <map>
#include <ostream>
#include <sstream>

#include "env/trace/csv.h"
#include "env/trace/replay.h"
#include "core/error.h"

namespace parapilot::trace {

namespace {

constexpr std::array<const char*, 14> kColumns = {
    "rank",       "dp_rank",       "stage",      "step",         "start_s",
    "end_s",      "microbatches",  "compute_ms", "dp_comm_ms",   "dp_comm_bytes",
    "pp_comm_ms", "pp_comm_bytes", "tp_comm_ms", "tp_comm_bytes"};

}  // namespace

void write_telemetry(const std::vector<TelemetrySample>& samples, std::ostream& out) {
  out << kTelemetryColumns << '\n';
  std::ostringstream line;
  line.precision(17);
  for (const TelemetrySample& s : samples) {
    line.str("");
    line << s.rank << ',' << s.dp_rank << ',' << s.stage << ',' << s.step << ',' << s.start_s << ','
         << s.end_s << ',' << s.microbatches << ',' << s.compute_ms << ',' << s.dp_comm.ms << ','
         << s.dp_comm.bytes << ',' << s.pp_comm.ms << ',' << s.pp_comm.bytes << ',' << s.tp_comm.ms
         << ',' << s.tp_comm.bytes << '\n';
    out << line.str();
  }
}

bool looks_like_telemetry(const std::string& path) {
  std::ifstream in(path);
  std::string header;
  if (!in || !std::getline(in, header)) return false;
  if (!header.empty() && header.back() == '\r') header.pop_back();
  return header == kTelemetryColumns;
}

namespace {
TelemetryTrace parse_telemetry(std::istream& in, const std::string& source);
}  // namespace

StatusOr<TelemetryTrace> read_telemetry(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::not_found(path + ": cannot open the file");
  return read_telemetry(in, path);
}

StatusOr<TelemetryTrace> read_telemetry(std::istream& in, const std::string& source) {
  return catch_input_error([&] { return parse_telemetry(in, source); });
}

namespace {

TelemetryTrace parse_telemetry(std::istream& in, const std::string& source) {
  csv::LineReader reader(in, source);
  std::vector<std::string_view> f;
  if (!reader.next(f)) throw InputError(source + ": empty telemetry (no header row)");
  if (f.size() != kColumns.size())
    throw InputError(source + ":1: expected the header " + std::string(kTelemetryColumns));
  for (std::size_t c = 0; c < kColumns.size(); ++c)
    if (f[c] != kColumns[c])
      throw InputError(source + ":1: column " + std::to_string(c + 1) + " must be '" + kColumns[c] +
                       "', found '" + std::string(f[c]) + "'");
  TelemetryTrace t;
  t.source = source;
  while (reader.next(f)) {
    if (f.size() != kColumns.size())
      throw InputError(source + ":" + std::to_string(reader.line_number()) + ": expected " +
                       std::to_string(kColumns.size()) + " fields, found " +
                       std::to_string(f.size()));
    auto integer = [&](std::size_t c, std::int64_t lo) {
      const std::int64_t v = reader.parse_int(f[c], kColumns[c]);
      // Ranks, stages and microbatch counts stay below 2^20; steps below 2^40.
      if (v < lo || v > (std::int64_t{1} << (c == 3 ? 40 : 20)))
        reader.fail(kColumns[c],
                    std::to_string(v) + " is out of range (must be >= " + std::to_string(lo) + ")");
      return v;
    };
    auto non_negative = [&](std::size_t c) {
      const double v = reader.parse_double(f[c], kColumns[c]);
      if (v < 0) reader.fail(kColumns[c], "negative value " + std::string(f[c]));
      return v;
    };
    TelemetrySample s;
    s.rank = static_cast<int>(integer(0, 0));
    s.dp_rank = static_cast<int>(integer(1, 0));
    s.stage = static_cast<int>(integer(2, 0));
    s.step = integer(3, 0);
    s.start_s = reader.parse_double(f[4], kColumns[4]);
    s.end_s = reader.parse_double(f[5], kColumns[5]);
    if (s.end_s < s.start_s) reader.fail("end_s", "ends before start_s");
    s.microbatches = static_cast<int>(integer(6, 0));  // 0: a rank given a zero share
    s.compute_ms = non_negative(7);
    s.dp_comm = {non_negative(8), non_negative(9)};
    s.pp_comm = {non_negative(10), non_negative(11)};
    s.tp_comm = {non_negative(12), non_negative(13)};
    t.samples.push_back(s);
  }
  if (t.samples.empty()) throw InputError(source + ": empty telemetry (header but no rows)");
  return t;
}

}  // namespace

JobMeta telemetry_layout(const TelemetryTrace& t) {
  JobMeta meta;
  meta.trial_name = t.source;
  meta.dp_size = meta.pp_size = meta.world_size = 0;
  for (const TelemetrySample& s : t.samples) {
    meta.dp_size = std::max(meta.dp_size, s.dp_rank + 1);
    meta.pp_size = std::max(meta.pp_size, s.stage + 1);
    meta.world_size = std::max(meta.world_size, s.rank + 1);
  }
  return meta;
}

double mean_recorded_step_s(const TelemetryTrace& t) {
  std::map<std::int64_t, std::pair<double, double>> span;
  for (const TelemetrySample& s : t.samples) {
    auto [it, inserted] = span.try_emplace(s.step, s.start_s, s.end_s);
    if (!inserted) {
      it->second.first = std::min(it->second.first, s.start_s);
      it->second.second = std::max(it->second.second, s.end_s);
    }
  }
  double sum = 0;
  for (const auto& [step, se] : span) sum += se.second - se.first;
  return span.empty() ? 0.0 : sum / static_cast<double>(span.size());
}

namespace {
OpTrace to_op_trace_or_throw(const TelemetryTrace& t, const JobMeta& meta);
}  // namespace

StatusOr<OpTrace> telemetry_to_op_trace(const TelemetryTrace& t, const JobMeta& meta) {
  return catch_input_error([&] { return to_op_trace_or_throw(t, meta); });
}

namespace {

// A recording whose layout changes part way (a run that switched) holds several layouts; a trace
// replays one. Throws naming the first step from which the (dp, pp) extent of the samples
// differs from the steps before and stays so (a step merely missing a sample is not a change).
void require_one_layout(const TelemetryTrace& t) {
  std::map<std::int64_t, std::pair<int, int>> extent;  // step -> (dp, pp)
  for (const TelemetrySample& s : t.samples) {
    auto& [dp, pp] = extent[s.step];
    dp = std::max(dp, s.dp_rank + 1);
    pp = std::max(pp, s.stage + 1);
  }
  for (auto it = std::next(extent.begin()); it != extent.end(); ++it) {
    const auto& before = std::prev(it)->second;
    if (it->second == before) continue;
    const auto after = std::next(it);
    if (after != extent.end() && after->second != it->second) continue;
    throw InputError(t.source + ": the layout changes at step " + std::to_string(it->first) +
                     " (dp=" + std::to_string(before.first) + " pp=" +
                     std::to_string(before.second) + " before, dp=" +
                     std::to_string(it->second.first) + " pp=" +
                     std::to_string(it->second.second) +
                     " from there); a trace holds one layout: cut the file at that step, or "
                     "record an episode that keeps its layout");
  }
}

OpTrace to_op_trace_or_throw(const TelemetryTrace& t, const JobMeta& meta) {
  require_one_layout(t);
  std::vector<std::int64_t> steps;
  for (const TelemetrySample& s : t.samples) steps.push_back(s.step);
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  const int dp = meta.dp_size, pp = meta.pp_size;
  if (static_cast<std::int64_t>(dp) * pp > static_cast<std::int64_t>(t.samples.size()))
    throw InputError(
        t.source + ": every step needs one sample per (dp_rank, stage); the layout dp=" +
        std::to_string(dp) + " pp=" + std::to_string(pp) + " has more ranks than samples");
  std::map<std::tuple<std::size_t, int, int>, const TelemetrySample*> at;
  std::vector<int> rank_of(static_cast<std::size_t>(dp * pp), -1);
  int microbatches = 1;
  double pp_ms = 0, dp_ms = 0;
  for (const TelemetrySample& s : t.samples) {
    if (s.dp_rank >= dp || s.stage >= pp)
      throw InputError(t.source + ": rank " + std::to_string(s.rank) +
                       " lies outside the layout dp=" + std::to_string(dp) +
                       " pp=" + std::to_string(pp));
    const auto si = static_cast<std::size_t>(std::lower_bound(steps.begin(), steps.end(), s.step) -
                                             steps.begin());
    if (!at.emplace(std::tuple{si, s.dp_rank, s.stage}, &s).second)
      throw InputError(t.source + ": step " + std::to_string(s.step) +
                       " has two samples for dp_rank " + std::to_string(s.dp_rank) + ", stage " +
                       std::to_string(s.stage));
    rank_of[static_cast<std::size_t>(s.stage * dp + s.dp_rank)] = s.rank;
    microbatches = std::max(microbatches, s.microbatches);
    pp_ms = std::max(pp_ms, s.pp_comm.ms / std::max(1, 2 * s.microbatches));
    dp_ms = std::max(dp_ms, s.dp_comm.ms);
  }
  if (at.size() != steps.size() * static_cast<std::size_t>(dp * pp))
    throw InputError(t.source + ": every step needs one sample per (dp_rank, stage); found " +
                     std::to_string(at.size()) + " samples for " + std::to_string(steps.size()) +
                     " steps of " + std::to_string(dp * pp) + " ranks");
  SyntheticJob job;
  job.meta = meta;
  job.meta.world_size = std::max(meta.world_size, dp * pp);
  job.microbatches = microbatches;
  job.steps = static_cast<int>(steps.size());
  job.first_step = 0;
  auto per_mb = [&](int step, int d, int stage) {
    const TelemetrySample& s = *at.at(std::tuple{static_cast<std::size_t>(step), d, stage});
    return (s.compute_ms + s.tp_comm.ms) / 1000.0 / std::max(1, s.microbatches);
  };
  job.forward_s = [&](int step, int d, int stage, int) { return per_mb(step, d, stage) / 3; };
  job.backward_s = [&](int step, int d, int stage, int) { return 2 * per_mb(step, d, stage) / 3; };
  job.p2p_s = pp_ms / 1000.0;
  job.grads_reduce_scatter_s = dp_ms / 1000.0;
  job.params_all_gather_s = 0;
  job.embedding_all_reduce_s = 0;
  job.clip_s = 0;
  job.optimizer_s = 0;
  OpTrace out = synthesize_op_trace(job);
  out.source = t.source;
  out.meta = meta;
  out.meta.world_size = job.meta.world_size;
  for (const TelemetrySample& s : t.samples)
    out.meta.world_size = std::max(out.meta.world_size, s.rank + 1);
  for (OpRecord& r : out.ops) {
    r.step = steps[static_cast<std::size_t>(r.step)];
    const int rank = rank_of[static_cast<std::size_t>(r.stage * dp + r.dp_rank)];
    if (rank >= 0) r.rank = rank;
  }
  return out;
}

}  // namespace

}  // namespace parapilot::trace
