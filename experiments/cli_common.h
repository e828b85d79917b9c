// Shared pieces of the parapilot CLI: output helpers, atomic file writes, JSON of specs.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "strategy/atomic_file.h"
#include "strategy/cost_model.h"
#include "strategy/error.h"
#include "strategy/strategy.h"

namespace parapilot::cli {

// A library's Status meets the command line through check() and take() (strategy/error.h):
// InputError, exit code 2; kInternal, exit code 1.

nlohmann::json to_json(const Strategy& s);
nlohmann::json to_json(const CostBreakdown& b);  // the metrics of `simulate --json`

// "dp=2 tp=8 pp=1 sp mb=1 gb=256 1f1b recompute=selective zero=1 ..."
std::string describe(const Strategy& s);

}  // namespace parapilot::cli
