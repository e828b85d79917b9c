// parapilot simulate: one layout's predicted iteration time, throughput and memory.
#include <cstdio>
#include <iostream>
#include <memory>

#include "experiments/cli_common.h"
#include "experiments/commands.h"
#include "core/error.h"
#include "strategy/pipeline_schedule.h"
#include "strategy/spec_io.h"

namespace parapilot::cli {

namespace {

struct SimulateOptions {
  std::string model = "llama2-7b";
  std::string cluster = "2x8xa100-80g";
  std::string strategy = "megatron";
  std::string conditions;
  std::string trace;
  bool json = false;
};

void print_table(const ModelSpec& model, const ClusterSpec& cluster, const Strategy& s,
                 const CostBreakdown& b, const MemoryBreakdown& mem) {
  std::printf("model      %s  (%.2fB parameters, %d layers, seq %d)\n", model.name.c_str(),
              static_cast<double>(model.total_params()) / 1e9, model.layers, model.seq_len);
  std::printf("cluster    %s  (%d GPUs in %d nodes)\n", cluster.name.c_str(), cluster.num_gpus(),
              cluster.num_nodes());
  std::printf("strategy   %s\n\n", describe(s).c_str());
  if (!b.feasible) {
    std::printf("infeasible: %s\n", b.reason.c_str());
    return;
  }
  std::printf("iteration  %10.3f s\n", b.iteration_time_s);
  std::printf("tokens/s   %10.0f\n", b.tokens_per_s);
  std::printf("TFLOP/s    %10.1f per GPU\n", b.tflops_per_gpu);
  std::printf("MFU        %10.1f %%\n", 100 * b.mfu);
  std::printf("memory     %10.1f GiB of %.0f GiB per GPU  %s\n\n", b.memory_gib,
              b.memory_capacity_gib, b.fits_in_memory ? "(fits)" : "(DOES NOT FIT)");
  std::printf("%-22s %10s %8s\n", "time breakdown", "seconds", "share");
  const std::pair<const char*, double> rows[] = {
      {"compute", b.compute_s},           {"recompute", b.recompute_s},
      {"tp/sp collectives", b.tp_comm_s}, {"cp ring (exposed)", b.cp_comm_s},
      {"pipeline p2p", b.pp_comm_s},
      {"pipeline bubble", b.bubble_s},    {"dp reduction (exposed)", b.dp_comm_s},
      {"optimizer", b.optimizer_s}};
  for (const auto& [name, value] : rows) {
    std::printf("  %-20s %10.4f %7.1f%%\n", name, value, 100 * value / b.iteration_time_s);
  }
  std::printf("\n%-22s %10s\n", "memory (worst GPU)", "GiB");
  const std::pair<const char*, double> mrows[] = {{"weights", mem.weights_gib},
                                                  {"gradients", mem.gradients_gib},
                                                  {"optimizer states", mem.optimizer_gib},
                                                  {"activations", mem.activations_gib},
                                                  {"runtime reserve", mem.reserved_gib}};
  for (const auto& [name, value] : mrows) std::printf("  %-20s %10.2f\n", name, value);
}

void run_simulate(const SimulateOptions& o) {
  const ModelSpec model = take(load_model(o.model));
  const ClusterSpec cluster = take(load_cluster(o.cluster));
  const Strategy s = take(load_strategy(o.strategy, model, cluster));
  const Conditions c =
      o.conditions.empty() ? Conditions{} : take(load_conditions(o.conditions, cluster));
  const CostModel cost(model, cluster);
  const CostBreakdown b = cost.evaluate(s, c);

  // The pipeline rank with the largest footprint.
  MemoryBreakdown worst;
  for (int p = 0; p < s.pp; ++p) {
    const MemoryBreakdown m = cost.memory(s, 0, p);
    if (m.total_gib() > worst.total_gib()) worst = m;
  }
  if (!o.trace.empty()) {
    if (!b.feasible) throw InputError("--trace: the layout is infeasible: " + b.reason);
    check(write_file_atomically(o.trace,
                                [&](std::ostream& out) { write_chrome_trace(cost, s, c, out); }));
  }
  if (o.json) {
    nlohmann::json j = to_json(b);
    j["model"] = model.name;
    j["cluster"] = cluster.name;
    j["gpus"] = s.num_gpus();
    j["strategy"] = to_json(s);
    j["memory_breakdown_gb"] = {{"weights", worst.weights_gib},
                                {"gradients", worst.gradients_gib},
                                {"optimizer", worst.optimizer_gib},
                                {"activations", worst.activations_gib},
                                {"reserved", worst.reserved_gib}};
    std::cout << j.dump(2) << "\n";
  } else {
    print_table(model, cluster, s, b, worst);
    if (!o.trace.empty())
      std::printf("\ntrace written to %s (open in https://ui.perfetto.dev)\n", o.trace.c_str());
  }
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto options = std::make_shared<SimulateOptions>();
  CLI::App* cmd =
      app.add_subcommand("simulate", "Predict one layout's iteration time, throughput and memory");
  cmd->add_option("--model", options->model, "Model preset or TOML file with [model]")
      ->capture_default_str();
  cmd->add_option("--cluster", options->cluster,
                  "Cluster preset (e.g. 4x8xa100-80g) or TOML file with [cluster]")
      ->capture_default_str();
  cmd->add_option("--strategy", options->strategy,
                  "Strategy preset (dp, megatron), inline keys (tp=8,pp=2,global_batch=512) "
                  "or TOML file with [strategy]")
      ->capture_default_str();
  cmd->add_option("--conditions", options->conditions,
                  "TOML file with [conditions]: GPU speed factors, link factors, failed GPUs");
  cmd->add_flag("--json", options->json, "Print one JSON object instead of a table");
  cmd->add_option("--trace", options->trace,
                  "Write a Chrome trace (JSON) of one iteration's pipeline timeline");
  cmd->callback([options] { run_simulate(*options); });
}

}  // namespace parapilot::cli
