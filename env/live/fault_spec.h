// FaultSpec: a fault injected into a local cluster (parapilot launch --inject), and its parser.
// No libtorch here.
//
// Thread-safety: a plain value and a pure function (defined in action.cc with the other parsers
// of the live cluster's inputs).
#pragma once

#include <cstdint>
#include <limits>
#include <string_view>

#include "core/status.h"

namespace parapilot::live {

/// A fault injected into a local cluster (parapilot launch --inject).
struct FaultSpec {
  enum class Kind { slow, link_delay, kill, link_cut };
  int rank = 0;
  Kind kind = Kind::slow;
  double factor = 1;    ///< slow: compute takes this many times as long (>= 1).
  double delay_ms = 0;  ///< link-delay: added before each collective call.
  double at_s = 0;      ///< start, seconds after launch.
  double for_s = std::numeric_limits<double>::infinity();  ///< duration (slow, link-delay).
  /// slow, link-delay: start at this training step instead of at_s (-1: at_s applies), for
  /// for_steps steps (-1: to the end). A step does not depend on how fast the host runs.
  /// link-cut: the step at whose boundary the rank's links to its peers are cut (always set).
  std::int64_t at_step = -1;
  std::int64_t for_steps = -1;
};
/// Parses "rank=2,slow=3x,at=100s,for=60s", "rank=2,slow=3x,at=20steps,for=10steps",
/// "rank=1,link-delay=20ms", "rank=3,kill,at=50s" (a kill's time is in seconds),
/// "rank=1,link-cut,at=30steps" (a link cut's time is a step, and it has no duration).
/// kInvalidArgument quoting the spec and naming the bad key.
StatusOr<FaultSpec> parse_fault(std::string_view spec);

}  // namespace parapilot::live
