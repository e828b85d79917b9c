#include <memory>
#include <string>

#include "env/registry.h"
#include "env/sim/distribution.h"
#include "env/sim/sim_env.h"
#include "env/trace/telemetry.h"
#include "env/trace/trace_analysis.h"
#include "core/error.h"
#include "strategy/spec_io.h"

namespace parapilot::env {

namespace {

// Recorded reality: per-rank speeds of a per-op trace or telemetry recording become the
// hidden conditions, one recorded interval per decision interval.
std::unique_ptr<Env> make_trace_env_or_throw(const EnvId& id) {
  reject_unknown(id, {"meta", "model", "gpu", "steps_per_interval", "interval_s"});
  if (id.variant.empty()) {
    throw InputError("env trace: name a trace file (trace:PATH(meta=META))");
  }
  auto param = [&](const char* key, const std::string& fallback) {
    auto it = id.params.find(key);
    return it == id.params.end() ? fallback : it->second;
  };
  trace::OpTrace recorded;
  if (trace::looks_like_op_trace(id.variant)) {
    if (!id.params.count("meta")) throw InputError("env trace: meta=META is required for " + id.variant);
    recorded = take(trace::read_op_trace(id.variant, take(trace::read_job_meta(param("meta", "")))));
  } else {
    const trace::TelemetryTrace t = take(trace::read_telemetry(id.variant));
    recorded = take(trace::telemetry_to_op_trace(
        t, id.params.count("meta") ? take(trace::read_job_meta(param("meta", "")))
                                   : trace::telemetry_layout(t)));
  }
  const int world = recorded.meta.world_size;
  const std::string gpu = param("gpu", "a100-80g");
  const std::string cluster = world <= 8 ? std::to_string(world) + "x" + gpu
                                         : std::to_string((world + 7) / 8) + "x8x" + gpu;
  Scenario s = builtin_scenario(Family::kStraggler, 8);
  s.name = "trace";
  s.model = take(load_model(param("model", "llama2-7b")));
  s.cluster = take(load_cluster(cluster));
  if (s.cluster.num_gpus() != world) {
    throw InputError("env trace: " + std::to_string(world) + " ranks do not fill nodes of 8 " + gpu);
  }
  s.interval_s = int_param(id, "interval_s", 300, 1, 1 << 20);
  Truth truth;
  for (const auto& interval :
       trace::recorded_conditions(recorded, int_param(id, "steps_per_interval", 1, 1, 1 << 20))) {
    truth.conditions.push_back(interval.conditions);
    truth.seq_len.push_back(s.model.seq_len);
  }
  if (truth.conditions.empty()) throw InputError("env trace: " + id.variant + " holds no steps");
  return std::make_unique<SimEnv>(std::move(s), "trace:" + id.variant, std::move(truth));
}


// The id's beliefs=monitor|exact (TelemetryModel::exact_beliefs); false when not given.
bool exact_beliefs(const EnvId& id, const std::string& canonical) {
  const auto it = id.params.find("beliefs");
  if (it == id.params.end()) return false;
  const std::optional<bool> exact = parse_exact_beliefs(it->second);
  if (!exact) {
    throw InputError("env " + canonical + ": beliefs must be monitor or exact, not " + it->second);
  }
  return *exact;
}


std::unique_ptr<Env> make_sim_env_or_throw(const EnvId& id) {
  if (id.variant.empty()) {
    throw InputError(
        "env sim: name a scenario family (sim:straggler), a scenario .toml or the training "
        "distribution (sim:random)");
  }
  std::string canonical = "sim:" + id.variant;
  if (!id.params.empty()) {
    canonical += "(";
    bool first = true;
    for (const auto& [k, v] : id.params) {
      canonical += (first ? "" : ",") + k + "=" + v;
      first = false;
    }
    canonical += ")";
  }
  if (id.variant == "random") {
    reject_unknown(id, {"gpus_min", "gpus_max", "horizon", "beliefs"});
    ScenarioRanges r;
    r.exact_beliefs = exact_beliefs(id, canonical);
    r.gpus_min = int_param(id, "gpus_min", r.gpus_min, 8, 1 << 16);
    r.gpus_max = int_param(id, "gpus_max", r.gpus_max, r.gpus_min, 1 << 16);
    r.horizon = int_param(id, "horizon", r.horizon, 1, 1 << 20);
    return make_distribution_env(r, canonical);
  }
  reject_unknown(id, {"gpus", "horizon", "beliefs"});
  Scenario s;
  if (id.variant.find(".toml") != std::string::npos) {
    s = take(load_scenario(id.variant));
    if (id.params.count("gpus")) {
      throw InputError("env " + id.variant + ": gpus is set in the scenario file");
    }
  } else {
    s = builtin_scenario(take(parse_family(id.variant)), int_param(id, "gpus", 64, 8, 1 << 16));
  }
  s.horizon = int_param(id, "horizon", s.horizon, 1, 1 << 20);
  s.telemetry.exact_beliefs = exact_beliefs(id, canonical);
  return std::make_unique<SimEnv>(std::move(s), canonical);
}

}  // namespace

StatusOr<std::unique_ptr<Env>> make_trace_env(const EnvId& id) {
  return catch_input_error([&] { return make_trace_env_or_throw(id); });
}

StatusOr<std::unique_ptr<Env>> make_sim_env(const EnvId& id) {
  return catch_input_error([&] { return make_sim_env_or_throw(id); });
}

}  // namespace parapilot::env
