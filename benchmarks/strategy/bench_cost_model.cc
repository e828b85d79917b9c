// Strategy evaluations per second of the cost model, one core: gpt3-175b (96 layers) on
// 1024 a100-80g GPUs, cycling through a set of legal layouts (nominal and slowed conditions).
// Prints figures; not a test. Usage: bench_cost_model [seconds_per_case] [--json FILE]
//   --json FILE: also write the figures as JSON (benchmarks/report.h): "cases", one row per
//   condition case with the median, min and max evaluations per second of its 5 repetitions.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "benchmarks/report.h"
#include "strategy/cost_model.h"

using namespace parapilot;

namespace {

double run(const CostModel& cost, const std::vector<Strategy>& layouts, const Conditions& c,
           double seconds, double& sink) {
  using clock = std::chrono::steady_clock;
  long evaluations = 0;
  const auto start = clock::now();
  auto now = start;
  do {
    for (const Strategy& s : layouts) sink += cost.evaluate(s, c).iteration_time_s;
    evaluations += static_cast<long>(layouts.size());
    now = clock::now();
  } while (std::chrono::duration<double>(now - start).count() < seconds);
  return static_cast<double>(evaluations) / std::chrono::duration<double>(now - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (bench::print_help(argc, argv,
                        "usage: bench_cost_model [SECONDS] [--json FILE]\n"
                        "cost-model evaluations per second on one core, over SECONDS (default 1)")) {
    return 0;
  }
  const std::string json_path = bench::take_json_flag(argc, argv);
  bench::Report report("bench_cost_model", argc, argv);
  nlohmann::json& fig = report.figures();
  const double seconds = argc > 1 ? std::atof(argv[1]) : 1.0;
  const ModelSpec model = *model_preset("gpt3-175b");
  const ClusterSpec cluster = *cluster_preset("128x8xa100-80g");
  const CostModel cost(model, cluster);

  std::vector<Strategy> layouts;
  for (int tp : {4, 8}) {
    for (int pp : {4, 8, 16, 32}) {
      for (int mb : {1, 2}) {
        Strategy s;
        s.tp = tp;
        s.pp = pp;
        s.dp = 1024 / (tp * pp);
        s.sp = true;
        s.microbatch_size = mb;
        s.global_batch = 2048;
        s.recompute = Recompute::kSelective;
        s.zero = 1;
        if (find_problem(s, model, cluster)) continue;
        layouts.push_back(s);
      }
    }
  }
  Conditions slowed;
  slowed.gpu_speed.assign(cluster.num_gpus(), 1.0);
  slowed.gpu_speed[17] = 0.4;
  slowed.gpu_speed[900] = 0.7;
  slowed.node_inter_bw.assign(cluster.num_nodes(), 1.0);
  slowed.node_inter_bw[3] = 0.25;

  double sink = 0;
  fig["model"] = "gpt3-175b";
  fig["cluster"] = "128x8xa100-80g";
  fig["layouts"] = layouts.size();
  fig["seconds_per_case"] = seconds;
  // Targets: nominal 450,000 evaluations/s, slowed 200,000, on one core.
  const double target[2] = {450000, 200000};
  fig["target_evaluations_per_s"] = target[1];
  fig["target_nominal_evaluations_per_s"] = target[0];
  fig["cases"] = nlohmann::json::array();
  std::printf("cost model: gpt3-175b (96 layers) on 1024 a100-80g, %zu layouts, one thread\n",
              layouts.size());
  for (const char* name : {"nominal", "slowed"}) {
    const bool nominal = name[0] == 'n';
    const Conditions& c = nominal ? Conditions{} : slowed;
    std::vector<double> rates;
    for (int rep = 0; rep < 5; ++rep) rates.push_back(run(cost, layouts, c, seconds / 5, sink));
    std::sort(rates.begin(), rates.end());
    std::printf(
        "  %-8s conditions: median %10.0f evaluations/s  (min %.0f, max %.0f; target >= "
        "%.0f)\n",
        name, rates[2], rates[0], rates[4], target[nominal ? 0 : 1]);
    fig["cases"].push_back({{"conditions", name},
                            {"target_evaluations_per_s", target[nominal ? 0 : 1]},
                            {"median_evaluations_per_s", rates[2]},
                            {"min_evaluations_per_s", rates[0]},
                            {"max_evaluations_per_s", rates[4]}});
  }
  std::printf("(checksum %.3g)\n", sink);
  fig["checksum"] = sink;
  return report.write(json_path) ? 0 : 1;
}
