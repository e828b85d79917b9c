// Shared pieces of the parapilot CLI: output helpers, atomic file writes, JSON of specs.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "strategy/cost_model.h"
#include "strategy/error.h"
#include "strategy/strategy.h"

namespace parapilot::cli {

/// Where a library's Status meets the command line: throws InputError (exit code 2) with the
/// message for a failure caused by what the user gave or by the world outside (every code but
/// kInternal), std::logic_error (exit code 1, a bug) for kInternal; nothing for OK.
void check(const Status& status);
/// The value of `result`, or check()'s exception.
template <class T>
T take(StatusOr<T> result) {
  check(result.status());
  return std::move(result).value();
}

// Writes a file via a temporary in the same directory, fsync and rename, so a reader never
// sees it half-written. `write` fills the stream. Throws InputError when the path is unusable.
void write_file_atomically(const std::string& path,
                           const std::function<void(std::ostream&)>& write);

nlohmann::json to_json(const Strategy& s);
nlohmann::json to_json(const CostBreakdown& b);  // the metrics of `simulate --json`

// "dp=2 tp=8 pp=1 sp mb=1 gb=256 1f1b recompute=selective zero=1 ..."
std::string describe(const Strategy& s);

}  // namespace parapilot::cli
