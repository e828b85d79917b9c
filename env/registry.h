// The env registry: env ids name a registered factory, e.g. "sim:straggler(gpus=64)" or
// "bandit(horizon=16)". The built-in envs ("sim", "trace", "bandit", "dp") are registered on
// first use; other modules register theirs (env/live: "live") with register_env.
//
// Thread-safe: register_env, make_env and registered_envs may be called from any thread.
#pragma once

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/id.h"
#include "core/status.h"

namespace parapilot::env {

class Env;

// Parameters of an env id (core/id.h): "sim:straggler(gpus=64,seed=3)" has name "sim", variant
// "straggler" and params {gpus: 64, seed: 3}.
using EnvId = ParsedId;
// Parses an env id; a path to a .toml scenario becomes {name: "sim", variant: PATH}.
// kInvalidArgument naming the id when malformed.
StatusOr<EnvId> parse_env_id(const std::string& id);

// Makes the env of a parsed id, or kInvalidArgument naming the bad id or parameter; it never
// throws. The parameter helpers below are parser pieces that throw InputError: a factory built
// on them wraps its body in catch_input_error (core/error.h), as the built-in ones do.
using EnvFactory = std::function<StatusOr<std::unique_ptr<Env>>(const EnvId&)>;

// Registers a factory under a name. Precondition: no factory has that name yet.
void register_env(const std::string& name, EnvFactory factory);
// Makes an env from an id (see parse_env_id): kInvalidArgument naming the id for an unknown
// name or a bad parameter.
StatusOr<std::unique_ptr<Env>> make_env(const std::string& id);
std::vector<std::string> registered_envs();
// Splits a comma-separated list of ids at the commas outside parentheses (core/id.h).
using parapilot::split_ids;

// Parameter helpers for factories. int_param and double_param return params[key] as a number
// in [min, max], or `fallback` when absent; str_param the text or `fallback`; reject_unknown
// refuses keys outside `known`. Inside a factory: they throw InputError naming the env and the
// parameter.
int int_param(const EnvId& id, const std::string& key, int fallback, int min, int max);
double double_param(const EnvId& id, const std::string& key, double fallback, double min,
                    double max);
std::string str_param(const EnvId& id, const std::string& key, const std::string& fallback);
void reject_unknown(const EnvId& id, std::initializer_list<const char*> known);

}  // namespace parapilot::env
