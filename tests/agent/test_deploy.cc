// The deploy agent over TCP loopback with simulated ranks: detection and a committed switch with
// /metrics, the agent killed and restarted while the ranks keep training, and bad telemetry.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agent/deploy/agent.h"
#include "agent/deploy/metrics.h"
#include "env/simcluster/sim_cluster.h"
#include "tests/test_util.h"

using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::agent::deploy;
using namespace parapilot::env;
using namespace std::chrono_literals;

namespace {

transport::Secret secret() { return transport::Secret("deploy-test-secret-0123456789"); }

AgentOptions agent_options(uint16_t port = 0) {
  AgentOptions o;
  o.job = ok(make_job("straggler", 16));
  o.secret = secret();
  o.port = port;
  o.serve_metrics = true;
  o.interval_steps = 5;
  o.migration.commit_margin_steps = 10;
  o.log = [](const std::string&) {};
  return o;
}

SimClusterOptions cluster_options(uint16_t port) {
  SimClusterOptions o;
  o.ranks = 16;
  o.scenario = "straggler";
  o.agent_port = port;
  o.secret = secret();
  o.use_truth = false;
  o.step_ms = 5;
  return o;
}

template <class F>
bool eventually(F f, std::chrono::milliseconds timeout = 20s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!f()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// Steps the test ran, counted here rather than read back from the cluster.
struct Stepper {
  SimulatedCluster& cluster;
  uint64_t ran = 0;
  void operator()(uint64_t n) {
    cluster.run(n);
    ran += n;
  }
};


}  // namespace

TEST_CASE("a rank slowed 3x is detected, the switch commits, /metrics tells") {
  const auto started = ok(DeployAgent::start(agent_options()));
  DeployAgent& agent = *started;
  SimClusterOptions co = cluster_options(agent.port());
  co.slowdowns.push_back({5, 3.0, 20});
  const auto cluster_started = ok(SimulatedCluster::start(co));
  SimulatedCluster& cluster = *cluster_started;
  Stepper run{cluster};
  REQUIRE(cluster.wait_connected(20s));
  REQUIRE(eventually([&] { return agent.stats().connected_ranks == 16; }));
  run(40);
  REQUIRE(eventually([&] {
    run(1);
    return agent.stats().migrations_committed >= 1;
  }));
  run(20);
  const AgentStats s = agent.stats();
  CHECK(s.stragglers_detected == 1);
  REQUIRE_FALSE(s.events.empty());
  CHECK(s.events.front().rank == 5);
  CHECK(s.events.front().step >= 20);
  CHECK(s.events.front().step <= 35);  // generous: loaded CI machines delay samples
  const SimClusterReport r = cluster.report();
  CHECK(r.commits >= 1);
  CHECK(r.layout == agent.current_layout());
  const auto text = http_get(agent.metrics_port());
  REQUIRE(text);
  CHECK(text->find("parapilot_stragglers_detected_total 1\n") != std::string::npos);
  CHECK(text->find("parapilot_migrations_total{outcome=\"committed\"} ") != std::string::npos);
  CHECK(text->find("parapilot_rank_speed{rank=\"5\"} 0.3") != std::string::npos);
  CHECK(text->find("parapilot_rank_tokens_per_second{rank=\"0\"}") != std::string::npos);
  CHECK(text->find("process_cpu_seconds_total") != std::string::npos);
  CHECK_FALSE(http_get(agent.metrics_port(), "/other"));
}

TEST_CASE(
    "the agent killed: ranks keep training on the committed layout and reconnect to the next") {
  auto first = ok(DeployAgent::start(agent_options()));
  const uint16_t port = first->port();
  SimClusterOptions co = cluster_options(port);
  co.stage_steps = 3;
  std::mutex log_mu;
  std::vector<std::string> log;
  co.log = [&](const std::string& line) {
    std::lock_guard lock(log_mu);
    log.push_back(line);
  };
  const auto logged = [&](const std::string& line) {
    std::lock_guard lock(log_mu);
    return std::find(log.begin(), log.end(), line) != log.end();
  };
  const auto cluster_started = ok(SimulatedCluster::start(co));
  SimulatedCluster& cluster = *cluster_started;
  Stepper run{cluster};
  REQUIRE(cluster.wait_connected(20s));
  REQUIRE(eventually([&] { return first->stats().connected_ranks == 16; }));
  run(10);
  const Strategy before = cluster.report().layout;
  // Killed mid-switch: every rank has staged the plan (it takes 3 steps to be ready, so no
  // PlanReady has gone out and nothing can be committed), then the agent dies.
  Strategy target = cluster.job().uniform_dp;
  if (target == before) target = cluster.job().planned_initial;
  REQUIRE_FALSE(target == before);
  REQUIRE(cluster.report().ranks_holding_plans == 0);
  REQUIRE(first->request_switch(target));
  REQUIRE(eventually([&] {
    run(1);
    return cluster.report().ranks_holding_plans == 16;
  }));
  first.reset();
  // Each rank sees the agent gone and drops the staged plan: nothing is held any more.
  REQUIRE(eventually([&] {
    run(1);
    return cluster.report().ranks_holding_plans == 0;
  }));
  CHECK(logged("agent lost: staged plan dropped"));
  run(30);
  SimClusterReport r = cluster.report();
  CHECK(r.live_ranks == 16);
  CHECK(r.layout == before);  // on the last committed layout
  CHECK(r.commits == 0);
  // The agent returns on the same address; the ranks reconnect by themselves.
  const auto second_started = ok(DeployAgent::start(agent_options(port)));
  DeployAgent& second = *second_started;
  REQUIRE(eventually([&] {
    run(1);
    return second.stats().connected_ranks == 16;
  }));
  REQUIRE(eventually([&] {
    run(1);
    return second.stats().decisions >= 2;
  }));
  REQUIRE(second.request_switch(target));
  REQUIRE(eventually([&] {
    run(1);
    return second.stats().migrations_committed == 1;
  }));
  run(5);
  r = cluster.report();
  CHECK(r.commits == 1);
  CHECK(r.layout == target);
  CHECK(second.current_layout() == target);
}

TEST_CASE("telemetry with NaN, negative or absurd values is rejected, counted, never acted on") {
  const auto started = ok(DeployAgent::start(agent_options()));
  DeployAgent& agent = *started;
  transport::ClientOptions co;
  co.port = agent.port();
  co.secret = secret();
  co.rank = 2;
  co.name = "rank-2";
  auto client = transport::make_tcp_client(co, {});
  REQUIRE(client);
  REQUIRE(eventually([&] { return agent.stats().connected_ranks == 1; }));
  transport::Telemetry t;
  t.rank = 2;
  t.step = 0;
  t.step_start_ns = 1'000'000'000;
  t.step_end_ns = 2'000'000'000;
  t.compute_ms = std::nan("");
  CHECK_FALSE((*client)->send(t));  // the bus refuses to send NaN at all
  t.compute_ms = -1;
  CHECK_FALSE((*client)->send(t));  // ...or negative durations
  t.compute_ms = 5e8;               // legal on the wire, absurd for a 1 s step
  CHECK((*client)->send(t));
  t.compute_ms = 500;
  t.rank = 3;  // speaking for another rank: ignored
  CHECK((*client)->send(t));
  // A valid sample of its own after it: one connection delivers in order, so once this one is
  // accepted the rank-3 sample was handled before it.
  t.rank = 2;
  t.step = 1;
  t.step_start_ns = 2'000'000'000;
  t.step_end_ns = 3'000'000'000;
  t.compute_ms = 400;
  CHECK((*client)->send(t));
  REQUIRE(eventually([&] { return agent.monitor()->counters().accepted >= 1; }));
  const auto text = http_get(agent.metrics_port());
  REQUIRE(text);
  CHECK(text->find("parapilot_telemetry_rejected_total{reason=\"absurd\"} 1") != std::string::npos);
  CHECK(agent.monitor()->counters().rejected == 1);
  CHECK(agent.monitor()->counters().accepted == 1);  // rank 2's valid sample only
  CHECK(agent.stats().decisions == 0);
  CHECK(agent.monitor()->beliefs().slow_ranks.empty());
}
