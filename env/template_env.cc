#include "env/template_env.h"

#include <filesystem>

#include "env/sim/sim_env.h"
#include "env/trace/telemetry.h"
#include "env/trace/trace_analysis.h"
#include "strategy/spec_io.h"
#include "strategy/error.h"

namespace parapilot::env {

BanditEnv::BanditEnv(int horizon, int best, double noise)
    : horizon_(horizon), best_(best), noise_(noise) {}

std::string BanditEnv::id() const {
  return "bandit(horizon=" + std::to_string(horizon_) + ",best=" + std::to_string(best_) + ")";
}

Observation BanditEnv::reset(uint64_t seed, const ResetOptions& /*options*/) {
  rng_.seed(seed);
  t_ = 0;
  Observation o;
  o.state[0] = 1.0f;  // a constant observation: the best arm never changes
  o.mask.fill(1);
  return o;
}

StepResult BanditEnv::step(int action) {
  StepResult r;
  const int arm = action >= 0 && action < kNumActions ? action : 0;
  r.reward = mean(arm) + std::normal_distribution<double>(0.0, noise_)(rng_);
  r.info.interval = t_;
  r.info.tokens = r.reward;
  r.info.best_tokens = mean(best_);
  ++t_;
  r.truncated = t_ >= horizon_;
  r.observation.state[0] = 1.0f;
  r.observation.state[1] = static_cast<float>(static_cast<double>(t_) / horizon_);
  r.observation.mask.fill(1);
  return r;
}

std::optional<OracleResult> BanditEnv::oracle() {
  OracleResult o;
  o.tokens_per_interval.assign(horizon_, mean(best_));
  return o;
}

namespace {

int int_param(const EnvId& id, const std::string& key, int fallback, int min, int max) {
  auto it = id.params.find(key);
  if (it == id.params.end()) return fallback;
  try {
    size_t used = 0;
    const int v = std::stoi(it->second, &used);
    if (used == it->second.size() && v >= min && v <= max) return v;
  } catch (const std::exception&) {
  }
  throw InputError("env " + id.name + ": parameter " + key + " = \"" + it->second +
                   "\" must be an integer in [" + std::to_string(min) + ", " +
                   std::to_string(max) + "]");
}

void reject_unknown(const EnvId& id, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : id.params) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) throw InputError("env " + id.name + ": unknown parameter \"" + key + "\"");
  }
}

}  // namespace

void register_builtin_envs() {
  register_env("bandit", [](const EnvId& id) -> std::unique_ptr<Env> {
    reject_unknown(id, {"horizon", "best"});
    return std::make_unique<BanditEnv>(int_param(id, "horizon", 16, 1, 1 << 20),
                                       int_param(id, "best", 3, 0, kNumActions - 1), 0.1);
  });
  // Recorded reality: per-rank speeds of a per-op trace or telemetry recording become the
  // hidden conditions, one recorded interval per decision interval.
  register_env("trace", [](const EnvId& id) -> std::unique_ptr<Env> {
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
      recorded = trace::read_op_trace(id.variant, trace::read_job_meta(param("meta", "")));
    } else {
      const trace::TelemetryTrace t = trace::read_telemetry(id.variant);
      recorded = trace::telemetry_to_op_trace(
          t, id.params.count("meta") ? trace::read_job_meta(param("meta", "")) : trace::telemetry_layout(t));
    }
    const int world = recorded.meta.world_size;
    const std::string gpu = param("gpu", "a100-80g");
    const std::string cluster = world <= 8 ? std::to_string(world) + "x" + gpu
                                           : std::to_string((world + 7) / 8) + "x8x" + gpu;
    Scenario s = builtin_scenario(Family::kStraggler, 8);
    s.name = "trace";
    s.model = load_model(param("model", "llama2-7b"));
    s.cluster = load_cluster(cluster);
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
  });
  register_env("sim", [](const EnvId& id) -> std::unique_ptr<Env> {
    reject_unknown(id, {"gpus", "horizon"});
    if (id.variant.empty()) {
      throw InputError("env sim: name a scenario family (sim:straggler) or a scenario .toml");
    }
    Scenario s;
    if (id.variant.find(".toml") != std::string::npos) {
      s = load_scenario(id.variant);
      if (id.params.count("gpus")) {
        throw InputError("env " + id.variant + ": gpus is set in the scenario file");
      }
    } else {
      s = builtin_scenario(parse_family(id.variant), int_param(id, "gpus", 64, 8, 1 << 16));
    }
    s.horizon = int_param(id, "horizon", s.horizon, 1, 1 << 20);
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
    return std::make_unique<SimEnv>(std::move(s), canonical);
  });
}

}  // namespace parapilot::env
