// Pipeline schedules played out on a timeline, against the cost model's closed form, and the
// Chrome trace export.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "strategy/pipeline_schedule.h"

using namespace parapilot;

namespace {

PipelineTimings uniform_timings(int chunks, int microbatches, double f, double b, double p2p) {
  PipelineTimings t;
  t.microbatches = microbatches;
  t.forward_s.assign(chunks, f);
  t.backward_s.assign(chunks, b);
  t.p2p_s.assign(chunks, p2p);
  return t;
}

double makespan(const std::vector<ScheduledOp>& ops) {
  double end = 0;
  for (const auto& op : ops) end = std::max(end, op.end_s);
  return end;
}

}  // namespace

TEST_CASE("every schedule runs each pass exactly once and respects dependencies") {
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B, Schedule::kInterleaved}) {
    Strategy s;
    s.pp = 4;
    s.schedule = schedule;
    s.virtual_stages = schedule == Schedule::kInterleaved ? 3 : 1;
    const int m = 8;
    const auto ops = simulate_schedule(s, uniform_timings(s.num_chunks(), m, 1.0, 2.0, 0.1));
    CHECK(ops.size() == static_cast<size_t>(2 * m * s.num_chunks()));
    std::map<std::tuple<int, int, bool>, ScheduledOp> done;
    for (const auto& op : ops) {
      CHECK(op.chunk % s.pp == op.rank);
      CHECK(done.emplace(std::make_tuple(op.chunk, op.microbatch, op.forward), op).second);
    }
    for (const auto& [key, op] : done) {
      const auto [chunk, mb, forward] = key;
      if (forward && chunk > 0) {
        CHECK(op.start_s >= done.at({chunk - 1, mb, true}).end_s + 0.1 - 1e-12);
      }
      if (!forward) {
        CHECK(op.start_s >= done.at({chunk, mb, true}).end_s - 1e-12);
        if (chunk + 1 < s.num_chunks()) {
          CHECK(op.start_s >= done.at({chunk + 1, mb, false}).end_s + 0.1 - 1e-12);
        }
      }
    }
    // No two passes overlap on one rank.
    std::map<int, std::vector<std::pair<double, double>>> by_rank;
    for (const auto& op : ops) by_rank[op.rank].push_back({op.start_s, op.end_s});
    for (auto& [rank, spans] : by_rank) {
      std::sort(spans.begin(), spans.end());
      for (size_t i = 1; i < spans.size(); ++i)
        CHECK(spans[i].first >= spans[i - 1].second - 1e-12);
    }
  }
}

TEST_CASE(
    "uniform stages: GPipe and 1F1B take (m + pp - 1)(f + b); interleaving divides the bubble") {
  for (int pp : {2, 4, 8}) {
    for (int m : {pp, 2 * pp, 8 * pp}) {
      Strategy s;
      s.pp = pp;
      for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
        s.schedule = schedule;
        const auto ops = simulate_schedule(s, uniform_timings(pp, m, 1.0, 2.0, 0.0));
        CHECK(makespan(ops) == doctest::Approx((m + pp - 1) * 3.0));
      }
      // Interleaved with v chunks of 1/v the work each: the bubble shrinks v-fold.
      Strategy inter = s;
      inter.schedule = Schedule::kInterleaved;
      inter.virtual_stages = 2;
      const auto ops = simulate_schedule(inter, uniform_timings(2 * pp, m, 0.5, 1.0, 0.0));
      CHECK(makespan(ops) == doctest::Approx(m * 3.0 + (pp - 1) * 3.0 / 2));
    }
  }
}

TEST_CASE("1F1B keeps at most pp - rank microbatches in flight") {
  Strategy s;
  s.pp = 4;
  for (int rank = 0; rank < 4; ++rank) {
    int in_flight = 0, peak = 0;
    for (const auto& pass : schedule_order(s, rank, 16)) {
      in_flight += pass.forward ? 1 : -1;
      peak = std::max(peak, in_flight);
    }
    CHECK(peak == 4 - rank);
    CHECK(in_flight == 0);
  }
}

TEST_CASE("the cost model's closed form agrees with the played-out schedule") {
  const ModelSpec m = *model_preset("gpt3-175b");
  const ClusterSpec c = *cluster_preset("16x8xa100-80g");
  for (int pp : {4, 8, 16}) {
    for (Schedule schedule : {Schedule::k1F1B, Schedule::kInterleaved}) {
      Strategy s;
      s.tp = 8;
      s.pp = pp;
      s.dp = 128 / (8 * pp);
      s.microbatch_size = 1;
      s.global_batch = 64 * s.dp;
      s.recompute = Recompute::kSelective;
      s.schedule = schedule;
      s.virtual_stages = schedule == Schedule::kInterleaved ? 2 : 1;
      REQUIRE_FALSE(find_problem(s, m, c));
      const CostModel cost(m, c);
      const CostBreakdown b = cost.evaluate(s);
      const double closed = b.iteration_time_s - b.dp_comm_s - b.optimizer_s;
      const double played = makespan(simulate_schedule(s, cost.pipeline_timings(s)));
      INFO("pp=" << pp << " schedule=" << to_string(schedule));
      CHECK(played == doctest::Approx(closed).epsilon(0.05));
    }
  }
}

TEST_CASE("Chrome trace: one process per stage, forward and backward of every microbatch") {
  const ModelSpec m = *model_preset("llama2-7b");
  const ClusterSpec c = *cluster_preset("4x8xa100-80g");
  Strategy s;
  s.tp = 8;
  s.pp = 4;
  s.dp = 1;
  s.global_batch = 8;
  const CostModel cost(m, c);
  std::ostringstream out;
  const double end = write_chrome_trace(cost, s, {}, out);
  const auto trace = nlohmann::json::parse(out.str());
  std::set<int> pids;
  int forward = 0, backward = 0, p2p = 0, optimizer = 0;
  for (const auto& e : trace.at("traceEvents")) {
    pids.insert(e.at("pid").get<int>());
    if (e.at("ph") != "X") continue;
    const std::string cat = e.at("cat");
    forward += cat == "forward";
    backward += cat == "backward";
    p2p += cat == "p2p";
    optimizer += cat == "optimizer";
    CHECK(e.at("dur").get<double>() >= 0);
    CHECK(e.at("ts").get<double>() + e.at("dur").get<double>() <= end * 1e6 + 1e-3);
  }
  CHECK(pids == std::set<int>{0, 1, 2, 3});
  CHECK(forward == 8 * 4);
  CHECK(backward == 8 * 4);
  CHECK(p2p == 2 * 8 * 3);
  CHECK(optimizer == 4);
  CHECK(end == doctest::Approx(cost.evaluate(s).iteration_time_s).epsilon(0.05));
}
