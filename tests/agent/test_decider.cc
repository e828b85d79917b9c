// Decider: the deployed observation equals the simulator's for the same beliefs, policy fallback,
// guardrails and the structured decision log.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "agent/deploy/decider.h"
#include "env/sim/sim_env.h"
#include "core/error.h"
#include "tests/test_util.h"

using parapilot::testing::ok;
using parapilot::testing::failure_of;

using namespace parapilot;
using namespace parapilot::agent::deploy;

namespace {

class AlwaysFirst : public parapilot::policy::Policy {
 public:
  std::string name() const override { return "always-first"; }
  int act(const env::Observation&) override { return 1; }
};

LoadedPolicy always_first() {
  LoadedPolicy p;
  p.policy = std::make_unique<AlwaysFirst>();
  return p;
}

monitor::Beliefs slowed_beliefs(int gpus, int slow_gpu, double speed) {
  monitor::Beliefs b;
  b.conditions.gpu_speed.assign(gpus, 1.0);
  b.conditions.gpu_speed[slow_gpu] = speed;
  b.slow_ranks = {slow_gpu};
  return b;
}

}  // namespace

// A policy that asks to switch to its first candidate at fixed intervals and keeps otherwise,
// recording each observation it was asked about.
class SwitchEvery : public parapilot::policy::Policy {
 public:
  explicit SwitchEvery(int every) : every_(every) {}
  std::string name() const override { return "switch-every"; }
  int act(const env::Observation& o) override {
    ++asked_;
    return asked_ % every_ == 0 && o.mask[0] ? 1 : 0;
  }

 private:
  int every_;
  int asked_ = 0;
};

// Deploy's decision path against the simulator's, interval by interval over whole episodes: the
// Decider, fed the simulator's monitor's beliefs and staging state as deploy feeds it the live
// monitor's and the migration executor's, builds the observation the simulator gives a policy,
// float for float, through switches, their staging and the cool-down. Both act on the Decider's
// action (after its guardrails), and the Decider learns of a switch when the simulator's layout
// changes, as deploy learns of a commit.
TEST_CASE("the decider's observations equal the simulator's over whole episodes, switches included") {
  int compared = 0, switches = 0, staged = 0, slowed = 0;
  // The families whose workload stays fixed: deploy learns a batch ramp or a sequence-length
  // phase from the job, which the simulator's truth sets directly.
  for (const env::Family family : {env::Family::kStraggler, env::Family::kCongestion,
                                   env::Family::kFailure, env::Family::kHetero}) {
    for (const uint64_t seed : {1, 2, 3}) {
      env::Scenario scenario = env::builtin_scenario(family, 16);
      scenario.horizon = 24;
      scenario.run_length_known_prob = 1;  // deploy is told the run's length below
      // Seed 3 decides every second, so that switches outlast an interval and are staged
      // across decisions.
      if (seed == 3) scenario.interval_s = 1;
      const int S = scenario.telemetry.steps_per_interval;
      env::SimEnv sim(scenario, "sim:test");
      env::Observation expected = ok(sim.reset(seed));

      LoadedPolicy policy;
      policy.policy = std::make_unique<SwitchEvery>(3);
      DeciderOptions options;
      options.async_planning = false;
      options.run_intervals = scenario.horizon;
      options.interval_steps = S;
      Decider decider(make_job(scenario), std::move(policy), options);
      REQUIRE(decider.current() == sim.current_layout());

      decider.update_beliefs(sim.monitor_beliefs());
      for (int t = 0; t < scenario.horizon; ++t) {
        CAPTURE(family);
        CAPTURE(seed);
        CAPTURE(t);
        const std::optional<double> staging = sim.staging_left_s();
        const uint64_t last_step = t > 0 ? static_cast<uint64_t>(t * S - 1) : 0;
        const Decision d = decider.decide(last_step, staging.has_value(), staging.value_or(0));
        for (int i = 0; i < env::kStateDim; ++i) {
          CAPTURE(i);
          REQUIRE(d.observation.state[i] == expected.state[i]);
        }
        REQUIRE(d.observation.candidates == expected.candidates);
        REQUIRE(d.observation.mask == expected.mask);
        ++compared;
        staged += staging.has_value();
        slowed += !sim.beliefs().gpu_speed.empty() || !sim.beliefs().node_inter_bw.empty();
        switches += d.action != 0;

        const env::StepResult r = sim.step(d.action);
        // Telemetry first, then the commit's ack: the re-plan at a commit reads the newest
        // beliefs, as the simulator's does.
        decider.update_beliefs(sim.monitor_beliefs());
        if (!(sim.current_layout() == decider.current())) decider.committed(sim.current_layout());
        if (r.terminated || r.truncated) break;
        expected = r.observation;
      }
    }
  }
  // The comparison covered what it claims to: many intervals, switches, staging, and beliefs
  // away from nominal.
  CHECK(compared >= 150);
  CHECK(switches >= 8);
  CHECK(staged >= 4);
  CHECK(slowed >= 20);
  MESSAGE(compared << " intervals compared, " << switches << " switches, " << staged
                   << " staged, " << slowed << " with beliefs off nominal");
}

TEST_CASE("a missing, unreadable or foreign policy file falls back to reactive, with the reason") {
  const auto none = load_policy_or_reactive("", nullptr);
  CHECK(none.fallback.ok());
  CHECK(none.policy->name() == "reactive");

  const auto no_loader = load_policy_or_reactive("policy.ckpt", nullptr);
  CHECK(no_loader.fallback.code() == StatusCode::kUnavailable);
  CHECK(no_loader.policy->name() == "reactive");

  PolicyLoader failing =
      [](const std::string& path) -> StatusOr<std::unique_ptr<parapilot::policy::Policy>> {
    return Status::invalid_argument(path + ": feature schema 7, this build reads 2");
  };
  const auto foreign = load_policy_or_reactive("old.ckpt", failing);
  CHECK(foreign.fallback.code() == StatusCode::kInvalidArgument);
  CHECK(foreign.policy->name() == "reactive");
  CHECK(foreign.fallback.message().find("old.ckpt: feature schema") != std::string::npos);

  PolicyLoader working =
      [](const std::string&) -> StatusOr<std::unique_ptr<parapilot::policy::Policy>> {
    return std::unique_ptr<parapilot::policy::Policy>(std::make_unique<AlwaysFirst>());
  };
  const auto ok = load_policy_or_reactive("good.ckpt", working);
  CHECK(ok.fallback.ok());
  CHECK(ok.policy->name() == "always-first");
}

TEST_CASE("guardrails: memory, lost GPUs, staging and cool-down") {
  Candidate c;
  c.cost.feasible = true;
  c.cost.fits_in_memory = true;
  CostBreakdown now = c.cost;
  CHECK(guardrail_for(c, now, false, 5, 2).ok());
  CHECK(guardrail_for(c, now, true, 5, 2) == Status::rejected("a switch is being staged"));
  CHECK(guardrail_for(c, now, false, 1, 2) == Status::rejected("cool-down after the last switch"));
  Candidate big = c;
  big.cost.fits_in_memory = false;
  CHECK(guardrail_for(big, now, false, 5, 2) ==
        Status::rejected("target predicted not to fit in memory"));
  CostBreakdown too_big_now = now;
  too_big_now.fits_in_memory = false;
  CHECK(guardrail_for(c, too_big_now, false, 5, 2) ==
        Status::rejected("target predicted not to fit in memory"));
  CostBreakdown lost = now;
  lost.feasible = false;
  CHECK(guardrail_for(c, lost, false, 5, 2) == Status::rejected("target uses a lost GPU"));
}

TEST_CASE("decisions: a switch, then the cool-down; every decision is one JSON line") {
  auto job = ok(make_job("straggler", 16));
  DeciderOptions o;
  o.async_planning = false;
  o.cooldown_intervals = 2;
  Decider d(job, always_first(), o);
  d.update_beliefs(slowed_beliefs(16, 3, 1.0 / 3));
  const Decision first = d.decide(9, false, 0, {"slow_rank rank 3: compute-only 300 ms"});
  REQUIRE(first.action == 1);
  REQUIRE(first.target);
  CHECK(first.target->cost.fits_in_memory);
  CHECK(first.predicted_gain > 1.0);
  const nlohmann::json& j = first.record;
  CHECK(j["event"] == "decision");
  CHECK(j["choice"] == layout_name(first.target->strategy));
  CHECK(j["evidence"][0] == "slow_rank rank 3: compute-only 300 ms");
  CHECK(j["candidates"].size() == first.candidates.size());
  CHECK(j["predicted_gain"].get<double>() > 1.0);
  CHECK(j.contains("migration_s"));
  CHECK(j["beliefs"]["slow_ranks"][0] == 3);
  CHECK(j.dump().find('\n') == std::string::npos);

  // While staging: keep.
  const Decision staging = d.decide(19, true, 10, {});
  CHECK(staging.action == 0);
  CHECK(staging.guardrail == "a switch is being staged");
  CHECK(feature(staging.observation, env::StateFeature::kStaging) == 1.0f);

  d.committed(first.target->strategy);
  CHECK(d.current() == first.target->strategy);
  // Another rank slows: there are candidates and the policy asks for one, but the cool-down
  // holds it back for cooldown_intervals decisions, then lets it through.
  d.update_beliefs(slowed_beliefs(16, 11, 0.25));
  const Decision cooling = d.decide(29, false, 0, {});
  REQUIRE_FALSE(cooling.candidates.empty());
  CHECK(cooling.policy_action != 0);
  CHECK(cooling.action == 0);
  CHECK(cooling.guardrail == "cool-down after the last switch");
  // Candidates never include the current layout.
  for (const Candidate& c : cooling.candidates) CHECK_FALSE(c.strategy == d.current());
  const Decision still = d.decide(39, false, 0, {});
  CHECK(still.action == 0);
  CHECK(still.guardrail == "cool-down after the last switch");
  const Decision after = d.decide(49, false, 0, {});
  CHECK(after.action == 1);
  CHECK(after.guardrail.empty());
}

TEST_CASE("asynchronous planning catches up with the beliefs") {
  auto job = ok(make_job("straggler", 16));
  Decider d(job, always_first(), {});
  const long before = d.plans();
  d.update_beliefs(slowed_beliefs(16, 3, 0.25));
  d.wait_for_plan();
  CHECK(d.plans() == before + 1);
  d.update_beliefs(slowed_beliefs(16, 3, 0.26));  // moved less than the threshold: no re-plan
  d.wait_for_plan();
  CHECK(d.plans() == before + 1);
  const Decision x = d.decide(9, false, 0, {});
  CHECK(x.action == 1);
}

TEST_CASE("a decision never prices candidates planned under beliefs that have moved since") {
  // Beliefs alternate between a healthy cluster and GPU 3 at a quarter speed. Each decision
  // follows its update at once, usually before the background re-plan ends: candidates planned
  // under the other beliefs must be held back, not priced against the current layout's cost
  // under these (a healthy prediction against a slowed current reads as a large gain).
  auto job = ok(make_job("straggler", 16));
  Decider d(job, always_first(), {});
  const CostModel& cost = job->planner->cost_model();
  int priced = 0;
  for (int i = 0; i < 20; ++i) {
    const monitor::Beliefs b =
        i % 2 == 0 ? slowed_beliefs(16, 3, 0.25) : slowed_beliefs(16, 3, 1.0);
    d.update_beliefs(b);
    const Decision x = d.decide(static_cast<uint64_t>(10 + i), false, 0, {});
    for (const Candidate& c : x.candidates) {
      CHECK(c.cost.tokens_per_s ==
            doctest::Approx(cost.evaluate(c.strategy, b.conditions).tokens_per_s).epsilon(1e-9));
      ++priced;
    }
    if (x.candidates.empty()) CHECK(x.action == 0);
  }
  // The re-plan caught up with the last beliefs (i = 19): candidates again, priced under them.
  const monitor::Beliefs last = slowed_beliefs(16, 3, 1.0);
  d.wait_for_plan();
  const Decision settled = d.decide(40, false, 0, {});
  REQUIRE(!settled.candidates.empty());
  for (const Candidate& c : settled.candidates) {
    CHECK(c.cost.tokens_per_s ==
          doctest::Approx(cost.evaluate(c.strategy, last.conditions).tokens_per_s).epsilon(1e-9));
    ++priced;
  }
  CHECK(priced > 0);
  MESSAGE(priced << " candidates priced across 21 decisions");
}

TEST_CASE("planner candidates survive the wire: degrees in Layout, the rest in layout_name") {
  auto job = ok(make_job("straggler", 16));
  PlanRequest request;
  request.conditions.gpu_speed.assign(16, 1.0);
  request.conditions.gpu_speed[3] = 0.3;
  request.space = job->scenario.space;
  request.top_k = 5;
  int elastic = 0;
  for (const Candidate& c : job->planner->plan(request).candidates) {
    const auto name = wire_name(c.strategy);
    REQUIRE(name);
    CHECK(name->size() <= transport::kMaxNameBytes);
    const Strategy back = ok(from_wire(to_wire(c.strategy), *job, *name));
    CHECK(back == c.strategy);
    elastic += c.strategy.dp_shares.empty() ? 0 : 1;
  }
  CHECK(elastic > 0);
  CHECK_FALSE(from_wire(to_wire(job->planned_initial), *job, "dp1-tp1-pp1-mb1-z1;zz=3").ok());
  // What is wrong is named: an action instead of a layout, and a layout the job cannot run.
  CHECK(failure_of(from_wire(to_wire(job->planned_initial), *job, "s=3/1"))
            .find("live action") != std::string::npos);
  transport::Layout too_wide = to_wire(job->planned_initial);
  too_wide.tp = 1024;
  CHECK(failure_of(from_wire(too_wide, *job)).find("not legal for this job") != std::string::npos);
}

TEST_CASE("telemetry age is measured: intervals from the newest closed step to the decision") {
  auto job = ok(make_job("straggler", 16));
  DeciderOptions o;
  o.async_planning = false;
  o.interval_steps = 10;
  Decider d(job, always_first(), o);
  const float per_interval =  // the feature's value for an age of one interval
      [&] {
        monitor::Beliefs b = slowed_beliefs(16, 3, 0.5);
        b.any_closed = true;
        b.last_closed_step = 9;
        d.update_beliefs(b);
        return feature(d.decide(9, false, 0).observation, env::StateFeature::kTelemetryAge);
      }();
  CHECK(per_interval > 0.0f);  // fresh telemetry of the interval just ended: one interval
  monitor::Beliefs stale = slowed_beliefs(16, 3, 0.5);
  stale.any_closed = true;
  stale.last_closed_step = 9;  // nothing closed since interval 0
  d.update_beliefs(stale);
  CHECK(feature(d.decide(29, false, 0).observation, env::StateFeature::kTelemetryAge) ==
        doctest::Approx(3 * per_interval));
  monitor::Beliefs none = slowed_beliefs(16, 3, 0.5);
  none.any_closed = false;  // no step ever closed: as old as the run
  d.update_beliefs(none);
  CHECK(feature(d.decide(39, false, 0).observation, env::StateFeature::kTelemetryAge) ==
        doctest::Approx(4 * per_interval));
}

TEST_CASE("a job starts on the planned layout, pure data parallel, or a layout given inline") {
  auto job = ok(make_job("straggler", 16));
  CHECK(ok(job->start_layout("planned")) == job->planned_initial);
  CHECK(ok(job->start_layout("uniform-dp")) == job->uniform_dp);
  const Strategy hybrid = ok(job->start_layout("dp=2,tp=2,pp=4"));
  CHECK(hybrid.dp == 2);
  CHECK(hybrid.tp == 2);
  CHECK(hybrid.pp == 4);
  CHECK(hybrid.global_batch == job->global_batch);  // the job's batch, whatever the text says
  // The decider starts from it.
  DeciderOptions o;
  o.initial_layout = "dp=2,tp=2,pp=4";
  Decider d(job, always_first(), o);
  CHECK(d.current() == hybrid);
  // Bad names and layouts this job cannot run say what is wrong.
  CHECK(failure_of(job->start_layout("best")).find("expected planned, uniform-dp") !=
        std::string::npos);
  CHECK(failure_of(job->start_layout("dp=3,tp=1,pp=1")).find("dp=3,tp=1,pp=1") !=
        std::string::npos);
  CHECK(failure_of(job->start_layout("dp=2,tp=2,pp=4,color=red")).find("color") !=
        std::string::npos);
}
