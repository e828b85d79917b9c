#include "env/registry.h"

#include <cassert>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

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
}

void ensure_builtins() {
  static std::once_flag once;
  std::call_once(once, register_builtin_envs);
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

EnvId parse_or_throw(const std::string& id) {
  EnvId out;
  if (id.size() > 5 && id.compare(id.size() - 5, 5, ".toml") == 0) {
    out.name = "sim";
    out.variant = id.rfind("sim:", 0) == 0 ? id.substr(4) : id;  // the file, named or not as sim:
    return out;
  }
  const auto colon = id.find(':');
  const auto paren = id.find('(');
  out.name = trim(id.substr(0, std::min(colon, paren)));
  if (out.name.empty()) throw InputError("env \"" + id + "\": missing a name (e.g. sim:straggler)");
  if (colon != std::string::npos && (paren == std::string::npos || colon < paren)) {
    out.variant = trim(id.substr(colon + 1, paren == std::string::npos ? std::string::npos
                                                                         : paren - colon - 1));
  }
  if (paren != std::string::npos) {
    if (id.back() != ')') throw InputError("env \"" + id + "\": parameters must end with ')'");
    const std::string inner = id.substr(paren + 1, id.size() - paren - 2);
    size_t start = 0;
    while (start <= inner.size()) {
      const auto comma = inner.find(',', start);
      const std::string item = trim(inner.substr(start, comma - start));
      if (!item.empty()) {
        const auto eq = item.find('=');
        if (eq == std::string::npos || eq == 0) {
          throw InputError("env \"" + id + "\": parameter \"" + item + "\" is not key=value");
        }
        out.params[trim(item.substr(0, eq))] = trim(item.substr(eq + 1));
      }
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
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
  return factory(parsed);
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

std::vector<std::string> split_ids(const std::string& list) {
  std::vector<std::string> out;
  std::string item;
  int depth = 0;  // commas inside parentheses belong to an id's parameters
  for (char c : list) {
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (c == ',' && depth == 0) {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else {
      item.push_back(c);
    }
  }
  if (!item.empty()) out.push_back(item);
  return out;
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
