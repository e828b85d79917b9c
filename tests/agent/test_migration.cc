// The two-phase switch end to end on the in-process bus: a deploy agent and simulated ranks.
// The agent's side of the protocol: a committed switch lands at one step on every rank and the
// agent knows it; refusal, timeout, a rank killed mid-switch and a commit that reached only some
// ranks leave every rank on the old layout, and the agent believes what the ranks run. The
// simulated ranks hold no training state: that a switch loses no step and applies none twice,
// with real state moved, is tested on the live workers (tests/live/switch_test.cc).
#include <doctest/doctest.h>

#include <chrono>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "agent/deploy/agent.h"
#include "env/simcluster/sim_cluster.h"
#include "tests/test_util.h"

using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::agent::deploy;
using namespace parapilot::env;
using namespace std::chrono_literals;

namespace {

struct Rig {
  transport::InProcHub hub;
  std::unique_ptr<SimulatedCluster> cluster;
  std::unique_ptr<DeployAgent> agent;
  std::vector<std::string> lines;
  std::mutex lines_mutex;
  uint64_t stepped = 0;  // steps this test ran, counted independently of the cluster

  explicit Rig(transport::PlanExecutorOptions mo = {}, uint32_t stage_steps = 2) {
    SimClusterOptions so;
    so.scenario = "straggler";
    so.ranks = 16;
    so.hub = &hub;
    so.use_truth = false;
    so.step_ms = 0;
    so.stage_steps = stage_steps;
    cluster = ok(SimulatedCluster::start(so));
    AgentOptions ao;
    ao.job = ok(make_job("straggler", 16));
    ao.hub = &hub;
    ao.interval_steps = 1000000;  // the policy stays out of the way; tests ask for switches
    ao.decider.async_planning = false;
    ao.migration = mo;
    ao.log = [this](const std::string& l) {
      std::lock_guard lock(lines_mutex);
      lines.push_back(l);
    };
    agent = ok(DeployAgent::start(ao));
    REQUIRE(cluster->wait_connected(10s));
    wait_for([&] { return agent->stats().connected_ranks == 16; });
  }

  template <class F>
  void wait_for(F f, std::chrono::milliseconds timeout = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!f() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    REQUIRE(f());
  }
  // Steps the ranks with a little time between steps for the bus to deliver.
  void steps(int n) {
    for (int i = 0; i < n; ++i) {
      cluster->step();
      ++stepped;
      std::this_thread::sleep_for(2ms);
    }
  }
  Strategy other_layout() {
    const Job& job = cluster->job();
    Strategy s = job.planned_initial;
    for (int tp : {1, 2, 4, 8}) {
      Strategy t = s;
      t.tp = tp;
      t.dp = 16 / (tp * t.pp);
      if (!(t == s)) {
        auto wire = from_wire(to_wire(t), job);
        if (wire.ok() && !(*wire == s)) return *wire;
      }
    }
    FAIL("no other layout");
    return s;
  }
};

// What the agent believes the job runs is what the ranks run, and its committed outcomes name
// the steps at which the ranks switched, in order.
void check_agent_matches_cluster(Rig& rig, const SimClusterReport& r) {
  CHECK(rig.agent->current_layout() == r.layout);
  std::vector<uint64_t> committed;
  for (const auto& o : rig.agent->stats().outcomes)
    if (o.committed) committed.push_back(o.switch_at_step);
  CHECK(committed == r.commit_steps);
}


}  // namespace

TEST_CASE("a committed switch loses no step and applies none twice") {
  transport::PlanExecutorOptions mo;
  mo.commit_margin_steps = 20;
  Rig rig(mo);
  rig.steps(10);
  const Strategy target = rig.other_layout();
  REQUIRE(rig.agent->request_switch(target));
  rig.steps(5);  // staging in the background while training continues
  rig.wait_for([&] {
    rig.steps(1);
    return rig.agent->stats().migrations_committed == 1;
  });
  rig.steps(10);
  const SimClusterReport r = rig.cluster->report();
  CHECK(r.commits == 1);
  CHECK(r.missed_commits == 0);
  CHECK(r.layout == target);
  CHECK(rig.agent->current_layout() == target);
  check_agent_matches_cluster(rig, r);
  const auto outcome = rig.agent->stats().outcomes.back();
  CHECK(outcome.committed);
  CHECK(outcome.switch_at_step == r.commit_steps.front());
}

TEST_CASE("a rank refusing to stage aborts the switch; everyone stays on the old layout") {
  Rig rig;
  rig.cluster->refuse_prepare(3);
  rig.steps(5);
  const Strategy before = rig.cluster->report().layout;
  REQUIRE(rig.agent->request_switch(rig.other_layout()));
  rig.wait_for([&] {
    rig.steps(1);
    return rig.agent->stats().migrations_aborted == 1;
  });
  rig.steps(5);
  const SimClusterReport r = rig.cluster->report();
  CHECK(r.commits == 0);
  CHECK(r.aborts == 15);  // every rank that had staged dropped it
  CHECK(r.layout == before);
  CHECK(rig.agent->current_layout() == before);
  CHECK(rig.agent->stats().outcomes.back().reason.find("rank 3") != std::string::npos);
  check_agent_matches_cluster(rig, r);
}

TEST_CASE("a PlanReady timeout aborts the switch") {
  transport::PlanExecutorOptions mo;
  mo.prepare_deadline_ms = 100;
  Rig rig(mo, /*stage_steps=*/1000000);
  rig.steps(3);
  const Strategy before = rig.cluster->report().layout;
  REQUIRE(rig.agent->request_switch(rig.other_layout()));
  rig.wait_for([&] {
    rig.steps(1);
    return rig.agent->stats().migrations_aborted == 1;
  });
  rig.steps(3);
  const SimClusterReport r = rig.cluster->report();
  CHECK(r.commits == 0);
  CHECK(r.aborts == 16);
  CHECK(r.layout == before);
  CHECK(rig.agent->stats().outcomes.back().reason.find("timeout") != std::string::npos);
  check_agent_matches_cluster(rig, r);
}

TEST_CASE("a worker killed mid-switch aborts it and the rest continue on the old layout") {
  Rig rig;
  rig.cluster->kill_on_prepare(7);
  rig.steps(5);
  const Strategy before = rig.cluster->report().layout;
  REQUIRE(before.dp_shares.empty());  // uniform: every GPU processes batch / 16 per step
  REQUIRE(rig.agent->request_switch(rig.other_layout()));
  rig.wait_for([&] {
    rig.steps(1);
    return rig.agent->stats().migrations_aborted == 1;
  });
  const uint64_t at_abort = rig.stepped;
  rig.steps(10);
  const SimClusterReport r = rig.cluster->report();
  CHECK(r.live_ranks == 15);
  CHECK(r.steps == at_abort + 10);  // the rest keep training
  CHECK(r.commits == 0);
  CHECK(r.layout == before);
  CHECK(rig.agent->stats().outcomes.back().reason.find("rank 7 lost") != std::string::npos);
  CHECK(rig.agent->stats().ranks_lost == 1);
  check_agent_matches_cluster(rig, r);
  // The lost GPU is believed failed.
  const monitor::Beliefs b = rig.agent->monitor()->beliefs();
  REQUIRE(b.conditions.gpu_failed.size() == 16);
  CHECK(b.conditions.gpu_failed[7]);
}

TEST_CASE("a commit that reaches only some ranks still switches every rank that staged it") {
  transport::PlanExecutorOptions mo;
  mo.commit_margin_steps = 20;
  Rig rig(mo);
  rig.cluster->drop_commit(5);
  rig.steps(5);
  const Strategy target = rig.other_layout();
  REQUIRE(rig.agent->request_switch(target));
  rig.wait_for([&] {
    rig.steps(1);
    return rig.agent->stats().migrations_committed == 1;
  });
  rig.steps(5);
  const SimClusterReport r = rig.cluster->report();
  CHECK(r.commits == 1);
  CHECK(r.missed_commits == 0);
  CHECK(r.layout == target);
  // Rank 5 switched from its staged copy at the boundary the others agreed on.
  check_agent_matches_cluster(rig, r);
}

TEST_CASE("a plan some rank no longer holds at the boundary switches none of them") {
  transport::PlanExecutorOptions mo;
  mo.commit_margin_steps = 20;
  Rig rig(mo);
  rig.cluster->lose_staged(5);
  rig.steps(5);
  const Strategy before = rig.cluster->report().layout;
  const Strategy target = rig.other_layout();
  REQUIRE(rig.agent->request_switch(target));
  rig.wait_for([&] {
    rig.steps(1);
    return rig.cluster->report().missed_commits == 1;
  });
  rig.steps(5);
  const SimClusterReport r = rig.cluster->report();
  CHECK(r.commits == 0);
  CHECK(r.layout == before);
  check_agent_matches_cluster(rig, r);
  rig.wait_for([&] {
    rig.steps(1);
    return rig.agent->stats().migrations_aborted == 1;
  });
  CHECK(rig.agent->current_layout() == before);
}

TEST_CASE("the commit lands at the step the caller asks for when that is later than the margin") {
  // The executor alone: two ranks answer PlanReady at newest step 5; the commit is sent at
  // newest + 1 + commit_margin_steps (here 5 + 1 + 1) or at min_switch_step, the later.
  for (const auto& [floor, want] : {std::pair<uint64_t, uint64_t>{0, 7}, {4, 7}, {40, 40}}) {
    CAPTURE(floor);
    transport::PlanExecutorOptions mo;
    mo.commit_margin_steps = 1;
    mo.commit_lead_ms = 0;
    mo.min_switch_step = floor;
    std::vector<transport::PlanCommit> commits;
    transport::PlanExecutor ex(
        mo,
        [&](const transport::Message& m) {
          if (const auto* c = std::get_if<transport::PlanCommit>(&m)) commits.push_back(*c);
        },
        [](const transport::PlanOutcome&) {});
    transport::PlanPrepare plan;
    plan.layout.dp = 2;
    const auto now = transport::PlanExecutor::Clock::now();
    const uint64_t id = ok(ex.prepare(plan, {0, 1}, now));
    ex.on_ready(transport::PlanReady{id, 0, true, ""}, 5, now);
    CHECK(commits.empty());  // one rank is not ready yet
    ex.on_ready(transport::PlanReady{id, 1, true, ""}, 5, now);
    REQUIRE(commits.size() == 1);
    CHECK(commits.front().plan_id == id);
    CHECK(commits.front().switch_at_step == want);
  }
}

TEST_CASE("the executor refuses a second switch while one is in flight, and one with no ranks, "
          "sending nothing") {
  int sent = 0;
  transport::PlanExecutor ex(
      transport::PlanExecutorOptions{}, [&](const transport::Message&) { ++sent; },
      [](const transport::PlanOutcome&) {});
  transport::PlanPrepare plan;
  plan.layout.dp = 2;
  const auto now = transport::PlanExecutor::Clock::now();
  const auto empty = ex.prepare(plan, {}, now);
  REQUIRE_FALSE(empty.ok());
  CHECK(empty.status().code() == StatusCode::kInvalidArgument);
  CHECK(sent == 0);
  const uint64_t first = ok(ex.prepare(plan, {0, 1}, now));
  CHECK(sent == 1);
  const auto second = ex.prepare(plan, {0, 1}, now);
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == StatusCode::kRejected);
  CHECK(second.status().message().find("plan " + std::to_string(first)) != std::string::npos);
  CHECK(sent == 1);
  CHECK(ex.plan_in_flight() == first);
}
