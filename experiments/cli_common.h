// Shared pieces of the parapilot CLI: output helpers, atomic file writes, JSON of specs.
#pragma once

#include <functional>
#include <iosfwd>
#include <cstdint>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "core/atomic_file.h"
#include "strategy/cost_model.h"
#include "core/error.h"
#include "strategy/strategy.h"

namespace parapilot::cli {

// A library's Status meets the command line through check() and take() (core/error.h):
// InputError, exit code 2; kInternal, exit code 1.

nlohmann::json to_json(const Strategy& s);
nlohmann::json to_json(const CostBreakdown& b);  // the metrics of `simulate --json`

// "dp=2 tp=8 pp=1 sp mb=1 gb=256 1f1b recompute=selective zero=1 ..."
std::string describe(const Strategy& s);

// A bus address given to `flag`: "HOST:PORT", ":PORT" or "PORT" (host 127.0.0.1). Throws
// InputError naming the flag and the text unless the port is in 0..65535 (1..65535 when
// port_required: an address to connect to).
std::pair<std::string, uint16_t> parse_address(const std::string& flag, const std::string& text,
                                               bool port_required);

}  // namespace parapilot::cli
