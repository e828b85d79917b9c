#include "strategy/published_runs.h"

#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "strategy/spec_io.h"

namespace parapilot {

namespace {

// One data line: its cells by column name, and where it is for messages.
struct Line {
  std::map<std::string, std::string> cells;
  std::string where;  // "file:line"

  const std::string& text(const std::string& column) const {
    auto it = cells.find(column);
    if (it == cells.end() || it->second.empty())
      throw InputError(where + ": column '" + column + "' is missing or empty");
    return it->second;
  }
  // The whole cell parsed by `parse` (std::stoi or std::stod), or an error saying `expected`.
  template <typename T, typename Parse>
  T parsed(const std::string& column, Parse parse, bool positive, const char* expected) const {
    const std::string& v = text(column);
    size_t used = 0;
    T out{};
    try {
      out = parse(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.size() || (positive && !(out > 0)))
      throw InputError(where + ": " + column + ": not " + expected + ": " + v);
    return out;
  }
  int integer(const std::string& column) const {
    return parsed<int>(
        column, [](const std::string& v, size_t* used) { return std::stoi(v, used); }, false,
        "an integer");
  }
  double number(const std::string& column) const {
    return parsed<double>(
        column, [](const std::string& v, size_t* used) { return std::stod(v, used); }, true,
        "a positive number");
  }
};

// Comma-separated lines after a header; '#' lines are comments.
std::vector<Line> read_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot read");
  std::vector<std::string> header;
  std::vector<Line> lines;
  std::string text;
  for (int number = 1; std::getline(in, text); ++number) {
    if (text.empty() || text[0] == '#') continue;
    std::vector<std::string> cells;
    std::stringstream ss(text);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (header.empty()) {
      header = cells;
      continue;
    }
    Line line;
    line.where = path + ":" + std::to_string(number);
    if (cells.size() > header.size())
      throw InputError(line.where + ": more cells than the header has columns");
    for (size_t i = 0; i < cells.size(); ++i) line.cells[header[i]] = cells[i];
    lines.push_back(std::move(line));
  }
  if (lines.empty()) throw InputError(path + ": no rows");
  return lines;
}

// The layout, written as inline strategy keys so that the strategy language validates it.
Strategy parse_layout(const Line& line, const std::string& keys, const ModelSpec& model,
                      const ClusterSpec& cluster) {
  StatusOr<Strategy> s = load_strategy(keys, model, cluster);
  if (!s.ok()) throw InputError(line.where + ": " + s.status().message());
  return std::move(s).value();
}

}  // namespace

StatusOr<std::vector<PublishedRun>> load_sc21_runs(const std::string& path) {
  return catch_input_error([&] {
  std::vector<PublishedRun> runs;
  for (const Line& line : read_csv(path)) {
    PublishedRun run;
    run.id = line.text("name");
    ModelSpec& m = run.model;
    m.name = run.id;
    m.layers = line.integer("layers");
    m.hidden = line.integer("hidden");
    m.heads = line.integer("heads");
    m.kv_heads = m.heads;
    m.ffn_hidden = 4 * m.hidden;
    m.seq_len = 2048;
    m.vocab = 51200;
    m.dtype = DType::kFP16;
    const int gpus = line.integer("gpus");
    run.cluster = take(load_cluster(std::to_string(gpus / 8) + "x8xa100-80g"));
    const int tp = line.integer("tp"), pp = line.integer("pp");
    std::string keys = "tp=" + std::to_string(tp) + ",pp=" + std::to_string(pp) +
                       ",microbatch_size=" + line.text("microbatch") +
                       ",global_batch=" + line.text("global_batch") +
                       // The 2021 code: full recompute, unfused attention, the gradient
                       // reduction after the backward pass.
                       ",recompute=full,attention=unfused,overlap_grad_reduce=false";
    auto virtual_layers = line.cells.find("layers_per_virtual_stage");
    if (virtual_layers != line.cells.end() && !virtual_layers->second.empty()) {
      const int v = m.layers / pp / line.integer("layers_per_virtual_stage");
      keys += ",schedule=interleaved,virtual_stages=" + std::to_string(v);
    }
    run.strategy = parse_layout(line, keys, m, run.cluster);
    run.tflops_per_gpu = line.number("tflops_per_gpu");
    runs.push_back(std::move(run));
  }
  return runs;
  });
}

StatusOr<std::vector<PublishedRun>> load_hopper_runs(const std::string& path) {
  return catch_input_error([&] {
  std::vector<PublishedRun> runs;
  for (const Line& line : read_csv(path)) {
    PublishedRun run;
    run.id = line.text("id") + " " + line.text("model_name");
    ModelSpec& m = run.model;
    m.name = line.text("model_name");
    m.layers = line.integer("layers");
    m.hidden = line.integer("hidden");
    m.heads = line.integer("heads");
    m.kv_heads = line.integer("kv_heads");
    m.ffn_hidden = line.integer("ffn_hidden");
    m.vocab = line.integer("vocab");
    m.seq_len = line.integer("seq_len");
    const std::string& activation = line.text("activation");
    if (activation != "gelu" && activation != "swiglu")
      throw InputError(line.where + ": activation: must be gelu or swiglu, got " + activation);
    m.activation = activation == "swiglu" ? Activation::kSwiGLU : Activation::kGelu;
    m.tied_embeddings = line.text("tied") == "true";
    m.dtype = DType::kBF16;
    const int gpus = line.integer("gpus");
    StatusOr<ClusterSpec> cluster =
        load_cluster(std::to_string(gpus / 8) + "x8x" + line.text("gpu"));
    if (!cluster.ok()) throw InputError(line.where + ": gpu: " + cluster.status().message());
    run.cluster = std::move(cluster).value();
    const double nic = line.number("inter_node_Gbps");
    for (NodeGroup& g : run.cluster.groups) g.inter_node_Gbps = nic;
    std::string keys = "tp=" + line.text("tp") + ",pp=" + line.text("pp") +
                       ",cp=" + line.text("cp") + ",sp=" + line.text("sp") +
                       ",microbatch_size=" + line.text("microbatch") +
                       ",global_batch=" + line.text("global_batch") +
                       ",recompute=" + line.text("recompute") + ",zero=" + line.text("zero") +
                       ",attention=" + line.text("attention") + ",fp8=" + line.text("fp8") +
                       ",tp_comm_overlap=true,overlap_grad_reduce=true,overlap_param_gather=true";
    if (line.integer("virtual_stages") > 1)
      keys += ",schedule=interleaved,virtual_stages=" + line.text("virtual_stages");
    run.strategy = parse_layout(line, keys, m, run.cluster);
    run.iteration_s = line.number("iteration_s");
    runs.push_back(std::move(run));
  }
  return runs;
  });
}

double PublishedRun::published() const { return iteration_s > 0 ? iteration_s : tflops_per_gpu; }

double PublishedRun::predicted(const CostBreakdown& b) const {
  return iteration_s > 0 ? b.iteration_time_s : b.tflops_per_gpu;
}

}  // namespace parapilot
