// The calibration table of docs/cost-model.md: every published run of tests/data (Megatron-LM
// SC'21 Table 1; the 2024 Hopper rows) with its published figure, the cost model's prediction,
// the error and the memory verdict. Deterministic (no timing): any machine load.
// Prints figures; not a test (tests/strategy/calibration_test.cc holds the 10% bound).
// Usage: calibration_report [--json FILE]
#include <cstdio>
#include <cstdlib>
#include <string>

#include "benchmarks/report.h"
#include "strategy/cost_model.h"
#include "strategy/published_runs.h"

using namespace parapilot;

int main(int argc, char** argv) {
  const std::string json_path = bench::take_json_flag(argc, argv);
  bench::Report report("calibration_report", argc, argv);
  nlohmann::json& rows = report.figures()["rows"];
  rows = nlohmann::json::array();
  const std::string dir = PARAPILOT_TEST_DATA_DIR;
  struct Source {
    const char* file;
    std::vector<PublishedRun> runs;
  };
  auto rows_of = [](StatusOr<std::vector<PublishedRun>> read) {
    if (!read.ok()) {
      std::fprintf(stderr, "calibration_report: %s\n", read.status().message().c_str());
      std::exit(2);
    }
    return std::move(read).value();
  };
  const Source sources[] = {
      {"megatron-sc21-table1.csv", rows_of(load_sc21_runs(dir + "/megatron-sc21-table1.csv"))},
      {"modern-given.csv", rows_of(load_hopper_runs(dir + "/modern-given.csv"))}};
  std::printf("%-26s %-14s %-22s %10s %10s %8s  %s\n", "run", "gpus", "layout", "published",
              "predicted", "error", "memory");
  for (const Source& source : sources) {
    for (const PublishedRun& run : source.runs) {
      const CostBreakdown b = CostModel(run.model, run.cluster).evaluate(run.strategy);
      const bool by_step = run.iteration_s > 0;
      const double published = run.published();
      const double predicted = run.predicted(b);
      const Strategy& s = run.strategy;
      std::string layout = "tp" + std::to_string(s.tp) + " pp" + std::to_string(s.pp);
      if (s.virtual_stages > 1) layout += " v" + std::to_string(s.virtual_stages);
      if (s.cp > 1) layout += " cp" + std::to_string(s.cp);
      layout += " dp" + std::to_string(s.dp);
      const std::string gpus = std::to_string(s.num_gpus()) + " " + run.cluster.groups[0].gpu.name;
      std::printf("%-26s %-14s %-22s %10.3f %10.3f %+7.1f%%  %.1f of %.0f GiB%s\n", run.id.c_str(),
                  gpus.c_str(), layout.c_str(), published, predicted,
                  100 * (predicted / published - 1), b.memory_gib, b.memory_capacity_gib,
                  b.fits_in_memory ? "" : " (does not fit)");
      rows.push_back({{"file", source.file},
                      {"run", run.id},
                      {"gpus", gpus},
                      {"layout", layout},
                      {"attention", to_string(s.attention)},
                      {"figure", by_step ? "iteration_s" : "tflops_per_gpu"},
                      {"published", published},
                      {"predicted", predicted},
                      {"error", predicted / published - 1},
                      {"memory_gib", b.memory_gib},
                      {"memory_capacity_gib", b.memory_capacity_gib},
                      {"fits_in_memory", b.fits_in_memory}});
    }
  }
  return report.write(json_path) ? 0 : 1;
}
