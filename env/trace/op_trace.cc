#include "env/trace/op_trace.h"

#include <array>
#include <fstream>
#include <ostream>
#include <sstream>

#include "env/trace/csv.h"
#include "core/error.h"

namespace parapilot::trace {

namespace {

struct OpTypeName {
  OpType type;
  const char* name;
};
constexpr std::array<OpTypeName, kNumOpTypes> kOpTypeNames = {{
    {OpType::kForwardCompute, "forward-compute"},
    {OpType::kBackwardCompute, "backward-compute"},
    {OpType::kForwardSend, "forward-send"},
    {OpType::kForwardRecv, "forward-recv"},
    {OpType::kBackwardSend, "backward-send"},
    {OpType::kBackwardRecv, "backward-recv"},
    {OpType::kGradsReduceScatter, "grads-reduce-scatter"},
    {OpType::kParamsAllGather, "params-all-gather"},
    {OpType::kSeparateGradsAllReduce, "separate-grads-all-reduce"},
    {OpType::kEmbeddingGradsAllReduce, "embedding-grads-all-reduce"},
    {OpType::kLayernormGradsAllReduce, "layernorm-grads-all-reduce"},
    {OpType::kOptimizerClipMainGrad, "optimizer-clip-main-grad"},
    {OpType::kOptimizer, "optimizer"},
    {OpType::kGc, "gc"},
    {OpType::kOther, "other"},
}};

enum Column { kDpRank, kStage, kRank, kStep, kOptype, kStart, kDuration, kSeqId, kMc, kMbId, kGmc };
constexpr std::array<const char*, 11> kColumnNames = {"dp_rank", "stage",    "rank",     "step",
                                                      "optype",  "start_ts", "duration", "seq_id",
                                                      "mc",      "mb_id",    "gmc"};

constexpr int kMaxRanks = 1 << 20;

std::ifstream open_or_throw(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot open the file");
  return in;
}

}  // namespace

OpType parse_op_type(std::string_view name) {
  for (const auto& [type, n] : kOpTypeNames)
    if (type != OpType::kOther && name == n) return type;
  return OpType::kOther;
}

const char* op_type_name(OpType t) { return kOpTypeNames[static_cast<std::size_t>(t)].name; }

bool is_compute(OpType t) { return t == OpType::kForwardCompute || t == OpType::kBackwardCompute; }

bool is_communication(OpType t) {
  switch (t) {
    case OpType::kForwardSend:
    case OpType::kForwardRecv:
    case OpType::kBackwardSend:
    case OpType::kBackwardRecv:
    case OpType::kGradsReduceScatter:
    case OpType::kParamsAllGather:
    case OpType::kSeparateGradsAllReduce:
    case OpType::kEmbeddingGradsAllReduce:
    case OpType::kLayernormGradsAllReduce:
    case OpType::kOptimizerClipMainGrad:
      return true;
    default:
      return false;
  }
}

namespace {
JobMeta parse_job_meta(const std::string& path);
OpTrace parse_op_trace(std::istream& in, const std::string& source, const JobMeta& meta);
}  // namespace

StatusOr<JobMeta> read_job_meta(const std::string& path) {
  return catch_input_error([&] { return parse_job_meta(path); });
}

namespace {

JobMeta parse_job_meta(const std::string& path) {
  std::ifstream in = open_or_throw(path);
  JobMeta meta;
  bool have_dp = false, have_pp = false, have_world = false;
  bool have_tp = false, have_dsp = false, have_vpp = false;
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const std::size_t hash = line.find('#');
    if (hash != std::string::npos) line.erase(hash);
    const std::size_t colon = line.find(':');
    auto trim = [](std::string s) {
      const std::size_t b = s.find_first_not_of(" \t\"'");
      const std::size_t e = s.find_last_not_of(" \t\"'");
      return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
    };
    if (trim(line).empty()) continue;
    if (colon == std::string::npos)
      throw InputError(path + ":" + std::to_string(line_number) + ": expected 'key: value'");
    const std::string key = trim(line.substr(0, colon));
    const std::string value = trim(line.substr(colon + 1));
    auto as_positive = [&](bool& seen) {
      int v = 0;
      const auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (value.empty() || ec != std::errc() || ptr != value.data() + value.size() || v < 1 ||
          v > kMaxRanks)
        throw InputError(path + ":" + std::to_string(line_number) + ": key '" + key + "': '" +
                         value + "' is not an integer in [1, " + std::to_string(kMaxRanks) + "]");
      seen = true;
      return v;
    };
    if (key == "trial_name")
      meta.trial_name = value;
    else if (key == "dp_size")
      meta.dp_size = as_positive(have_dp);
    else if (key == "pp_size")
      meta.pp_size = as_positive(have_pp);
    else if (key == "tp_size")
      meta.tp_size = as_positive(have_tp);
    else if (key == "dsp_size")
      meta.dsp_size = as_positive(have_dsp);
    else if (key == "vpp_size")
      meta.vpp_size = as_positive(have_vpp);
    else if (key == "world_size")
      meta.world_size = as_positive(have_world);
  }
  if (!have_dp) throw InputError(path + ": missing key 'dp_size'");
  if (!have_pp) throw InputError(path + ": missing key 'pp_size'");
  const long product =
      static_cast<long>(meta.dp_size) * meta.pp_size * meta.tp_size * meta.dsp_size;
  if (product > kMaxRanks)
    throw InputError(path + ": dp_size * pp_size * tp_size * dsp_size exceeds " +
                     std::to_string(kMaxRanks) + " ranks");
  if (!have_world) meta.world_size = static_cast<int>(product);
  if (meta.world_size < meta.dp_size * meta.pp_size)
    throw InputError(path + ": world_size " + std::to_string(meta.world_size) +
                     " is smaller than dp_size * pp_size");
  return meta;
}

}  // namespace

bool looks_like_op_trace(const std::string& path) {
  std::ifstream in(path);
  std::string header;
  if (!in || !std::getline(in, header)) return false;
  for (const char* c : kColumnNames) {
    bool found = false;
    std::string_view rest(header);
    while (!found) {
      const std::size_t comma = rest.find(',');
      std::string_view f = rest.substr(0, comma);
      while (!f.empty() && (f.back() == '\r' || f.back() == ' ')) f.remove_suffix(1);
      while (!f.empty() && f.front() == ' ') f.remove_prefix(1);
      found = f == c;
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
    if (!found) return false;
  }
  return true;
}

StatusOr<OpTrace> read_op_trace(const std::string& path, const JobMeta& meta) {
  return catch_input_error([&] {
    std::ifstream in = open_or_throw(path);
    return parse_op_trace(in, path, meta);
  });
}

StatusOr<OpTrace> read_op_trace(std::istream& in, const std::string& source, const JobMeta& meta) {
  return catch_input_error([&] { return parse_op_trace(in, source, meta); });
}

namespace {

OpTrace parse_op_trace(std::istream& in, const std::string& source, const JobMeta& meta) {
  csv::LineReader reader(in, source);
  std::vector<std::string_view> fields;
  if (!reader.next(fields)) throw InputError(source + ": empty trace (no header row)");
  std::array<int, kColumnNames.size()> index{};
  index.fill(-1);
  for (std::size_t i = 0; i < fields.size(); ++i)
    for (std::size_t c = 0; c < kColumnNames.size(); ++c)
      if (fields[i] == kColumnNames[c]) index[c] = static_cast<int>(i);
  for (std::size_t c = 0; c < kColumnNames.size(); ++c)
    if (index[c] < 0)
      throw InputError(source + ":1: missing column '" + kColumnNames[c] + "' (header must name " +
                       kOpTraceColumns + ")");
  const std::size_t width = fields.size();

  OpTrace trace;
  trace.source = source;
  trace.meta = meta;
  while (reader.next(fields)) {
    if (fields.size() != width)
      throw InputError(source + ":" + std::to_string(reader.line_number()) + ": expected " +
                       std::to_string(width) + " fields, found " + std::to_string(fields.size()));
    auto field = [&](Column c) { return fields[static_cast<std::size_t>(index[c])]; };
    auto integer = [&](Column c, std::int64_t lo, std::int64_t hi, const char* what) {
      const std::int64_t v = reader.parse_int(field(c), kColumnNames[c]);
      if (v < lo || v > hi)
        reader.fail(kColumnNames[c], std::to_string(v) + " is out of range (" + what + ")");
      return v;
    };
    auto optional_integer = [&](Column c) -> std::int32_t {
      const std::string_view f = field(c);
      if (f.empty() || f == "NA" || f == "<NA>" || f == "nan" || f == "NaN") return -1;
      return static_cast<std::int32_t>(integer(c, -1, 1 << 30, "must be >= -1"));
    };
    OpRecord r;
    r.dp_rank = static_cast<std::int32_t>(
        integer(kDpRank, 0, meta.dp_size - 1, "must be in [0, dp_size) of the meta file"));
    r.stage = static_cast<std::int32_t>(
        integer(kStage, 0, meta.pp_size - 1, "must be in [0, pp_size) of the meta file"));
    r.rank = static_cast<std::int32_t>(
        integer(kRank, 0, meta.world_size - 1, "must be in [0, world_size) of the meta file"));
    r.step = integer(kStep, 0, std::int64_t{1} << 53, "must be >= 0");
    const std::string_view name = field(kOptype);
    if (name.empty()) reader.fail("optype", "empty op type");
    r.type = parse_op_type(name);
    r.start_s = reader.parse_double(field(kStart), "start_ts");
    r.duration_s = reader.parse_double(field(kDuration), "duration");
    if (r.duration_s < 0) {
      std::string why = "negative duration ";
      why.append(field(kDuration));
      reader.fail("duration", why);
    }
    r.seq_id = optional_integer(kSeqId);
    r.mc = optional_integer(kMc);
    r.mb_id = optional_integer(kMbId);
    r.gmc = optional_integer(kGmc);
    trace.ops.push_back(r);
  }
  if (trace.ops.empty()) throw InputError(source + ": empty trace (header but no rows)");
  return trace;
}

}  // namespace

void write_op_trace(const OpTrace& trace, std::ostream& out) {
  out << kOpTraceColumns << '\n';
  std::ostringstream line;
  line.precision(17);
  for (const OpRecord& r : trace.ops) {
    line.str("");
    line << r.dp_rank << ',' << r.stage << ',' << r.rank << ',' << r.step << ','
         << op_type_name(r.type) << ',' << r.start_s << ',' << r.duration_s << ',' << r.seq_id
         << ',' << r.mc << ',' << r.mb_id << ',' << r.gmc << '\n';
    out << line.str();
  }
}

}  // namespace parapilot::trace
