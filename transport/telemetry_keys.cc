#include "transport/telemetry_keys.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <string>

namespace parapilot::transport::telemetry_keys {

bool is_info(std::string_view key) { return key.starts_with("info/"); }

void set_info(Telemetry& t, const char* key, std::uint64_t value) {
  assert(is_info(key) && std::string_view(key) != kLoss);  // kLoss goes through set_loss
  t.counts[key] = value;
}

std::optional<std::uint64_t> info(const Telemetry& t, const char* key) {
  assert(is_info(key));
  const auto it = t.counts.find(key);
  if (it == t.counts.end()) return std::nullopt;
  return it->second;
}

void set_loss(Telemetry& t, double loss) {
  if (std::isfinite(loss)) t.measures[kLoss] = loss;
  else t.measures.erase(kLoss);
}

std::optional<double> loss(const Telemetry& t) {
  const auto it = t.measures.find(kLoss);
  if (it == t.measures.end()) return std::nullopt;
  return it->second;
}

std::string block_ms_key(std::size_t block) { return kBlockMsPrefix + std::to_string(block); }

void set_block_ms(Telemetry& t, std::size_t block, double ms) {
  if (std::isfinite(ms) && ms >= 0.0) t.measures[block_ms_key(block)] = ms;
  else t.measures.erase(block_ms_key(block));
}

std::optional<double> block_ms(const Telemetry& t, std::size_t block) {
  const auto it = t.measures.find(block_ms_key(block));
  if (it == t.measures.end()) return std::nullopt;
  return it->second;
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
