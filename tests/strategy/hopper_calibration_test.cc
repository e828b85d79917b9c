// The cost model against published 2024 Hopper runs (tests/data/modern-given.csv): NVIDIA's
// DGX Cloud recipes and the Nemotron-4 15B report, with flash attention, grouped-query
// attention, context parallelism and the distributed optimizer. Every row really ran, so it
// must fit in memory, and its step time must be predicted within 10%.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "strategy/cost_model.h"
#include "strategy/spec_io.h"

using namespace parapilot;

namespace {

using Row = std::map<std::string, std::string>;

std::vector<Row> read_csv(const std::string& name) {
  std::ifstream in(std::string(PARAPILOT_TEST_DATA_DIR) + "/" + name);
  REQUIRE(in.good());
  std::vector<Row> rows;
  std::vector<std::string> header;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (header.empty()) {
      header = cells;
      continue;
    }
    Row row;
    for (size_t i = 0; i < header.size() && i < cells.size(); ++i) row[header[i]] = cells[i];
    rows.push_back(row);
  }
  return rows;
}

int as_int(const Row& row, const std::string& key) { return std::stoi(row.at(key)); }

}  // namespace

TEST_CASE("cost model predicts the published Hopper runs within 10% and fits them in memory") {
  const auto rows = read_csv("modern-given.csv");
  REQUIRE(rows.size() == 3);
  for (const Row& row : rows) {
    ModelSpec model;
    model.name = row.at("model_name");
    model.layers = as_int(row, "layers");
    model.hidden = as_int(row, "hidden");
    model.heads = as_int(row, "heads");
    model.kv_heads = as_int(row, "kv_heads");
    model.ffn_hidden = as_int(row, "ffn_hidden");
    model.vocab = as_int(row, "vocab");
    model.seq_len = as_int(row, "seq_len");
    model.activation = row.at("activation") == "swiglu" ? Activation::kSwiGLU : Activation::kGelu;
    model.tied_embeddings = row.at("tied") == "true";
    model.dtype = DType::kBF16;
    const int gpus = as_int(row, "gpus");
    ClusterSpec cluster = load_cluster(std::to_string(gpus / 8) + "x8x" + row.at("gpu"));
    for (NodeGroup& g : cluster.groups) g.inter_node_Gbps = std::stod(row.at("inter_node_Gbps"));
    std::string inline_strategy =
        "tp=" + row.at("tp") + ",pp=" + row.at("pp") + ",cp=" + row.at("cp") +
        ",sp=" + row.at("sp") + ",microbatch_size=" + row.at("microbatch") +
        ",global_batch=" + row.at("global_batch") + ",recompute=" + row.at("recompute") +
        ",zero=" + row.at("zero") + ",attention=" + row.at("attention") + ",fp8=" + row.at("fp8") +
        ",tp_comm_overlap=true";  // as NVIDIA's recipes run (Transformer Engine userbuffers)
    if (as_int(row, "virtual_stages") > 1) {
      inline_strategy += ",schedule=interleaved,virtual_stages=" + row.at("virtual_stages");
    }
    const Strategy s = load_strategy(inline_strategy, model, cluster);
    CostModel cost(model, cluster);
    const CostBreakdown b = cost.evaluate(s);
    const double published = std::stod(row.at("iteration_s"));
    const double error = b.iteration_time_s / published - 1.0;
    std::printf(
        "calibration %s %-14s published %6.3f s predicted %6.3f s  error %+5.1f%%  (compute %.3f "
        "recompute %.3f tp %.3f cp %.3f pp %.3f bubble %.3f dp %.3f opt %.3f; mem %.1f of %.0f "
        "GiB; MFU %.1f%%)\n",
        row.at("id").c_str(), model.name.c_str(), published, b.iteration_time_s, 100 * error,
        b.compute_s, b.recompute_s, b.tp_comm_s, b.cp_comm_s, b.pp_comm_s, b.bubble_s, b.dp_comm_s,
        b.optimizer_s, b.memory_gib, b.memory_capacity_gib, 100 * b.mfu);
    CHECK_MESSAGE(b.fits_in_memory, row.at("id") << ": " << b.reason);
    CHECK_MESSAGE(std::abs(error) <= 0.10, row.at("id") << " error " << 100 * error << "%");
  }
}
