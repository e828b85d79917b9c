#include "transport/telemetry_keys.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <string>

namespace parapilot::transport::telemetry_keys {

bool is_info(std::string_view key) { return key.starts_with("info/"); }

void set_info(Telemetry& t, const char* key, std::uint64_t value) {
  assert(is_info(key) && std::string_view(key) != kLoss);  // kLoss goes through set_loss
  t.collectives[key] = CollectiveStat{0, value, 0};
}

std::optional<std::uint64_t> info(const Telemetry& t, const char* key) {
  assert(is_info(key));
  const auto it = t.collectives.find(key);
  if (it == t.collectives.end()) return std::nullopt;
  return it->second.bytes;
}

void set_loss(Telemetry& t, double loss) {
  const double sent = std::isfinite(loss) ? std::max(0.0, loss) : 0.0;
  t.collectives[kLoss] = CollectiveStat{0, static_cast<std::uint64_t>(sent * 1e6), 0};
}

std::optional<double> loss(const Telemetry& t) {
  const auto it = t.collectives.find(kLoss);
  if (it == t.collectives.end()) return std::nullopt;
  return static_cast<double>(it->second.bytes) / 1e6;
}

void set_replica_and_stage(Telemetry& t, std::uint64_t replica, std::uint64_t stage) {
  set_info(t, kReplica, replica);
  set_info(t, kStage, stage);
}

const CollectiveStat* timing(const Telemetry& t, const char* key) {
  assert(!is_info(key));
  const auto it = t.collectives.find(key);
  return it == t.collectives.end() ? nullptr : &it->second;
}

}  // namespace parapilot::transport::telemetry_keys
