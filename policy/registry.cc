#include "policy/registry.h"

#include <cassert>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "core/id.h"
#include "policy/baselines.h"
#include "policy/lookahead.h"

namespace parapilot::policy {

namespace {

struct Entry {
  PolicyInfo info;
  PolicyFactory factory;
};

std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> entries;
  return entries;
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

// A rule: no parameters, no env needed.
void register_rule(const std::string& name, const std::string& description,
                   std::function<std::unique_ptr<Policy>()> make) {
  register_policy({name, description, {}, {}},
                  [make](const PolicyArgs&, const env::Env*) -> StatusOr<std::unique_ptr<Policy>> {
                    return make();
                  });
}

void register_lookahead() {
  const LookaheadOptions d;
  PolicyInfo info;
  info.name = "lookahead";
  info.description =
      "Monte-Carlo look-ahead over K sampled futures of H intervals (Parcae); simulator envs only";
  info.params = {
      {"k", ParamType::kInteger, std::to_string(d.futures), 1, 100000, {}, "futures per decision"},
      {"h", ParamType::kInteger, std::to_string(d.intervals), 1, 100000, {},
       "intervals each future spans"},
      {"min_gain", ParamType::kNumber, "1.02", 1, 10, {},
       "switch when the best switch's expected tokens are this x keeping's"},
      {"seed", ParamType::kInteger, std::to_string(d.seed), 0, 9007199254740992.0, {},
       "seed of the sampled futures"},
      {"dynamics", ParamType::kChoice, "own", 0, 0, {"own", "family"},
       "whose dynamics the futures follow: the scenario's own or its family's"},
  };
  info.capabilities.needs_planning_view = true;
  register_policy(info, [](const PolicyArgs& args, const env::Env* env) {
    return make_lookahead(*env, lookahead_options(args));
  });
}

void register_measured_shares() {
  const MeasuredSharesOptions d;
  assert(d.min_gain == 1.1);  // the declared default below
  PolicyInfo info;
  info.name = "measured-shares";
  info.description =
      "switch to the best candidate once its predicted gain reaches min_gain for confirm "
      "decisions in a row (deploy's rule for data-parallel jobs)";
  info.params = {
      {"min_gain", ParamType::kNumber, "1.1", 1, 10, {},
       "predicted throughput ratio a switch must reach"},
      {"confirm", ParamType::kInteger, std::to_string(d.confirm_decisions), 1,
       env::kSwitchMemoryIntervals, {}, "decisions in a row the condition must hold"},
  };
  register_policy(info, [](const PolicyArgs& args, const env::Env*) -> StatusOr<std::unique_ptr<Policy>> {
    MeasuredSharesOptions o;
    o.min_gain = args.number("min_gain");
    o.confirm_decisions = static_cast<int>(args.number("confirm"));
    return make_measured_shares(o);
  });
}

void register_builtin_policies() {
  register_rule("static", "plan once from the nominal specs, never change",
                [] { return make_static(); });
  register_rule("uniform-dp", "pure data parallel with equal shares, never change",
                [] { return make_uniform_dp(); });
  register_rule("reactive",
                "re-plan on changed beliefs; switch when the gain over a look-ahead pays for the "
                "migration, with hysteresis and a cool-down",
                [] { return make_reactive({}); });
  register_rule("reactive-tuned", "reactive with the parameters tuned on training seeds",
                [] { return make_reactive_tuned(); });
  register_rule("threshold",
                "switch when the gain left after amortising the migration is >= 5% (Pollux)",
                [] { return make_threshold({}); });
  register_rule("ski-rental",
                "switch once the throughput lost since a slowdown began pays for the switch "
                "(Greyhound)",
                [] { return make_ski_rental({}); });
  register_lookahead();
  register_measured_shares();
  PolicyInfo oracle;
  oracle.name = "oracle";
  oracle.description = "the hindsight oracle: the best layout per interval, knowing the future";
  oracle.capabilities.hindsight = true;
  register_policy(oracle, nullptr);
}

void ensure_builtins() {
  static std::once_flag once;
  std::call_once(once, register_builtin_policies);
}

std::string known_names() {
  std::string known;
  for (const auto& [name, entry] : registry()) known += (known.empty() ? "" : ", ") + name;
  return known;
}

std::string param_names(const PolicyInfo& info) {
  std::string names;
  for (const PolicyParam& p : info.params) names += (names.empty() ? "" : ", ") + p.name;
  return names.empty() ? "none" : names;
}

std::string format_number(double v) {
  std::ostringstream out;
  out.precision(17);
  out << v;
  return out.str();
}

// "" when `value` is valid for `p`; else what is allowed.
std::string check_value(const PolicyParam& p, const std::string& value) {
  switch (p.type) {
    case ParamType::kText:
      return "";
    case ParamType::kChoice: {
      std::string allowed;
      for (const std::string& c : p.choices) {
        if (c == value) return "";
        allowed += (allowed.empty() ? "" : " or ") + c;
      }
      return "must be " + allowed;
    }
    case ParamType::kInteger:
    case ParamType::kNumber: {
      char* end = nullptr;
      const double v = std::strtod(value.c_str(), &end);
      const bool whole = p.type == ParamType::kInteger;
      const bool ok = !value.empty() && *end == '\0' && v >= p.min && v <= p.max &&
                      (!whole || v == std::floor(v));
      if (ok) return "";
      return std::string("must be ") + (whole ? "a whole number" : "a number") + " in [" +
             format_number(p.min) + ", " + format_number(p.max) + "]";
    }
  }
  return "";
}

PolicyArgs parse_or_throw(const std::string& id) {
  const ParsedId parsed = parse_id_or_throw(id, "policy", "reactive");
  ensure_builtins();
  PolicyInfo info;
  {
    std::lock_guard lock(registry_mutex());
    const auto it = registry().find(parsed.name);
    if (it == registry().end()) {
      throw InputError("policy \"" + id + "\": unknown policy \"" + parsed.name +
                       "\" (registered: " + known_names() + ")");
    }
    info = it->second.info;
  }
  if (!parsed.variant.empty()) {
    const std::string key = info.params.empty() ? "KEY" : info.params.front().name;
    throw InputError("policy \"" + id + "\": a policy takes parameters in parentheses, not after "
                     "':' (write " + parsed.name + "(" + key + "=" + parsed.variant + "))");
  }
  std::map<std::string, std::string> values;
  for (const PolicyParam& p : info.params) values[p.name] = p.default_value;
  for (const auto& [key, value] : parsed.params) {
    const PolicyParam* param = nullptr;
    for (const PolicyParam& p : info.params) param = p.name == key ? &p : param;
    if (!param) {
      throw InputError("policy \"" + id + "\": unknown parameter \"" + key + "\" (" + info.name +
                       " takes: " + param_names(info) + ")");
    }
    if (const std::string allowed = check_value(*param, value); !allowed.empty()) {
      throw InputError("policy \"" + id + "\": parameter " + key + " = \"" + value + "\" " +
                       allowed);
    }
    values[key] = value;
  }
  return PolicyArgs(std::move(info), id, std::move(values));
}

}  // namespace

const std::string& PolicyArgs::text(const std::string& key) const {
  const auto it = values_.find(key);
  assert(it != values_.end());  // precondition: a declared parameter
  return it->second;
}

double PolicyArgs::number(const std::string& key) const {
  return std::strtod(text(key).c_str(), nullptr);
}

void register_policy(PolicyInfo info, PolicyFactory factory) {
  assert(!factory == info.capabilities.hindsight);  // precondition
  for ([[maybe_unused]] const PolicyParam& p : info.params) {
    assert(check_value(p, p.default_value).empty());  // precondition: valid defaults
  }
  std::lock_guard lock(registry_mutex());
  const std::string name = info.name;
  [[maybe_unused]] const bool added =
      registry().emplace(name, Entry{std::move(info), std::move(factory)}).second;
  assert(added);  // precondition: one policy per name
}

StatusOr<PolicyArgs> parse_policy(const std::string& id) {
  return catch_input_error([&] { return parse_or_throw(id); });
}

StatusOr<std::unique_ptr<Policy>> make_policy(const std::string& id, const env::Env* env) {
  const StatusOr<PolicyArgs> args = parse_policy(id);
  if (!args.ok()) return args.status();
  const PolicyCapabilities& can = args->info().capabilities;
  if (can.hindsight) {
    return Status::invalid_argument("policy \"" + id +
                                    "\": sees the future, so the env computes it "
                                    "(Env::oracle); it is not run as a policy");
  }
  if (can.needs_planning_view && !env) {
    return Status::invalid_argument("policy \"" + id +
                                    "\": needs the env it runs on (a simulator env with a "
                                    "planning view)");
  }
  PolicyFactory factory;
  {
    std::lock_guard lock(registry_mutex());
    factory = registry().at(args->info().name).factory;
  }
  return factory(*args, env);
}

StatusOr<PolicyArgs> parse_policy_or_checkpoint(const std::string& value) {
  ensure_builtins();
  const std::string name = value.substr(0, value.find_first_of(":("));
  bool registered = false;
  {
    std::lock_guard lock(registry_mutex());
    registered = registry().count(name) > 0;
  }
  const bool path_like =
      value.find('/') != std::string::npos ||
      (value.size() > 5 && value.compare(value.size() - 5, 5, ".ckpt") == 0);
  if (!registered && path_like) return parse_policy("rl(path=" + value + ")");
  return parse_policy(value);
}

std::vector<PolicyInfo> registered_policies() {
  ensure_builtins();
  std::lock_guard lock(registry_mutex());
  std::vector<PolicyInfo> out;
  for (const auto& [name, entry] : registry()) out.push_back(entry.info);
  return out;
}

std::string describe_policies() {
  std::string out;
  for (const PolicyInfo& info : registered_policies()) {
    std::string params;
    for (const PolicyParam& p : info.params) {
      params += (params.empty() ? "" : ",") + p.name + "=" +
                (p.default_value.empty() ? "..." : p.default_value);
    }
    out += (out.empty() ? "" : "\n") + info.name + (params.empty() ? "" : "(" + params + ")") +
           ": " + info.description;
  }
  return out;
}

}  // namespace parapilot::policy
