// Planner search time, one thread: full default-space searches for gpt3-175b on 1024
// a100-80g GPUs and llama2-70b on a mixed 512-GPU cluster (half a100-80g, half h800) with two
// slowed GPUs, then how the time grows from 64 to 4096 GPUs. Also the mixed-cluster result:
// elastic layout vs uniform data parallel vs the sum of the GPUs' speeds.
// Prints figures; not a test. Usage: bench_planner [repetitions] [--json FILE]
//   --json FILE: also write the figures as JSON (benchmarks/report.h): "searches" (the two main
//   searches), "scaling" (one row per GPU count) and "mixed_cluster".
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "benchmarks/report.h"
#include "strategy/planner.h"

using namespace parapilot;

namespace {

struct Figures {
  double median_ms = 0, min_ms = 0;
  long evaluated = 0, pruned = 0;
  PlanResult last;
};

Figures time_plan(const Planner& planner, const PlanRequest& request, int repetitions) {
  std::vector<double> ms;
  Figures f;
  for (int i = 0; i < repetitions; ++i) {
    f.last = planner.plan(request);
    ms.push_back(f.last.search_ms);
  }
  std::sort(ms.begin(), ms.end());
  f.median_ms = ms[ms.size() / 2];
  f.min_ms = ms[0];
  f.evaluated = f.last.evaluated;
  f.pruned = f.last.pruned;
  return f;
}

nlohmann::json to_json(const Figures& f) {
  nlohmann::json j = {{"median_ms", f.median_ms},
                      {"min_ms", f.min_ms},
                      {"evaluated", f.evaluated},
                      {"pruned", f.pruned}};
  if (!f.last.candidates.empty()) {
    const CostBreakdown& b = f.last.candidates[0].cost;
    j["best_iteration_s"] = b.iteration_time_s;
    j["best_mfu"] = b.mfu;
  }
  return j;
}

void print(const char* name, const Figures& f) {
  std::printf("  %-44s median %8.2f ms  (min %.2f)  evaluated %6ld  pruned %7ld", name, f.median_ms,
              f.min_ms, f.evaluated, f.pruned);
  if (!f.last.candidates.empty()) {
    const CostBreakdown& b = f.last.candidates[0].cost;
    std::printf("  best %.3f s/iter, MFU %.1f%%", b.iteration_time_s, 100 * b.mfu);
  }
  std::printf("\n");
}

Conditions slowed(const ClusterSpec& cluster) {
  Conditions c;
  c.gpu_speed.assign(cluster.num_gpus(), 1.0);
  c.gpu_speed[5] = 0.5;                            // an a100-80g
  c.gpu_speed[cluster.num_gpus() / 2 + 12] = 0.7;  // an h800
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  if (bench::print_help(argc, argv,
                        "usage: bench_planner [REPS] [--json FILE]\n"
                        "planner search time, 64 to 4,096 GPUs, median of REPS (default 5)")) {
    return 0;
  }
  const std::string json_path = bench::take_json_flag(argc, argv);
  bench::Report report("bench_planner", argc, argv);
  nlohmann::json& fig = report.figures();
  const int reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  fig["repetitions"] = reps;
  fig["searches"] = nlohmann::json::array();
  std::printf("planner: default search space, top-5, one thread, %d repetitions\n", reps);
  auto search = [&](const char* id, const char* model, int gpus, const Figures& f) {
    nlohmann::json j = {{"name", id}, {"model", model}, {"gpus", gpus}};
    j.update(to_json(f));
    return j;
  };
  {
    const Planner planner(*model_preset("gpt3-175b"), *cluster_preset("128x8xa100-80g"));
    PlanRequest req;
    const Figures f = time_plan(planner, req, reps);
    print("gpt3-175b on 1024 a100-80g", f);
    fig["searches"].push_back(search("gpt3-175b", "gpt3-175b", 1024, f));
  }
  {
    const ClusterSpec cluster = *cluster_preset("32x8xa100-80g+32x8xh800");
    const Planner planner(*model_preset("llama2-70b"), cluster);
    PlanRequest req;
    req.conditions = slowed(cluster);
    const Figures f = time_plan(planner, req, reps);
    print("llama2-70b on 256 a100-80g + 256 h800, 2 slow", f);
    fig["searches"].push_back(search("llama2-70b-mixed", "llama2-70b", 512, f));
  }
  std::printf(
      "\nscaling (gpt3-175b on N a100-80g; llama2-70b on N/2 a100-80g + N/2 h800, 2 slow):\n");
  fig["scaling"] = nlohmann::json::array();
  for (int gpus : {64, 128, 256, 512, 1024, 2048, 4096}) {
    const int nodes = gpus / 8;
    nlohmann::json row = {{"gpus", gpus}};
    {
      const Planner planner(*model_preset("gpt3-175b"),
                            *cluster_preset(std::to_string(nodes) + "x8xa100-80g"));
      PlanRequest req;
      const Figures f = time_plan(planner, req, reps);
      print(("gpt3-175b, " + std::to_string(gpus) + " GPUs").c_str(), f);
      row["gpt3_175b"] = to_json(f);
    }
    {
      const ClusterSpec cluster = *cluster_preset(std::to_string(nodes / 2) + "x8xa100-80g+" +
                                                  std::to_string(nodes / 2) + "x8xh800");
      const Planner planner(*model_preset("llama2-70b"), cluster);
      PlanRequest req;
      req.conditions = slowed(cluster);
      const Figures f = time_plan(planner, req, reps);
      print(("llama2-70b mixed, " + std::to_string(gpus) + " GPUs").c_str(), f);
      row["llama2_70b_mixed"] = to_json(f);
    }
    fig["scaling"].push_back(row);
  }
  // Mixed 8 + 8: best elastic layout vs uniform data parallel vs the sum of speeds.
  std::printf("\nmixed cluster 1x8xa100-80g+1x8xh800, gpt3-1.3b, global batch 256:\n");
  {
    const ModelSpec model = *model_preset("gpt3-1.3b");
    const ClusterSpec cluster = *cluster_preset("1x8xa100-80g+1x8xh800");
    const Planner planner(model, cluster);
    PlanRequest req;
    req.space.global_batch = 256;
    const PlanResult best = planner.plan(req);
    PlanRequest uniform = req;
    uniform.space.tp = {1};
    uniform.space.pp = {1};
    uniform.space.microbatch_size = {1, 2, 4, 8, 16};
    Strategy dp;
    dp.dp = 16;
    dp.global_batch = 256;
    dp.zero = 1;
    double uniform_tps = 0;
    for (int mb : {1, 2, 4, 8, 16}) {
      dp.microbatch_size = mb;
      const CostBreakdown b = planner.cost_model().evaluate(dp);
      if (b.feasible && b.fits_in_memory) uniform_tps = std::max(uniform_tps, b.tokens_per_s);
    }
    // Upper bound: every GPU alone (dp = 1 on one GPU), summed.
    double bound = 0;
    for (int g : {0, 8}) {
      Strategy one;
      one.gpus = {g};
      one.global_batch = 16;
      double tps = 0;
      for (int mb : {1, 2, 4, 8, 16}) {
        one.microbatch_size = mb;
        const CostBreakdown b = planner.cost_model().evaluate(one);
        if (b.feasible && b.fits_in_memory) tps = std::max(tps, b.tokens_per_s);
      }
      bound += 8 * tps;
    }
    const double elastic = best.candidates.empty() ? 0 : best.candidates[0].cost.tokens_per_s;
    std::printf("  uniform data parallel   %10.0f tokens/s\n", uniform_tps);
    std::printf("  planner best            %10.0f tokens/s  (%.2fx uniform)  %s\n", elastic,
                elastic / uniform_tps,
                best.candidates.empty()                         ? ""
                : best.candidates[0].strategy.dp_shares.empty() ? "uniform shares"
                                                                : "elastic shares");
    std::printf("  sum of GPU speeds       %10.0f tokens/s  (planner reaches %.1f%%)\n", bound,
                100 * elastic / bound);
    fig["mixed_cluster"] = {
        {"model", "gpt3-1.3b"},
        {"cluster", "1x8xa100-80g+1x8xh800"},
        {"global_batch", 256},
        {"uniform_dp_tokens_per_s", uniform_tps},
        {"planner_best_tokens_per_s", elastic},
        {"planner_over_uniform", elastic / uniform_tps},
        {"planner_elastic_shares",
         !best.candidates.empty() && !best.candidates[0].strategy.dp_shares.empty()},
        {"sum_of_gpu_speeds_tokens_per_s", bound},
        {"planner_over_sum_of_speeds", elastic / bound}};
  }
  return report.write(json_path) ? 0 : 1;
}
