#include "env/registry.h"

#include <cassert>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "env/dp/dp_env.h"
#include "env/env.h"
#include "env/sim/sim_env.h"
#include "env/template_env.h"
#include "core/error.h"

namespace parapilot::env {

namespace {

std::map<std::string, EnvFactory>& registry() {
  static std::map<std::string, EnvFactory> factories;
  return factories;
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

void register_builtin_envs() {
  register_env("sim", make_sim_env);
  register_env("trace", make_trace_env);
  register_env("bandit", make_bandit_env);
  register_env("dp", dp::make_dp_env);
  register_env("pp", dp::make_pp_env);
}

void ensure_builtins() {
  static std::once_flag once;
  std::call_once(once, register_builtin_envs);
}

EnvId parse_or_throw(const std::string& id) {
  if (id.size() > 5 && id.compare(id.size() - 5, 5, ".toml") == 0) {
    EnvId out;
    out.name = "sim";
    out.variant = id.rfind("sim:", 0) == 0 ? id.substr(4) : id;  // the file, named or not as sim:
    return out;
  }
  return parse_id_or_throw(id, "env", "sim:straggler");
}

std::unique_ptr<Env> make_or_throw(const std::string& id) {
  ensure_builtins();
  const EnvId parsed = parse_or_throw(id);
  EnvFactory factory;
  {
    std::lock_guard lock(registry_mutex());
    auto it = registry().find(parsed.name);
    if (it == registry().end()) {
      std::string known;
      for (const auto& [name, f] : registry()) known += (known.empty() ? "" : ", ") + name;
      throw InputError("env \"" + id + "\": unknown env \"" + parsed.name + "\" (registered: " +
                       known + ")");
    }
    factory = it->second;
  }
  return take(factory(parsed));
}

}  // namespace

StatusOr<EnvId> parse_env_id(const std::string& id) {
  return catch_input_error([&] { return parse_or_throw(id); });
}

void register_env(const std::string& name, EnvFactory factory) {
  std::lock_guard lock(registry_mutex());
  [[maybe_unused]] const bool added = registry().emplace(name, std::move(factory)).second;
  assert(added);  // precondition: one factory per name
}

std::vector<std::string> registered_envs() {
  ensure_builtins();
  std::lock_guard lock(registry_mutex());
  std::vector<std::string> names;
  for (const auto& [name, factory] : registry()) names.push_back(name);
  return names;
}

StatusOr<std::unique_ptr<Env>> make_env(const std::string& id) {
  return catch_input_error([&] { return make_or_throw(id); });
}


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

double double_param(const EnvId& id, const std::string& key, double fallback, double min,
                    double max) {
  auto it = id.params.find(key);
  if (it == id.params.end()) return fallback;
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end != '\0' || !(v >= min && v <= max)) {
    throw InputError("env " + id.name + ": parameter " + key + " = \"" + it->second +
                     "\" must be a number in [" + std::to_string(min) + ", " +
                     std::to_string(max) + "]");
  }
  return v;
}

std::string str_param(const EnvId& id, const std::string& key, const std::string& fallback) {
  auto it = id.params.find(key);
  return it == id.params.end() ? fallback : it->second;
}

void reject_unknown(const EnvId& id, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : id.params) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (!ok) throw InputError("env " + id.name + ": unknown parameter \"" + key + "\"");
  }
}

}  // namespace parapilot::env
