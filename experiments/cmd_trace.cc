// parapilot trace analyze: what-if analysis of a recorded per-op trace (ByteDance schema) or a
// parapilot telemetry recording: slowdown against an ideal run, stragglers, cause and remedy.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "env/trace/op_trace.h"
#include "env/trace/telemetry.h"
#include "env/trace/trace_analysis.h"
#include "experiments/commands.h"
#include "core/error.h"

namespace parapilot::cli {

namespace {

struct TraceAnalyzeOptions {
  std::string trace;
  std::string meta;
  int layers = 0;
  bool json = false;
};

template <typename Key>
nlohmann::json by_key(const std::map<Key, double>& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : m) {
    if constexpr (std::is_same_v<Key, std::string>)
      j[k] = v;
    else
      j[std::to_string(k)] = v;
  }
  return j;
}

nlohmann::json to_json(const trace::TraceAnalysis& a, const std::string& path,
                       const std::string& format) {
  nlohmann::json j;
  j["trace"] = path;
  j["format"] = format;
  j["meta"] = {{"trial_name", a.meta.trial_name}, {"dp_size", a.meta.dp_size},
               {"pp_size", a.meta.pp_size},       {"tp_size", a.meta.tp_size},
               {"dsp_size", a.meta.dsp_size},     {"vpp_size", a.meta.vpp_size},
               {"world_size", a.meta.world_size}};
  j["steps"] = a.steps;
  j["microbatches"] = a.microbatches;
  j["recorded_step_s"] = a.recorded_step_s;
  j["measured_step_s"] = a.measured_step_s;
  j["ideal_step_s"] = a.ideal_step_s;
  j["slowdown"] = a.slowdown;
  j["cause"] = a.cause;
  j["cause_factors"] = {
      {"stage", a.stage_factor}, {"worker", a.worker_factor}, {"diffuse", a.diffuse_factor}};
  nlohmann::json stragglers = nlohmann::json::array();
  for (const trace::Straggler& s : a.stragglers)
    stragglers.push_back({{"rank", s.rank},
                          {"dp_rank", s.dp_rank},
                          {"stage", s.stage},
                          {"slowdown", s.slowdown},
                          {"compute_ratio", s.compute_ratio}});
  j["stragglers"] = stragglers;
  j["stage_slowdown"] = by_key(a.stage_slowdown);
  j["dp_rank_slowdown"] = by_key(a.dp_rank_slowdown);
  j["rank_slowdown"] = by_key(a.rank_slowdown);
  j["optype_slowdown"] = by_key(a.optype_slowdown);
  j["stage_compute_s"] = a.stage_compute_s;
  const trace::Remedy& r = a.remedy;
  nlohmann::json remedy = {
      {"kind", r.kind},
      {"description", r.description},
      {"current_step_s", r.current_step_s},
      {"predicted_step_s", r.predicted_step_s},
      {"predicted_speedup", r.predicted_step_s > 0 ? r.current_step_s / r.predicted_step_s : 1.0}};
  if (r.kind == "repartition-stages") {
    remedy["current_layers"] = r.current_layers;
    remedy["proposed_layers"] = r.proposed_layers;
    remedy["layers_assumed"] = r.layers_assumed;
    remedy["current_stage_s"] = r.current_stage_s;
    remedy["proposed_stage_s"] = r.proposed_stage_s;
  } else if (r.kind == "rebalance-dp-shares") {
    remedy["current_microbatches"] = r.current_microbatches;
    remedy["proposed_microbatches"] = r.proposed_microbatches;
    remedy["replica_speed"] = r.replica_speed;
  }
  j["remedy"] = remedy;
  return j;
}

void print_group(const char* title, const std::map<int, double>& m) {
  std::printf("\n%-10s %10s\n", title, "slowdown");
  for (const auto& [k, v] : m) std::printf("  %-8d %10.3f\n", k, v);
}

void print_table(const trace::TraceAnalysis& a, const std::string& path) {
  std::printf("trace      %s  (dp %d, pp %d, %d ranks, %d steps, %d microbatches)\n\n",
              path.c_str(), a.meta.dp_size, a.meta.pp_size, a.meta.world_size, a.steps,
              a.microbatches);
  std::printf("%-28s %10.3f s\n", "recorded step", a.recorded_step_s);
  std::printf("%-28s %10.3f s\n", "measured step (replayed)", a.measured_step_s);
  std::printf("%-28s %10.3f s\n", "ideal step", a.ideal_step_s);
  std::printf("%-28s %10.3f x\n", "slowdown", a.slowdown);
  std::printf("%-28s %10s   (factors: stage %.3f, worker %.3f, diffuse %.3f)\n", "cause",
              a.cause.c_str(), a.stage_factor, a.worker_factor, a.diffuse_factor);
  std::printf("\nstragglers\n  %-7s %8s %6s %10s %14s\n", "rank", "dp_rank", "stage", "slowdown",
              "compute ratio");
  if (a.stragglers.empty()) std::printf("  (none)\n");
  for (const trace::Straggler& s : a.stragglers)
    std::printf("  %-7d %8d %6d %10.3f %14.2f\n", s.rank, s.dp_rank, s.stage, s.slowdown,
                s.compute_ratio);
  std::printf("\n%-10s %10s %16s\n", "stage", "slowdown", "fwd+bwd / mb (s)");
  for (const auto& [k, v] : a.stage_slowdown)
    std::printf("  %-8d %10.3f %16.4f\n", k, v,
                k < static_cast<int>(a.stage_compute_s.size())
                    ? a.stage_compute_s[static_cast<std::size_t>(k)]
                    : 0.0);
  print_group("dp_rank", a.dp_rank_slowdown);
  print_group("rank", a.rank_slowdown);
  std::printf("\n%-28s %10s\n", "op type", "slowdown");
  for (const auto& [k, v] : a.optype_slowdown) std::printf("  %-26s %10.3f\n", k.c_str(), v);
  const trace::Remedy& r = a.remedy;
  std::printf("\nremedy     %s\n  %s\n", r.kind.c_str(), r.description.c_str());
  std::printf("  step time %.3f s -> %.3f s predicted\n", r.current_step_s, r.predicted_step_s);
}

void run_analyze(const TraceAnalyzeOptions& o) {
  trace::OpTrace ops;
  std::string format;
  double telemetry_step_s = 0;
  if (trace::looks_like_op_trace(o.trace)) {
    if (o.meta.empty())
      throw InputError(o.trace + ": a per-op trace needs --meta (the job's meta YAML file)");
    format = "op-trace";
    ops = take(trace::read_op_trace(o.trace, take(trace::read_job_meta(o.meta))));
  } else if (trace::looks_like_telemetry(o.trace)) {
    format = "telemetry";
    const trace::TelemetryTrace t = take(trace::read_telemetry(o.trace));
    trace::JobMeta meta = trace::telemetry_layout(t);
    if (!o.meta.empty()) {
      const trace::JobMeta given = take(trace::read_job_meta(o.meta));
      if (given.dp_size < meta.dp_size || given.pp_size < meta.pp_size)
        throw InputError(o.meta + ": dp_size/pp_size smaller than the ranks in " + o.trace);
      meta.dp_size = given.dp_size;
      meta.pp_size = given.pp_size;
      meta.trial_name = given.trial_name;
    }
    ops = take(trace::telemetry_to_op_trace(t, meta));
    telemetry_step_s = trace::mean_recorded_step_s(t);
  } else {
    std::ifstream probe(o.trace);
    if (!probe) throw InputError(o.trace + ": cannot open the file");
    throw InputError(o.trace + ":1: unrecognised header; expected a per-op trace (" +
                     std::string(trace::kOpTraceColumns) + ") or parapilot telemetry (" +
                     trace::kTelemetryColumns + ")");
  }
  if (o.layers > 0 && o.layers < ops.meta.pp_size)
    throw InputError("--layers: " + std::to_string(o.layers) + " is fewer than the " +
                     std::to_string(ops.meta.pp_size) + " pipeline stages");
  trace::AnalysisOptions options;
  options.layers = o.layers;
  trace::TraceAnalysis a = take(trace::analyze_trace(ops, options));
  // A telemetry recording's own wall time; the replayed figures come from its 1F1B model.
  if (format == "telemetry") a.recorded_step_s = telemetry_step_s;
  if (o.json) {
    std::cout << to_json(a, o.trace, format).dump(2) << "\n";
  } else {
    print_table(a, o.trace);
  }
}

}  // namespace

void add_trace_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("trace", "Analyse recorded training traces");
  cmd->require_subcommand(1);
  auto options = std::make_shared<TraceAnalyzeOptions>();
  CLI::App* analyze = cmd->add_subcommand(
      "analyze", "What-if analysis: slowdown against an ideal run, stragglers, cause and remedy");
  analyze
      ->add_option("TRACE", options->trace,
                   "Per-op trace CSV (ByteDance schema) or parapilot telemetry CSV")
      ->required();
  analyze->add_option("--meta", options->meta,
                      "Job meta YAML (dp_size, pp_size, ...); required for per-op traces");
  analyze
      ->add_option("--layers", options->layers,
                   "Transformer layers of the model, for the re-partitioning remedy "
                   "(default: assume 8 per stage)")
      ->check(CLI::Range(1, 1 << 20));
  analyze->add_flag("--json", options->json, "Print one JSON object instead of a table");
  analyze->callback([options] { run_analyze(*options); });
}

}  // namespace parapilot::cli
