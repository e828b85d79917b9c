// Feature-distribution conformance: the shipped policy, run on every registered env it is meant
// for, receives only inputs inside the range its training produced (Policy::check_inputs). A
// deployed policy fed values it never saw acts on extrapolation; this is where it shows first.
#include <doctest/doctest.h>

#include <cstdio>
#include <map>
#include <string>

#include "agent/train/evaluate.h"
#include "env/env.h"
#include "policy/loader.h"
#include "tests/test_util.h"

using parapilot::testing::failure_of;
using parapilot::testing::ok;

namespace {

const std::string kTraceDir = std::string(PARAPILOT_TEST_DATA_DIR) + "/traces/bytedance-ST/";

// Registered envs and the ids they run under here. `bandit` is the trainer's own test env: its
// observations are synthetic, and no deployed policy meets them. `dp` offers batch-share
// candidates to the data-parallel decider's policy, and `pp` a pipeline's splits (blocks per
// stage, with a block transfer's switch cost) to the same decider's; the shipped policy trains on
// both (dp:random, pp:random).
const std::map<std::string, std::vector<std::string>> kEnvs = {
    {"sim",
     {"sim:straggler", "sim:congestion", "sim:hetero", "sim:failure", "sim:phase", "sim:mixed"}},
    {"trace", {"trace:" + kTraceDir + "trace-ST.csv(meta=" + kTraceDir + "meta-ST.yaml)"}},
    {"dp", {"dp:straggler", "dp:comm", "dp:flap", "dp:mixed"}},
    {"pp", {"pp:straggler", "pp:comm", "pp:flap", "pp:mixed"}},
};
const char* kNotForPolicies[] = {"bandit"};

}  // namespace

TEST_CASE("conformance: every registered env is listed for the input check or says why not") {
  for (const auto& name : parapilot::env::registered_envs()) {
    bool listed = kEnvs.count(name) > 0;
    for (const char* n : kNotForPolicies) listed = listed || name == n;
    CHECK_MESSAGE(listed, name);
  }
}

TEST_CASE("conformance: on every env, the shipped policy's inputs stay inside the range its "
          "training produced") {
  auto shipped = parapilot::policy::load_policy(parapilot::policy::default_policy_path());
  REQUIRE_MESSAGE(shipped.ok(), shipped.status().message());
  auto policy = std::move(*shipped);
  for (const auto& [name, ids] : kEnvs) {
    for (const std::string& id : ids) {
      auto env = ok(parapilot::env::make_env(id));
      std::map<std::string, int> unseen, clipped;
      for (uint64_t seed = 2000; seed < 2003; ++seed) {
        const auto stats = ok(parapilot::agent::run_episode(*env, *policy, seed));
        for (const auto& [input, n] : stats.unseen_inputs) unseen[input] += n;
        for (const auto& [input, n] : stats.clipped_inputs) clipped[input] += n;
      }
      std::string list;
      for (const auto& [input, n] : unseen) list += " " + input + "=" + std::to_string(n);
      std::printf("%s: %zu inputs outside training's range%s\n", id.c_str(), unseen.size(),
                  list.c_str());
      INFO(id << ": outside the range training produced:" << list);
      CHECK(unseen.empty());
      // Inside a feature's range the normaliser never clips (ObservationNormalizer).
      CHECK(clipped.empty());
    }
  }
}
