// transport/telemetry_keys.h replays tests/data/telemetry_keys/vectors.json, the same vectors
// python/parapilot/telemetry_keys.py replays (tests/python/test_telemetry_keys.py): both sides
// spell each key and store each fact the same way. ("script_keys_python_only": the Python
// client's keys for a script's own collectives, which C++ never sends.)
#include "transport/telemetry_keys.h"

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace keys = parapilot::transport::telemetry_keys;
using parapilot::transport::CollectiveStat;
using parapilot::transport::Telemetry;

namespace {

nlohmann::json vectors() {
  const auto path =
      std::filesystem::path(PARAPILOT_TEST_DATA_DIR) / "telemetry_keys" / "vectors.json";
  std::ifstream in(path);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

template <class T>
std::map<std::string, T> entries(const nlohmann::json& j) {
  std::map<std::string, T> out;
  for (const auto& [key, v] : j.items()) out[key] = v.template get<T>();
  return out;
}

}  // namespace

TEST_CASE("every key is spelled as the shared vectors spell it") {
  const std::map<std::string, const char*> constants{
      {"ALL_REDUCE_DP", keys::kAllReduceDp},
      {"ALL_GATHER_DP", keys::kAllGatherDp},
      {"ALL_REDUCE_DP_INTER", keys::kAllReduceDpInter},
      {"ALL_REDUCE_TP", keys::kAllReduceTp},
      {"P2P_PP", keys::kP2pPp},
      {"ALL_REDUCE_CONTROL", keys::kAllReduceControl},
      {"ARRIVE_DP", keys::kArriveDp},
      {"BROADCAST_BUFFERS", keys::kBroadcastBuffers},
      {"WAIT_DP", keys::kWaitDp},
      {"WAIT_OTHER", keys::kWaitOther},
      {"PHASE_FORWARD", keys::kPhaseForward},
      {"PHASE_BACKWARD", keys::kPhaseBackward},
      {"PHASE_COMM_WAIT", keys::kPhaseCommWait},
      {"PHASE_OPTIMIZER", keys::kPhaseOptimizer},
      {"SWITCH_LAYOUT", keys::kSwitchLayout},
      {"PLAN", keys::kPlan},
      {"SAMPLES", keys::kSamples},
      {"MICROBATCHES", keys::kMicrobatches},
      {"MICROBATCHES_TOTAL", keys::kMicrobatchesTotal},
      {"LOSS", keys::kLoss},
      {"REPLICA", keys::kReplica},
      {"STAGE", keys::kStage},
      {"FIRST_BLOCK", keys::kFirstBlock},
      {"BLOCKS", keys::kBlocks},
      {"BLOCK_MS_PREFIX", keys::kBlockMsPrefix}};
  const nlohmann::json v = vectors();
  CHECK(v.at("keys").size() == constants.size());
  for (const auto& [name, key] : v.at("keys").items()) {
    CAPTURE(name);
    REQUIRE(constants.count(name) == 1);
    CHECK(constants.at(name) == key.get<std::string>());
    CHECK(keys::is_info(constants.at(name)) == key.get<std::string>().starts_with("info/"));
  }
}

TEST_CASE("a block's compute key is spelled as the shared vectors spell it") {
  const nlohmann::json v = vectors();
  REQUIRE(v.at("block_ms_keys").size() >= 2);
  for (const auto& [block, key] : v.at("block_ms_keys").items()) {
    CAPTURE(block);
    CHECK(keys::block_ms_key(std::stoul(block)) == key.get<std::string>());
  }
}

TEST_CASE("each fact is stored and read back as the shared vectors say") {
  const nlohmann::json v = vectors();
  REQUIRE(v.at("facts").size() >= 8);
  for (const nlohmann::json& f : v.at("facts")) {
    CAPTURE(f.dump());
    Telemetry t;
    const std::string set = f.at("set");
    if (set == "info") {
      const std::string key = f.at("key");
      keys::set_info(t, key.c_str(), f.at("value").get<std::uint64_t>());
      CHECK(keys::info(t, key.c_str()) == f.at("read").get<std::uint64_t>());
    } else if (set == "loss") {
      keys::set_loss(t, f.at("value").get<double>());
      REQUIRE(keys::loss(t).has_value());
      CHECK(*keys::loss(t) == f.at("read").get<double>());
    } else if (set == "block_ms") {
      const std::size_t block = f.at("block").get<std::size_t>();
      keys::set_block_ms(t, block, f.at("value").get<double>());
      REQUIRE(keys::block_ms(t, block).has_value());
      CHECK(*keys::block_ms(t, block) == f.at("read").get<double>());
    } else {
      REQUIRE(set == "replica_and_stage");
      keys::set_replica_and_stage(t, f.at("value")[0].get<std::uint64_t>(),
                                  f.at("value")[1].get<std::uint64_t>());
      CHECK(keys::info(t, keys::kReplica) == f.at("read")[0].get<std::uint64_t>());
      CHECK(keys::info(t, keys::kStage) == f.at("read")[1].get<std::uint64_t>());
    }
    CHECK(t.counts == entries<std::uint64_t>(f.at("counts")));
    CHECK(t.measures == entries<double>(f.at("measures")));
    CHECK(t.collectives.empty());
  }
}

TEST_CASE("a diverged step's loss is not reported, and a later finite one replaces it") {
  Telemetry t;
  keys::set_loss(t, 1.5);
  keys::set_loss(t, std::numeric_limits<double>::quiet_NaN());
  CHECK_FALSE(keys::loss(t).has_value());
  keys::set_loss(t, std::numeric_limits<double>::infinity());
  CHECK(t.measures.empty());
  keys::set_loss(t, -0.5);
  CHECK(keys::loss(t) == -0.5);
}

TEST_CASE("a block's non-finite or negative compute is not reported") {
  Telemetry t;
  keys::set_block_ms(t, 3, 2.0);
  keys::set_block_ms(t, 3, std::numeric_limits<double>::quiet_NaN());
  CHECK_FALSE(keys::block_ms(t, 3).has_value());
  keys::set_block_ms(t, 4, -1.0);
  CHECK(t.measures.empty());
  keys::set_block_ms(t, 4, 1.0);
  CHECK_FALSE(keys::block_ms(t, 3).has_value());
  CHECK(keys::block_ms(t, 4) == 1.0);
}

TEST_CASE("a fact or timing the telemetry does not carry reads as absent") {
  Telemetry t;
  t.collectives[keys::kWaitDp] = {1.5, 0, 1};
  CHECK_FALSE(keys::info(t, keys::kSamples).has_value());
  CHECK_FALSE(keys::loss(t).has_value());
  CHECK(keys::timing(t, keys::kWaitOther) == nullptr);
  REQUIRE(keys::timing(t, keys::kWaitDp) != nullptr);
  CHECK(keys::timing(t, keys::kWaitDp)->ms == 1.5);
}
