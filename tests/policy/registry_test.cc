// Policy registry conformance: every registered policy, made by name from the registry on a
// simulator env, returns an action its observation's mask allows under random masks (keep-only
// included) over whole episodes, and is deterministic per seed. The test iterates the registry,
// so a policy registered later is covered without a change here.
#include <doctest/doctest.h>

#include <random>
#include <string>
#include <vector>

#include "env/env.h"
#include "env/registry.h"
#include "policy/loader.h"
#include "policy/registry.h"
#include "tests/test_util.h"

using parapilot::testing::failure_of;
using parapilot::testing::ok;

namespace pp = parapilot::policy;
namespace env = parapilot::env;

namespace {

const char* kEnvId = "sim:mixed(gpus=16,horizon=12)";

// One episode of `policy` from `seed`, each observation's mask narrowed at random to a subset of
// the present candidates (every fourth decision keep-only). Returns the actions; counts in
// `checked` the decisions whose action was checked against the mask it was shown.
std::vector<int> masked_episode(env::Env& e, pp::Policy& policy, uint64_t seed, int& checked) {
  std::mt19937_64 rng(seed * 7919 + 1);
  std::vector<int> actions;
  policy.begin_episode();
  env::Observation obs = ok(e.reset(seed, policy.reset_options()));
  for (int t = 0;; ++t) {
    env::Observation shown = obs;
    for (int k = 0; k < env::kMaxCandidates; ++k) {
      const bool keep_only = t % 4 == 3;
      shown.mask[k] = !keep_only && shown.mask[k] && rng() % 2 == 0 ? 1 : 0;
    }
    const int a = policy.act(shown);
    INFO(policy.name() << " at interval " << t << ": action " << a);
    REQUIRE(a >= 0);
    REQUIRE(a < env::kNumActions);
    CHECK_MESSAGE((a == 0 || shown.mask[a - 1] == 1), "a masked-out candidate");
    ++checked;
    actions.push_back(a);
    const env::StepResult r = e.step(a);
    obs = r.observation;
    if (r.terminated || r.truncated) break;
  }
  return actions;
}

}  // namespace

TEST_CASE("registry conformance: every registered policy acts inside any mask, deterministically") {
  pp::register_learned_policies();
  const auto policies = pp::registered_policies();
  REQUIRE_MESSAGE(!policies.empty(), "the policy registry is empty");
  auto e = ok(env::make_env(kEnvId));
  int made = 0;
  for (const pp::PolicyInfo& info : policies) {
    INFO("policy " << info.name);
    CHECK(!info.description.empty());
    if (info.capabilities.hindsight) {
      // Not a Policy: the env computes it, and make_policy says so.
      CHECK(failure_of(pp::make_policy(info.name, e.get())).find(info.name) != std::string::npos);
      CHECK(e->oracle().has_value());
      continue;
    }
    if (info.capabilities.needs_planning_view) {
      CHECK(failure_of(pp::make_policy(info.name, nullptr)).find(info.name) != std::string::npos);
    }
    auto first = ok(pp::make_policy(info.name, e.get()));
    auto second = ok(pp::make_policy(info.name, e.get()));
    ++made;
    for (uint64_t seed : {3u, 4u}) {
      int checked = 0;
      const std::vector<int> a = masked_episode(*e, *first, seed, checked);
      const std::vector<int> b = masked_episode(*e, *second, seed, checked);
      const std::vector<int> again = masked_episode(*e, *first, seed, checked);
      CHECK(checked == 3 * e->horizon());
      CHECK(a == b);      // a fresh policy of the same id, same seed: same actions
      CHECK(a == again);  // the same policy, episode state cleared by begin_episode
    }
  }
  CHECK(made > 0);
}

TEST_CASE("registry: unknown names, variants and bad parameters are Statuses naming them") {
  pp::register_learned_policies();
  const std::string unknown = failure_of(pp::parse_policy("nosuch"));
  CHECK(unknown.find("\"nosuch\"") != std::string::npos);
  for (const pp::PolicyInfo& info : pp::registered_policies()) {
    CHECK(unknown.find(info.name) != std::string::npos);  // the allowed names are listed
  }
  // rl:PATH is not a checkpoint's spelling; the message gives rl(path=PATH).
  const std::string colon = failure_of(pp::parse_policy("rl:runs/a.ckpt"));
  CHECK(colon.find("rl(path=runs/a.ckpt)") != std::string::npos);
  const std::string param = failure_of(pp::parse_policy("static(k=1)"));
  CHECK(param.find("\"k\"") != std::string::npos);
  CHECK(param.find("static takes: none") != std::string::npos);
  CHECK(failure_of(pp::parse_policy("(k=1)")).find("missing a name") != std::string::npos);
  CHECK(failure_of(pp::make_policy("rl(path=/nonexistent/p.ckpt)", nullptr))
            .find("/nonexistent/p.ckpt") != std::string::npos);
  // A checked id keeps what was written and fills in the defaults.
  const pp::PolicyArgs rl = ok(pp::parse_policy("rl(path=a b.ckpt)"));
  CHECK(rl.info().capabilities.learned);
  CHECK(rl.text("path") == "a b.ckpt");
  CHECK(ok(pp::parse_policy("rl")).text("path").empty());
}

TEST_CASE("registry: deploy's rule reads a plain checkpoint path as rl(path=PATH)") {
  pp::register_learned_policies();
  CHECK(ok(pp::parse_policy_or_checkpoint("runs/x/best.ckpt")).id() == "rl(path=runs/x/best.ckpt)");
  CHECK(ok(pp::parse_policy_or_checkpoint("best.ckpt")).id() == "rl(path=best.ckpt)");
  CHECK(ok(pp::parse_policy_or_checkpoint("reactive")).id() == "reactive");
  CHECK(ok(pp::parse_policy_or_checkpoint("rl(path=a/b.ckpt)")).text("path") == "a/b.ckpt");
  CHECK(failure_of(pp::parse_policy_or_checkpoint("rl:a/b.ckpt")).find("rl(path=a/b.ckpt)") !=
        std::string::npos);
  CHECK(failure_of(pp::parse_policy_or_checkpoint("nosuch")).find("unknown policy") !=
        std::string::npos);
}

TEST_CASE("registry: the help lists every registered policy with its parameters") {
  pp::register_learned_policies();
  const std::string help = pp::describe_policies();
  for (const pp::PolicyInfo& info : pp::registered_policies()) {
    CHECK(help.find(info.name) != std::string::npos);
  }
  CHECK(help.find("lookahead(k=32,h=12,min_gain=1.02,seed=1,dynamics=own)") != std::string::npos);
}
