// A learned pipeline job: the split model (env/pp/pipeline_model.h: the balanced split, the
// separation of a stage's speed from its blocks' costs, the step of a split), the decision core
// with it (a slowed stage sheds blocks, a healthy pipeline keeps its split, a split measured
// slower is reverted), and deploy learning a pipeline from its ranks' JobInfo over TCP and
// sending the plan the pipeline contract names.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "agent/deploy/agent.h"
#include "env/dp/decider.h"
#include "env/pp/pipeline_model.h"
#include "policy/baselines.h"
#include "tests/test_util.h"
#include "transport/plan_name.h"
#include "transport/telemetry_keys.h"

using parapilot::testing::ok;

using namespace parapilot;
using namespace parapilot::agent::deploy;
using namespace parapilot::env::dp;
using namespace parapilot::env::pp;
using namespace std::chrono_literals;
namespace keys = parapilot::transport::telemetry_keys;

namespace {

constexpr int kStages = 4;
constexpr int kBlocks = 16;
constexpr int kMicrobatches = 8;
constexpr double kBlockMs = 2.0;  // one block's compute per step at speed 1
constexpr double kFixedMs = 1.0;  // each stage's optimizer step

PipelineModelOptions model_options(int blocks = kBlocks) {
  PipelineModelOptions o;
  o.stages = kStages;
  o.global_batch = 64;
  o.block_params.assign(blocks, 1000);
  o.block_bytes.assign(blocks, 4000000);
  o.microbatches = kMicrobatches;
  return o;
}

DataParallelOptions decider_options() {
  DataParallelOptions o;
  o.ranks = kStages;
  o.global_batch = 64;
  o.cooldown_intervals = 1;
  o.verify_steps = 10;
  o.settle_steps = 2;
  o.warmup_steps = 0;
  return o;
}

// The decider over the pipeline model with deploy's rule choosing (measured-shares, min_gain
// 1.10, one confirming decision).
struct PipelineDecider : DataParallelDecider {
  PipelineDecider()
      : DataParallelDecider(decider_options(),
                            std::make_unique<PipelineModel>(model_options())),
        rule(policy::make_measured_shares({1.10, 1})) {}
  DataParallelDecision decide(const monitor::Beliefs& b) {
    return DataParallelDecider::decide(rule->act(observe(b, false)));
  }
  std::unique_ptr<policy::Policy> rule;
};

// The beliefs of a pipeline on `split` whose stage s runs at speed[s]: every block costs kBlockMs
// at speed 1, each stage reports each of its blocks, and its compute level is its blocks plus
// the optimizer step.
monitor::Beliefs stages(const std::vector<double>& speed, const std::vector<int>& split) {
  monitor::Beliefs b;
  int first = 0;
  for (int s = 0; s < kStages; ++s) {
    monitor::StageFacts f;
    f.first_block = first;
    f.blocks = split[s];
    f.microbatches = kMicrobatches;
    f.block_ms.assign(split[s], kBlockMs / speed[s]);
    f.p2p_ms = 4;
    f.p2p_bytes = 4e6;  // 1e6 bytes per ms
    b.rank_stage.push_back(f);
    b.rank_compute_ms.push_back(split[s] * kBlockMs / speed[s] + kFixedMs);
    b.rank_compute_se_ms.push_back(0.01);
    first += split[s];
  }
  return b;
}

// The step a pipeline on `split` takes at these speeds: (M + S - 1) x the slowest stage's time
// per micro-batch, plus the optimizer step.
double step_ms(const std::vector<double>& speed, const std::vector<int>& split) {
  double slowest = 0;
  for (int s = 0; s < kStages; ++s) slowest = std::max(slowest, split[s] * kBlockMs / speed[s]);
  return (kMicrobatches + kStages - 1.0) / kMicrobatches * slowest + kFixedMs;
}

uint64_t feed(DataParallelDecider& d, uint64_t first, int n, double ms, double noise,
              std::mt19937& rng) {
  std::uniform_real_distribution<double> u(-noise, noise);
  for (int i = 0; i < n; ++i) d.observe_step(first + static_cast<uint64_t>(i), ms * (1 + u(rng)));
  return first + static_cast<uint64_t>(n);
}

// The slowest stage's cost over its speed, by brute force over every contiguous split.
double best_bottleneck(const std::vector<double>& cost, const std::vector<double>& speed) {
  const int stages = static_cast<int>(speed.size()), blocks = static_cast<int>(cost.size());
  double best = INFINITY;
  std::function<void(int, int, double)> go = [&](int s, int from, double worst) {
    if (s == stages - 1) {
      const double load = std::accumulate(cost.begin() + from, cost.end(), 0.0) / speed[s];
      best = std::min(best, std::max(worst, load));
      return;
    }
    double load = 0;
    for (int end = from + 1; end <= blocks - (stages - s - 1); ++end) {
      load += cost[end - 1];
      go(s + 1, end, std::max(worst, load / speed[s]));
    }
  };
  go(0, 0, 0.0);
  return best;
}

double bottleneck(const std::vector<double>& cost, const std::vector<double>& speed,
                  const std::vector<int>& split) {
  double worst = 0;
  size_t i = 0;
  for (size_t s = 0; s < split.size(); ++s) {
    double load = 0;
    for (int k = 0; k < split[s]; ++k) load += cost[i++];
    worst = std::max(worst, load / speed[s]);
  }
  return worst;
}

}  // namespace

TEST_CASE("the balanced split is the contiguous split with the smallest slowest stage") {
  // Four equal stages, stage 2 at half speed: it keeps two blocks, the others fill up to the
  // bottleneck of 10 ms (five blocks of 2 ms), earlier stages first.
  CHECK(balanced_split(std::vector<double>(kBlocks, kBlockMs), {1, 1, 0.5, 1}) ==
        std::vector<int>{5, 5, 2, 4});
  CHECK(balanced_split(std::vector<double>(8, 1.0), {1, 1, 1, 1}) == std::vector<int>{2, 2, 2, 2});
  // Every stage keeps a block, however slow.
  CHECK(balanced_split({1, 1, 1, 1, 1}, {1, 0.01, 0.01}) == std::vector<int>{3, 1, 1});
  // Against brute force on random costs and speeds.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> cost_of(0.1, 5.0), speed_of(0.2, 1.5);
  for (int trial = 0; trial < 200; ++trial) {
    const int stages = 1 + trial % 4, blocks = stages + static_cast<int>(rng() % 7);
    std::vector<double> cost(blocks), speed(stages);
    for (double& c : cost) c = cost_of(rng);
    for (double& v : speed) v = speed_of(rng);
    const std::vector<int> split = balanced_split(cost, speed);
    CAPTURE(trial);
    REQUIRE(static_cast<int>(split.size()) == stages);
    CHECK(std::accumulate(split.begin(), split.end(), 0) == blocks);
    CHECK(*std::min_element(split.begin(), split.end()) >= 1);
    CHECK(bottleneck(cost, speed, split) == doctest::Approx(best_bottleneck(cost, speed)));
  }
}

TEST_CASE("a split's step is (M + S - 1) x the slowest stage's micro-batch plus the fixed part") {
  const std::vector<double> cost(kBlocks, kBlockMs), speed{1, 1, 0.5, 1};
  const std::vector<int> even{4, 4, 4, 4}, moved{5, 5, 2, 4};
  CHECK(pipeline_step_ms(cost, speed, even, kMicrobatches, kFixedMs) ==
        doctest::Approx(step_ms(speed, even)));
  CHECK(pipeline_step_ms(cost, speed, moved, kMicrobatches, kFixedMs) ==
        doctest::Approx(11.0 / 8 * 10 + 1));
}

TEST_CASE("a stage's speed is told apart from its blocks' costs") {
  PipelineModelOptions o = model_options();
  // Blocks 0 and 15 (embedding, head) are larger and cost 3x; stage 2 runs at 0.6.
  o.block_params[0] = o.block_params[15] = 5000;
  PipelineModel model(o);
  monitor::Beliefs b = stages({1, 1, 0.6, 1}, {4, 4, 4, 4});
  b.rank_stage[0].block_ms[0] *= 3;
  b.rank_stage[3].block_ms[3] *= 3;
  b.rank_compute_ms[0] += 2 * kBlockMs;
  b.rank_compute_ms[3] += 2 * kBlockMs;
  REQUIRE(model.fit(b, {4, 4, 4, 4}).empty());
  const std::vector<double> speed = model.speeds();
  CHECK(speed[0] == doctest::Approx(1));
  CHECK(speed[2] == doctest::Approx(0.6));
  CHECK(model.block_cost()[0] == doctest::Approx(3 * kBlockMs));
  CHECK(model.block_cost()[9] == doctest::Approx(kBlockMs));  // on the slow stage: 2 ms at speed 1
  CHECK(model.block_cost()[15] == doctest::Approx(3 * kBlockMs));
  CHECK(model.fixed_ms() == doctest::Approx(kFixedMs));
  CHECK(model.microbatches() == kMicrobatches);
  // A stage that reports no block's compute splits its compute equally over its blocks.
  b.rank_stage[1].block_ms.clear();
  REQUIRE(model.fit(b, {4, 4, 4, 4}).empty());
  CHECK(model.block_cost()[5] == doctest::Approx(kBlockMs).epsilon(0.15));
  // A stage reporting other blocks than the split in force is not measured under it.
  CHECK(model.fit(b, {5, 3, 4, 4}) == "0,1");
}

TEST_CASE("telemetry of a slowed stage yields a balanced split that moves blocks off it") {
  PipelineDecider d;
  std::mt19937 rng(1);
  const std::vector<double> speed{1, 1, 0.5, 1};
  const std::vector<int> even{4, 4, 4, 4};
  uint64_t step = feed(d, 0, 10, step_ms(speed, even), 0.02, rng);
  const env::Observation o = d.observe(stages(speed, even), false);
  REQUIRE(o.mask[0] == 1);
  // The best candidate is the balanced split (23 ms -> 14.75 ms), its switch cost the three
  // blocks that change stage (parameters and Adam's two states, 4e6 x 3 bytes each, 36 ms at
  // 1e6 bytes per ms) plus one step's pause, over the decision interval of ten steps.
  CHECK(std::exp(env::feature(o, 0, env::CandidateFeature::kLogGain)) ==
        doctest::Approx(step_ms(speed, even) / step_ms(speed, {5, 5, 2, 4})).epsilon(0.01));
  const double interval_ms = 10 * step_ms(speed, even);
  CHECK(env::feature(o, 0, env::CandidateFeature::kSwitchCost) ==
        doctest::Approx((36 + step_ms(speed, even)) / interval_ms).epsilon(0.02));
  CHECK(env::feature(o, 0, env::CandidateFeature::kMigrationTime) ==
        doctest::Approx(36 / interval_ms).epsilon(0.02));
  CHECK(env::feature(o, 0, env::CandidateFeature::kPpDiffers) == 0.0f);
  CHECK(env::feature(o, env::StateFeature::kMinSpeed) == doctest::Approx(0.5));
  const DataParallelDecision x = d.DataParallelDecider::decide(d.rule->act(o));
  INFO(x.reason);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  CHECK(x.counts == std::vector<int>{5, 5, 2, 4});
  CHECK(x.reason.find("stage 2 (blocks 8-11) runs at speed 0.50") != std::string::npos);
  CHECK(x.reason.find("balanced split") != std::string::npos);
  // The plan deploy sends: dp1-pp4 with the split as stage boundaries and no schedule or
  // recompute: the job keeps its own.
  const transport::PlanPrepare plan = plan_prepare_keeping_schedule(d.layout_of(x.counts));
  CHECK(plan.layout.dp == 1);
  CHECK(plan.layout.pp == 4);
  CHECK(plan.layout.micro_batches == kMicrobatches);
  const auto name = std::get<transport::LayoutPlanName>(
      ok(transport::decode_plan_name(plan.layout_name)));
  CHECK(name.pp == 4);
  CHECK(name.dp == 1);
  CHECK(name.stage_layers == x.counts);
  CHECK(plan.layout_name == "dp1-tp1-pp4-mb8-z0;st=5,5,2,4");
  CHECK_FALSE(name.schedule.has_value());
  CHECK_FALSE(name.recompute.has_value());
  // Once committed the split in force is the new one, and the job is measured afresh.
  d.committed(x.counts, step, false);
  step = feed(d, step, 14, step_ms(speed, x.counts), 0.02, rng);
  const DataParallelDecision held = d.decide(stages(speed, x.counts));
  CHECK(held.kind == DataParallelDecision::Kind::keep);
  CHECK(held.reason.find("held") != std::string::npos);
}

TEST_CASE("a healthy pipeline is offered no switch through noise, whatever the policy asks") {
  // A policy that always asks for the first candidate; 16 blocks per stage, so that a few
  // percent of a stage's time is a block to move.
  DataParallelDecider d(decider_options(), std::make_unique<PipelineModel>(model_options(64)));
  std::mt19937 rng(2);
  std::normal_distribution<double> noise(0.0, 0.05);
  const std::vector<int> even{16, 16, 16, 16};
  uint64_t step = 0;
  for (int i = 0; i < 30; ++i) {
    // Each stage's level wanders by a few percent from decision to decision.
    std::vector<double> speed(kStages);
    for (double& v : speed) v = 1 + noise(rng);
    step = feed(d, step, 10, step_ms({1, 1, 1, 1}, even), 0.05, rng);
    const env::Observation o = d.observe(stages(speed, even), false);
    const DataParallelDecision x = d.decide(1);
    INFO(x.reason);
    CHECK(o.mask[0] == 0);
    CHECK(x.kind == DataParallelDecision::Kind::keep);
  }
}

TEST_CASE("the guardrail reverts a split measured slower, whatever the policy asks") {
  // A policy that always asks for the first candidate.
  DataParallelDecider d(decider_options(), std::make_unique<PipelineModel>(model_options()));
  std::mt19937 rng(3);
  const std::vector<double> speed{1, 1, 0.5, 1};
  const std::vector<int> even{4, 4, 4, 4};
  uint64_t step = feed(d, 0, 10, step_ms(speed, even), 0.02, rng);
  REQUIRE(d.observe(stages(speed, even), false).mask[0] == 1);
  DataParallelDecision x = d.decide(1);
  REQUIRE(x.kind == DataParallelDecision::Kind::rebalance);
  d.committed(x.counts, step, false);
  step = feed(d, step, 2, 500, 0, rng);  // settle steps are not judged
  // The model was wrong (the moved blocks run slower where they went): steps 30% slower.
  step = feed(d, step, 10, 1.3 * step_ms(speed, even), 0.02, rng);
  env::Observation o = d.observe(stages(speed, x.counts), false);
  CHECK(o.mask[0] == 0);
  x = d.decide(1);
  INFO(x.reason);
  REQUIRE(x.kind == DataParallelDecision::Kind::revert);
  CHECK(x.counts == even);
  CHECK(x.reason.find("the last switch made steps slower") != std::string::npos);
  d.committed(x.counts, step, true);
  CHECK(d.counts() == even);
  CHECK(d.cooldown_intervals() == 2);
}

namespace {

transport::Secret secret() { return transport::Secret("pp-decider-test-secret-0123456789"); }

struct Rank {
  std::unique_ptr<transport::Client> client;
  std::mutex mutex;
  std::vector<transport::Message> received;
};

std::unique_ptr<Rank> connect_rank(uint16_t port, uint32_t rank) {
  auto r = std::make_unique<Rank>();
  transport::ClientOptions o;
  o.server_address = "127.0.0.1";
  o.port = port;
  o.secret = secret();
  o.name = "stage-" + std::to_string(rank);
  o.rank = rank;
  transport::ClientHandlers h;
  Rank* raw = r.get();
  h.on_message = [raw](transport::Message&& m) {
    std::lock_guard lock(raw->mutex);
    raw->received.push_back(std::move(m));
  };
  auto c = transport::make_tcp_client(std::move(o), std::move(h));
  REQUIRE(c);
  r->client = std::move(*c);
  return r;
}

template <class F>
bool eventually(F f) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!f()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// Stage s's telemetry of `step` as the pipeline contract says: its compute, its blocks and
// each block's compute, its micro-batches, its pipeline sends and receives.
transport::Telemetry stage_telemetry(int s, uint64_t step, const std::vector<double>& speed,
                                     const std::vector<int>& split) {
  const double wall_ms = step_ms(speed, split);
  transport::Telemetry t;
  t.rank = static_cast<uint32_t>(s);
  t.step = step;
  t.step_start_ns = step * static_cast<uint64_t>(wall_ms * 1e6);
  t.step_end_ns = t.step_start_ns + static_cast<uint64_t>(wall_ms * 1e6);
  const int first = std::accumulate(split.begin(), split.begin() + s, 0);
  t.compute_ms = split[s] * kBlockMs / speed[s] + kFixedMs;
  t.collectives[keys::kP2pPp] = {wall_ms - t.compute_ms, 4000000, 2 * kMicrobatches};
  keys::set_info(t, keys::kStage, static_cast<uint64_t>(s));
  keys::set_info(t, keys::kMicrobatches, kMicrobatches);
  keys::set_info(t, keys::kFirstBlock, static_cast<uint64_t>(first));
  keys::set_info(t, keys::kBlocks, static_cast<uint64_t>(split[s]));
  for (int k = 0; k < split[s]; ++k) {
    keys::set_block_ms(t, static_cast<size_t>(first + k), kBlockMs / speed[s]);
  }
  return t;
}

transport::JobInfo pipeline_info(uint32_t rank, uint32_t capabilities, size_t blocks) {
  transport::JobInfo info;
  info.rank = rank;
  info.world_size = kStages;
  info.global_batch = 64;
  info.capabilities = capabilities;
  info.framework = "pytorch-pipeline test";
  info.layers.assign(blocks, transport::LayerInfo{1000, 4000000});
  return info;
}

struct Deploy {
  std::mutex log_mutex;
  std::vector<std::string> log;
  std::unique_ptr<DeployAgent> agent;
  std::vector<std::unique_ptr<Rank>> ranks;

  Deploy() {
    AgentOptions o;
    o.secret = secret();
    o.interval_steps = 5;
    o.policy_path = "measured-shares";
    o.loader = [](const std::string&) {
      return StatusOr<std::unique_ptr<policy::Policy>>(policy::make_measured_shares({1.10, 1}));
    };
    o.log = [this](const std::string& line) {
      std::lock_guard lock(log_mutex);
      log.push_back(line);
    };
    agent = ok(DeployAgent::start(o));
    for (uint32_t r = 0; r < kStages; ++r) ranks.push_back(connect_rank(agent->port(), r));
    REQUIRE(eventually([&] { return agent->stats().connected_ranks == kStages; }));
  }
  // The first log line holding `needle`; "" when none.
  std::string line_with(const std::string& needle) {
    std::lock_guard lock(log_mutex);
    for (const std::string& l : log) {
      if (l.find(needle) != std::string::npos) return l;
    }
    return "";
  }
};

}  // namespace

TEST_CASE("deploy learns a pipeline from JobInfo and moves blocks off a slowed stage") {
  Deploy d;
  for (uint32_t r = 0; r < kStages; ++r) {
    d.ranks[r]->client->send(pipeline_info(r, transport::kCapPipeline, kBlocks));
  }
  // The log line follows the monitor's start: wait for the line.
  REQUIRE(eventually([&] { return !d.line_with("\"job_learned\"").empty(); }));
  REQUIRE(d.agent->monitor() != nullptr);
  const std::string learned = d.line_with("\"job_learned\"");
  CHECK(learned.find("\"kind\":\"pipeline\"") != std::string::npos);
  CHECK(learned.find("\"split\":\"4,4,4,4\"") != std::string::npos);
  // Stage 2 computes at half speed; the stages report every step until a plan comes.
  const std::vector<double> speed{1, 1, 0.5, 1};
  const std::vector<int> even{4, 4, 4, 4};
  std::optional<transport::PlanPrepare> plan;
  for (uint64_t step = 0; step < 200 && !plan; ++step) {
    for (int s = 0; s < kStages; ++s) {
      d.ranks[s]->client->send(stage_telemetry(s, step, speed, even));
    }
    REQUIRE(eventually([&] { return d.agent->monitor()->beliefs().last_closed_step == step; }));
    std::lock_guard lock(d.ranks[0]->mutex);
    for (const transport::Message& m : d.ranks[0]->received) {
      if (const auto* p = std::get_if<transport::PlanPrepare>(&m)) plan = *p;
    }
  }
  REQUIRE(plan.has_value());
  CHECK(plan->layout.dp == 1);
  CHECK(plan->layout.tp == 1);
  CHECK(plan->layout.pp == kStages);
  CHECK(plan->layout.micro_batches == kMicrobatches);
  const auto name =
      std::get<transport::LayoutPlanName>(ok(transport::decode_plan_name(plan->layout_name)));
  CHECK(name.stage_layers == std::vector<int>{5, 5, 2, 4});
  // No schedule: a gpipe job and a 1f1b job beside the same deploy each keep their own.
  CHECK(plan->layout_name == "dp1-tp1-pp4-mb8-z0;st=5,5,2,4");
  CHECK_FALSE(name.schedule.has_value());
  // The decision names the split it moves to.
  // The plan leaves before the decision's log line: wait for the line.
  REQUIRE(eventually([&] { return !d.line_with("\"action\":\"rebalance\"").empty(); }));
  const std::string decision = d.line_with("\"action\":\"rebalance\"");
  INFO(decision);
  CHECK(decision.find("\"target_split\":\"5,5,2,4\"") != std::string::npos);
  CHECK(decision.find("\"split\":\"4,4,4,4\"") != std::string::npos);
  CHECK(decision.find("stage 2 (blocks 8-11)") != std::string::npos);
  // The stages stage the split and agree; once every one acked, deploy holds the new split.
  for (uint32_t r = 0; r < kStages; ++r) {
    d.ranks[r]->client->send(transport::PlanReady{plan->plan_id, r, true, ""});
  }
  REQUIRE(eventually([&] {
    std::lock_guard lock(d.ranks[0]->mutex);
    return std::any_of(d.ranks[0]->received.begin(), d.ranks[0]->received.end(),
                       [](const transport::Message& m) {
                         return std::holds_alternative<transport::PlanCommit>(m);
                       });
  }));
  for (uint32_t r = 0; r < kStages; ++r) {
    d.ranks[r]->client->send(
        transport::Ack{transport::MessageType::plan_commit, plan->plan_id, r});
  }
  REQUIRE(eventually([&] { return !d.line_with("\"migration\"").empty(); }));
  CHECK(d.agent->stats().migrations_committed == 1);
  const std::string migration = d.line_with("\"migration\"");
  INFO(migration);
  CHECK(migration.find("\"split\":\"5,5,2,4\"") != std::string::npos);
  CHECK(migration.find("\"revert\":false") != std::string::npos);
  CHECK(d.agent->current_layout().pp == kStages);
  CHECK(d.agent->current_layout().stage_layers == std::vector<int>{5, 5, 2, 4});
}

TEST_CASE("a job that can switch batch shares stays data-parallel; a pipeline too short to split "
          "is only observed") {
  SUBCASE("DP_SHARES with PIPELINE: batch shares") {
    Deploy d;
    d.ranks[0]->client->send(
        pipeline_info(0, transport::kCapPipeline | transport::kCapDpShares, kBlocks));
    REQUIRE(eventually([&] { return !d.line_with("\"job_learned\"").empty(); }));
    const std::string learned = d.line_with("\"job_learned\"");
    CHECK(learned.find("\"kind\":\"data-parallel\"") != std::string::npos);
    CHECK(learned.find("\"shares\":\"16,16,16,16\"") != std::string::npos);
  }
  SUBCASE("fewer blocks than stages") {
    Deploy d;
    d.ranks[0]->client->send(pipeline_info(0, transport::kCapPipeline, kStages - 1));
    REQUIRE(eventually([&] { return !d.line_with("\"job_mismatch\"").empty(); }));
    CHECK(d.line_with("\"job_mismatch\"").find("a stage needs a block") != std::string::npos);
    CHECK(d.agent->monitor() == nullptr);
  }
}
