// The policy registry: policies are made by name with parameters, in the id grammar envs use
// (core/id.h): "static", "reactive", "lookahead(k=8,h=4)", "rl", "rl(path=FILE)". The rules
// (policy/baselines.h), lookahead (policy/lookahead.h) and the hindsight oracle are registered
// on first use; the learned policy "rl" is registered by register_learned_policies()
// (policy/loader.h), which needs libtorch. `parapilot eval` and `parapilot deploy` read their
// policy names here, and tests/policy/registry_test.cc runs every registered policy.
//
// Adding a policy: register_policy(info, factory) with a PolicyInfo that declares its
// parameters; the registry checks names and values before the factory runs.
//
// Errors: nothing throws out of this API; an unknown name, a variant (NAME:VARIANT), an unknown
// parameter or a bad value is kInvalidArgument naming the policy, the parameter and what is
// allowed. Thread-safe: every function may be called from any thread.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "env/env.h"
#include "policy/policy.h"

namespace parapilot::policy {

enum class ParamType {
  kInteger,  ///< a whole number in [min, max]
  kNumber,   ///< a number in [min, max]
  kChoice,   ///< one of `choices`
  kText,     ///< any text (a path)
};

/// One parameter a policy takes: "lookahead(k=8)" sets k.
struct PolicyParam {
  std::string name;
  ParamType type = ParamType::kText;
  std::string default_value;         ///< the value when absent ("" for a text that has none)
  double min = 0, max = 0;           ///< kInteger and kNumber: the allowed range, inclusive
  std::vector<std::string> choices;  ///< kChoice: the allowed values
  std::string help;                  ///< one line
};

/// What a caller must know about a policy before running it.
struct PolicyCapabilities {
  /// Reads the env's planning view (env/sim/planning_view.h): simulator envs only, and the env
  /// must be passed to make_policy (lookahead).
  bool needs_planning_view = false;
  /// Learned from a checkpoint, not a rule (rl): not a candidate for eval's default reference.
  bool learned = false;
  /// Sees the future: computed by the env (Env::oracle), never made as a Policy (oracle).
  bool hindsight = false;
};

struct PolicyInfo {
  std::string name;
  std::string description;  ///< one line
  std::vector<PolicyParam> params;
  PolicyCapabilities capabilities;
};

/// A policy id checked against its registration: every declared parameter holds a valid value
/// (the default when the id did not give one).
class PolicyArgs {
 public:
  PolicyArgs(PolicyInfo info, std::string id, std::map<std::string, std::string> values)
      : info_(std::move(info)), id_(std::move(id)), values_(std::move(values)) {}
  const PolicyInfo& info() const { return info_; }
  /// The id as written, e.g. "lookahead(k=8)".
  const std::string& id() const { return id_; }
  /// A declared parameter's value as text. Precondition: `key` is declared.
  const std::string& text(const std::string& key) const;
  /// A declared kInteger or kNumber parameter's value. Precondition: `key` is declared numeric.
  double number(const std::string& key) const;

 private:
  PolicyInfo info_;
  std::string id_;
  std::map<std::string, std::string> values_;
};

/// Makes the policy of checked args. `env` is the env it will run on, or null when none is
/// known; a factory whose info needs_planning_view is only called with an env. A failure is a
/// Status (kInvalidArgument naming the policy, or a loader's Status).
using PolicyFactory =
    std::function<StatusOr<std::unique_ptr<Policy>>(const PolicyArgs& args, const env::Env* env)>;

/// Registers a policy. Preconditions: no policy has info.name yet; the factory is null exactly
/// when info.capabilities.hindsight (such a policy is not made, its results come from the env);
/// every default value is valid for its parameter.
void register_policy(PolicyInfo info, PolicyFactory factory);

/// Parses and checks a policy id (see the header comment).
StatusOr<PolicyArgs> parse_policy(const std::string& id);

/// Makes a policy from an id, to run on `env` (null: no env; a policy that needs a planning view
/// is then refused). kInvalidArgument for a bad id, a hindsight policy (not made: ask the env),
/// or an env that cannot run it; a factory's Status otherwise.
StatusOr<std::unique_ptr<Policy>> make_policy(const std::string& id, const env::Env* env);

/// deploy's rule for a value that may be a checkpoint file: a value whose name (the text before
/// any ':' or '(') is no registered policy and that contains '/' or ends in ".ckpt" is read as
/// rl(path=VALUE); anything else is parse_policy(value).
StatusOr<PolicyArgs> parse_policy_or_checkpoint(const std::string& value);

/// Every registered policy, by name.
std::vector<PolicyInfo> registered_policies();

/// One line per registered policy, for --help: "NAME(PARAM=DEFAULT,...): description", the
/// lines joined by '\n' (no newline at the end).
std::string describe_policies();

}  // namespace parapilot::policy
