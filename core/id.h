// Ids: how a registered thing is named with its parameters, one grammar for envs
// (env/registry.h) and policies (policy/registry.h): NAME[:VARIANT][(KEY=VALUE,...)], e.g.
// "sim:straggler(gpus=64)" or "lookahead(k=8,h=4)".
//
// Thread-safety: pure functions.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace parapilot {

/// A parsed id: "sim:straggler(gpus=64,seed=3)" has name "sim", variant "straggler" and params
/// {gpus: 64, seed: 3}. Names, variants, keys and values are trimmed of blanks.
struct ParsedId {
  std::string name;
  std::string variant;
  std::map<std::string, std::string> params;
};

/// Parses `id`. A parser's helper: throws InputError (core/error.h) naming `kind` ("env",
/// "policy") and the id when the name is missing (the message suggests `example`), the
/// parameters do not end with ')' or an item is not key=value.
ParsedId parse_id_or_throw(const std::string& id, const std::string& kind,
                           const std::string& example);

/// Splits a comma-separated list of ids at the commas outside parentheses:
/// "sim:mixed(gpus=16,horizon=8),bandit" is two ids. Empty items are dropped.
std::vector<std::string> split_ids(const std::string& list);

}  // namespace parapilot
