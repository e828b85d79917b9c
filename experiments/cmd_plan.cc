// parapilot plan: the top-K layouts for a model on a cluster under runtime conditions.
#include <cstdio>
#include <iostream>
#include <memory>

#include "experiments/cli_common.h"
#include "experiments/commands.h"
#include "core/error.h"
#include "strategy/planner.h"
#include "strategy/spec_io.h"

namespace parapilot::cli {

namespace {

struct PlanOptions {
  std::string model = "llama2-7b";
  std::string cluster = "2x8xa100-80g";
  std::string space;
  std::string conditions;
  std::string current;
  int top = 5;
  bool json = false;
};

nlohmann::json candidate_json(const Candidate& c, bool with_migration) {
  nlohmann::json j = to_json(c.cost);
  j["strategy"] = to_json(c.strategy);
  j["gpus"] = c.strategy.num_gpus();
  if (with_migration) {
    j["migration_bytes"] = c.migration_bytes;
    j["migration_s"] = c.migration_s;
  }
  return j;
}

void print_row(const char* rank, const Candidate& c, bool with_migration) {
  if (!c.cost.feasible) {
    std::printf("%-5s %s\n      infeasible: %s\n", rank, describe(c.strategy).c_str(),
                c.cost.reason.c_str());
    return;
  }
  std::printf("%-5s %10.0f %9.3f %6.1f %7.1f%s", rank, c.cost.tokens_per_s, c.cost.iteration_time_s,
              100 * c.cost.mfu, c.cost.memory_gib, c.cost.fits_in_memory ? " " : "!");
  if (with_migration) {
    std::printf(" %9.2f %7.1f", c.migration_bytes / 1e9, c.migration_s);
  }
  std::printf("  %s\n", describe(c.strategy).c_str());
}

void run_plan(const PlanOptions& o) {
  const ModelSpec model = take(load_model(o.model));
  const ClusterSpec cluster = take(load_cluster(o.cluster));
  if (o.top < 1) throw InputError("--top: must be >= 1, got " + std::to_string(o.top));
  PlanRequest req;
  req.top_k = o.top;
  if (!o.space.empty()) req.space = take(load_search_space(o.space, model));
  if (!o.conditions.empty()) {
    req.conditions = take(load_conditions(o.conditions, cluster));
    req.gradients = take(load_gradient_stats(o.conditions, model));
  }
  if (!o.current.empty()) req.current = take(load_strategy(o.current, model, cluster));

  const Planner planner(model, cluster);
  const PlanResult r = planner.plan(req);
  const bool migration = req.current.has_value();

  if (o.json) {
    nlohmann::json j;
    j["model"] = model.name;
    j["cluster"] = cluster.name;
    j["candidates"] = nlohmann::json::array();
    for (const auto& c : r.candidates) j["candidates"].push_back(candidate_json(c, migration));
    if (r.current) j["current"] = candidate_json(*r.current, false);
    j["search_ms"] = r.search_ms;
    j["evaluated"] = r.evaluated;
    j["pruned"] = r.pruned;
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::printf("model      %s  (%.2fB parameters, %d layers)\n", model.name.c_str(),
              static_cast<double>(model.total_params()) / 1e9, model.layers);
  std::printf("cluster    %s  (%d GPUs in %d nodes)\n", cluster.name.c_str(), cluster.num_gpus(),
              cluster.num_nodes());
  std::printf("search     %.1f ms, %ld layouts evaluated, %ld pruned by bounds\n\n", r.search_ms,
              r.evaluated, r.pruned);
  if (r.candidates.empty()) {
    std::printf("no layout in the search space fits in memory\n");
  } else {
    std::printf("%-5s %10s %9s %6s %7s", "rank", "tokens/s", "iter s", "MFU%", "GiB/GPU");
    if (migration) std::printf(" %9s %7s", "move GB", "move s");
    std::printf("  layout\n");
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      print_row(std::to_string(i + 1).c_str(), r.candidates[i], migration);
    }
  }
  if (r.current) {
    std::printf("\n");
    print_row("now", *r.current, false);
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto options = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Search the fastest feasible layouts (top-K, diverse) under runtime conditions");
  cmd->add_option("--model", options->model, "Model preset or TOML file with [model]")
      ->capture_default_str();
  cmd->add_option("--cluster", options->cluster,
                  "Cluster preset (e.g. 1x8xa100-80g+1x8xh800) or TOML file with [cluster]")
      ->capture_default_str();
  cmd->add_option("--space", options->space,
                  "TOML file with [space]: allowed values per strategy field (default: all)");
  cmd->add_option("--conditions", options->conditions,
                  "TOML file with [conditions] (GPU speeds, link factors, failed GPUs) and "
                  "optionally [gradients] (per-layer gradient statistics)");
  cmd->add_option("--current", options->current,
                  "The running layout (same forms as simulate --strategy): evaluated too, and "
                  "migration costs are given from it");
  cmd->add_option("--top", options->top, "How many diverse candidates to return")
      ->capture_default_str();
  cmd->add_flag("--json", options->json, "Print one JSON object instead of a table");
  cmd->callback([options] { run_plan(*options); });
}

}  // namespace parapilot::cli
