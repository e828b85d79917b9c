// Monitor: robust statistics, slow-rank detection despite the synchronous all-reduce trap,
// congested links, and rejection of bad telemetry.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "env/monitor/monitor.h"
#include "env/monitor/robust_stats.h"
#include "transport/telemetry_keys.h"

using namespace parapilot;
using namespace parapilot::monitor;
namespace keys = parapilot::transport::telemetry_keys;

namespace {

// One synchronous data-parallel step of `ranks` ranks: every rank starts together, computes
// for compute_ms[r], waits in the all-reduce for the last arrival, then transfers at its node's
// bandwidth; all leave the collective together, so every rank's step wall time is the same.
std::vector<transport::Telemetry> sync_step(uint64_t step, const std::vector<double>& compute_ms,
                                            const std::vector<double>& transfer_ms) {
  const size_t n = compute_ms.size();
  double last = 0, max_transfer = 0;
  for (size_t r = 0; r < n; ++r) {
    last = std::max(last, compute_ms[r]);
    max_transfer = std::max(max_transfer, transfer_ms[r]);
  }
  const uint64_t start = 1'000'000'000ull * (step + 1);
  const double step_ms = last + max_transfer;
  std::vector<transport::Telemetry> out;
  for (size_t r = 0; r < n; ++r) {
    transport::Telemetry t;
    t.rank = static_cast<uint32_t>(r);
    t.step = step;
    t.step_start_ns = start;
    t.step_end_ns = start + static_cast<uint64_t>(step_ms * 1e6);
    t.compute_ms = compute_ms[r];
    t.collectives[keys::kAllReduceDpInter] = {last - compute_ms[r] + transfer_ms[r], 100'000'000, 1};
    t.layers.push_back({0, 1.5f, 0.1f, 0});
    out.push_back(t);
  }
  return out;
}

MonitorOptions options(int ranks) {
  MonitorOptions o;
  o.close_lag_steps = 2;
  o.ranks = ranks;
  o.gpus_per_node = 8;
  return o;
}

}  // namespace

TEST_CASE("median, MAD and the robust EWMA ignore a blip and follow a sustained shift") {
  CHECK(median({3, 1, 2}) == 2);
  CHECK(median({4, 1, 2, 3}) == 2.5);
  CHECK(mad({1, 2, 3, 4, 100}, 3) == 1);
  RobustEwma e;
  for (int i = 0; i < 10; ++i) e.add(10.0 + 0.01 * (i % 3));
  CHECK(e.value() == doctest::Approx(10.0).epsilon(0.01));
  CHECK_FALSE(e.add(50));  // a blip
  CHECK(e.value() == doctest::Approx(10.0).epsilon(0.01));
  e.add(10);
  for (int i = 0; i < 3; ++i) e.add(30);  // a level shift, confirmed by three in a row
  CHECK(e.value() == doctest::Approx(30.0));
  CHECK(e.shifts() == 1);
}

TEST_CASE("select_nth puts the value sorting would at kth, with the range partitioned around it") {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> noise(100, 5);
  for (int n : {1, 2, 3, 8, 9, 16, 17, 18, 100, 1001}) {
    for (int shape = 0; shape < 6; ++shape) {
      std::vector<double> v(n);
      // With ties, few distinct values: whole partitions equal the pivot. Sorted, reversed,
      // organ-pipe and constant ranges are the adversarial orders for median-of-3 pivots.
      for (double& x : v) x = shape == 1 ? std::round(noise(rng) / 5) : noise(rng);
      if (shape == 2) std::sort(v.begin(), v.end());
      if (shape == 3) std::sort(v.rbegin(), v.rend());
      if (shape == 4) {
        std::sort(v.begin(), v.end());
        std::reverse(v.begin() + n / 2, v.end());
      }
      if (shape == 5) std::fill(v.begin(), v.end(), 7.0);
      std::vector<double> sorted = v;
      std::sort(sorted.begin(), sorted.end());
      for (int k : {0, n / 3, (n - 1) / 2, n / 2, n - 1}) {
        std::vector<double> w = v;
        select_nth(w.data(), w.data() + k, w.data() + n);
        CHECK(w[k] == sorted[k]);
        CHECK(std::all_of(w.begin(), w.begin() + k, [&](double x) { return x <= w[k]; }));
        CHECK(std::all_of(w.begin() + k, w.end(), [&](double x) { return x >= w[k]; }));
        std::sort(w.begin(), w.end());
        CHECK(w == sorted);  // a permutation
      }
      std::vector<double> w = v;
      const double expected =
          n % 2 == 1 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
      CHECK(median_in_place(w.data(), w.data() + n) == expected);
    }
  }
}

namespace {

// RobustEwma::add as its contract states it, selecting the window's MAD for every sample off
// the level by more than reject_k floors: what the counting shortcut must reproduce.
class ReferenceEwma {
 public:
  explicit ReferenceEwma(RobustEwma::Options o) : o_(o) {}
  bool add(double x) {
    if (count_ == 0) {
      level_ = x;
      ++count_;
      push(x);
      return true;
    }
    const double dev = x - level_;
    const double floor = o_.rel_floor * std::abs(level_);
    std::vector<double> d;
    for (double w : window_) d.push_back(std::abs(w - level_));
    const double spread = std::max(1.4826 * median(d), floor);
    if (std::abs(dev) > o_.reject_k * spread && spread > 0) {
      const int side = dev > 0 ? 1 : -1;
      if (side != side_) pending_.clear();
      side_ = side;
      pending_.push_back(x);
      if (static_cast<int>(pending_.size()) >= o_.confirm) {
        level_ = median(pending_);
        window_.clear();
        for (double p : pending_) push(p);
        pending_.clear();
        side_ = 0;
        return true;
      }
      return false;
    }
    pending_.clear();
    side_ = 0;
    level_ = (1 - o_.alpha) * level_ + o_.alpha * x;
    push(x);
    ++count_;
    return true;
  }
  double value() const { return level_; }

 private:
  void push(double x) {
    window_.push_back(x);
    if (static_cast<int>(window_.size()) > o_.window) window_.erase(window_.begin());
  }
  RobustEwma::Options o_;
  double level_ = 0;
  long count_ = 0;
  int side_ = 0;
  std::vector<double> window_, pending_;
};

}  // namespace

TEST_CASE("the robust EWMA decides outliers exactly as selecting the window's MAD does") {
  std::mt19937_64 rng(17);
  std::normal_distribution<double> normal(0, 1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 400; ++trial) {
    RobustEwma::Options o;
    o.window = 1 + trial % 16;  // odd and even windows
    o.confirm = 1 + trial % 5;
    o.alpha = 0.1 + 0.8 * u(rng);
    o.reject_k = trial % 7 == 0 ? 1.0 : 4.0;
    o.rel_floor = trial % 5 == 0 ? 0.0 : 0.05;  // without a floor the spread may be 0
    RobustEwma fast(o);
    ReferenceEwma reference(o);
    double level = trial % 3 == 0 ? 0.0 : 100 * u(rng);
    for (int i = 0; i < 300; ++i) {
      if (u(rng) < 0.02) level *= 0.5 + 2 * u(rng);  // level shifts
      double x = level + normal(rng) * (trial % 4 == 0 ? 0.0 : 0.03 * level + 0.1);
      if (u(rng) < 0.05) x *= 3;                       // blips
      if (trial % 6 == 0) x = std::round(x);           // ties: deviations at the threshold
      REQUIRE(fast.add(x) == reference.add(x));
      REQUIRE(fast.value() == reference.value());
    }
  }
}

TEST_CASE("a level shift needs `confirm` outliers in a row; reset forgets every sample") {
  RobustEwma::Options o;
  o.confirm = 5;
  RobustEwma e(o);
  for (int i = 0; i < 10; ++i) e.add(10.0 + 0.01 * (i % 3));
  for (int i = 0; i < 4; ++i) CHECK_FALSE(e.add(30));
  CHECK(e.add(30));  // the fifth
  CHECK(e.value() == 30);
  CHECK(e.shifts() == 1);
  e.reset();
  CHECK(e.count() == 0);
  CHECK(e.rejected() == 0);
  CHECK(e.shifts() == 0);
  CHECK(e.spread() == 0);
  CHECK(e.add(7));
  CHECK(e.value() == 7);
}

TEST_CASE("a rank's compute level carries the standard error its samples' spread gives") {
  MonitorOptions o = options(4);
  o.compute_standard_errors = true;
  Monitor m(o);
  Monitor without(options(4));  // not asked for: the field stays 0
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<double> transfer(4, 1.0);
  for (uint64_t s = 0; s < 30; ++s) {
    // Ranks 0-1 steady (+-1%), ranks 2-3 noisy (+-15%): the same level, other errors.
    std::vector<double> compute{100 * (1 + 0.01 * u(rng)), 100 * (1 + 0.01 * u(rng)),
                                100 * (1 + 0.15 * u(rng)), 100 * (1 + 0.15 * u(rng))};
    for (const auto& t : sync_step(s, compute, transfer)) {
      REQUIRE(m.ingest(t).ok());
      REQUIRE(without.ingest(t).ok());
    }
  }
  const Beliefs b = m.beliefs();
  REQUIRE(b.rank_compute_se_ms.size() == 4);
  CHECK(without.beliefs().rank_compute_se_ms == std::vector<double>(4, 0.0));
  CHECK(without.beliefs().rank_compute_ms == b.rank_compute_ms);
  for (int r = 0; r < 4; ++r) CHECK(b.rank_compute_se_ms[r] > 0);
  CHECK(b.rank_compute_se_ms[0] < 1.0);
  CHECK(b.rank_compute_se_ms[2] > 3 * std::max(b.rank_compute_se_ms[0], b.rank_compute_se_ms[1]));
  CHECK(b.rank_compute_se_ms[3] > 3 * std::max(b.rank_compute_se_ms[0], b.rank_compute_se_ms[1]));
  // +-15% uniform has a standard deviation of 8.7 ms; alpha 0.3 gives an error of 0.42 of it.
  CHECK(b.rank_compute_se_ms[2] == doctest::Approx(0.42 * 8.7).epsilon(0.6));
}

TEST_CASE("a 3x slower rank is found from compute-only time and arrival skew, not step time") {
  Monitor m(options(16));
  std::vector<uint64_t> closed;
  m.set_step_callback([&](uint64_t step, Clock::time_point) { closed.push_back(step); });
  std::vector<double> transfer(16, 20.0);
  for (uint64_t s = 0; s < 20; ++s) {
    std::vector<double> compute(16, 100.0 + static_cast<double>(s % 3));
    if (s >= 8) compute[5] *= 3;
    for (const auto& t : sync_step(s, compute, transfer)) CHECK(m.ingest(t).ok());
  }
  CHECK(closed.size() == 20);
  const Beliefs b = m.beliefs();
  // The trap: every rank's step wall time is identical...
  for (int r = 1; r < 16; ++r)
    CHECK(b.rank_steps_per_s[r] == doctest::Approx(b.rank_steps_per_s[0]));
  // ...but compute-only time singles out rank 5.
  CHECK(b.conditions.gpu_speed[5] == doctest::Approx(1.0 / 3).epsilon(0.02));
  for (int r = 0; r < 16; ++r) {
    if (r != 5) CHECK(b.conditions.gpu_speed[r] == doctest::Approx(1.0).epsilon(0.03));
  }
  CHECK(b.slow_ranks == std::vector<int>{5});
  CHECK(b.rank_lateness_ms[5] > 150);
  // The fast ranks' waiting does not read as slow links.
  for (double bw : b.conditions.node_inter_bw) CHECK(bw == doctest::Approx(1.0).epsilon(0.05));
  const auto events = m.take_events();
  REQUIRE(events.size() == 1);
  CHECK(events[0].kind == MonitorEvent::Kind::slow_rank);
  CHECK(events[0].rank == 5);
  CHECK(events[0].step >= 8);
  CHECK(events[0].step <= 12);
  CHECK(events[0].evidence.find("compute-only") != std::string::npos);

  // Recovery.
  for (uint64_t s = 20; s < 30; ++s) {
    std::vector<double> compute(16, 100.0);
    for (const auto& t : sync_step(s, compute, transfer)) REQUIRE(m.ingest(t).ok());
  }
  const auto later = m.take_events();
  REQUIRE(later.size() == 1);
  CHECK(later[0].kind == MonitorEvent::Kind::rank_recovered);
  CHECK(m.beliefs().slow_ranks.empty());
}

TEST_CASE("on a wide noisy job healthy ranks read nominal, and a slow one still reads slow") {
  // 1,024 ranks whose compute-only times carry 5% lognormal noise per step (the simulator's
  // default); rank 300 runs 1.25x slower. With the fixed 5% band alone (dead_band_deviations
  // = 0) up to 22 healthy ranks read slow or fast by noise at a closed step; the band widened
  // to the group's own noise keeps them nominal and still finds the slow rank.
  constexpr int kRanks = 1024;
  Monitor m(options(kRanks));
  std::mt19937_64 rng(7);
  std::normal_distribution<double> noise(0.0, 0.05);
  const std::vector<double> transfer(kRanks, 20.0);
  int worst_off_nominal = 0;
  for (uint64_t s = 0; s < 24; ++s) {
    std::vector<double> compute(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      compute[r] = 100.0 * (r == 300 ? 1.25 : 1.0) * std::exp(noise(rng));
    }
    for (const auto& t : sync_step(s, compute, transfer)) REQUIRE(m.ingest(t).ok());
    if (s < 8) continue;  // levels settle
    const Beliefs b = m.beliefs();
    int off = 0;
    for (int r = 0; r < kRanks; ++r) off += r != 300 && b.conditions.gpu_speed[r] != 1.0;
    worst_off_nominal = std::max(worst_off_nominal, off);
    CHECK(b.conditions.gpu_speed[300] < 1 / 1.1);
  }
  MESSAGE("healthy ranks off nominal, worst closed step: " << worst_off_nominal);
  CHECK(worst_off_nominal <= 2);
}

TEST_CASE("a group too noisy to read small shifts still reads a 4x slower rank as slow") {
  // 8 ranks whose levels differ by up to 40% (ranks sharing a few CPU cores): the group's
  // spread (a lower median of |speed - 1| of 0.25) would widen the band past any slowdown,
  // rank 3's 4x included; it stops short of the slow-rank threshold.
  Monitor m(options(8));
  const std::vector<double> transfer(8, 20.0);
  const std::vector<double> spread = {1.0, 1.4, 0.8, 1.0, 1.25, 0.7, 1.3, 0.9};
  for (uint64_t s = 0; s < 12; ++s) {
    std::vector<double> compute(8);
    for (int r = 0; r < 8; ++r) compute[r] = 100.0 * spread[r] * (r == 3 ? 4.0 : 1.0);
    for (const auto& t : sync_step(s, compute, transfer)) REQUIRE(m.ingest(t).ok());
  }
  const Beliefs b = m.beliefs();
  CHECK(b.conditions.gpu_speed[3] == doctest::Approx(0.25));  // 100 (the median) / 400
  CHECK(std::find(b.slow_ranks.begin(), b.slow_ranks.end(), 3) != b.slow_ranks.end());
}

TEST_CASE("without noise the fixed band alone applies: a 6% slower rank of two reads slow") {
  Monitor m(options(2));
  const std::vector<double> transfer(2, 20.0);
  for (uint64_t s = 0; s < 12; ++s) {
    for (const auto& t : sync_step(s, {100.0, 106.0}, transfer)) REQUIRE(m.ingest(t).ok());
  }
  CHECK(m.beliefs().conditions.gpu_speed[1] == doctest::Approx(100.0 / 106.0));
}

TEST_CASE("a congested node shows in transfer time net of waiting") {
  Monitor m(options(32));
  for (uint64_t s = 0; s < 15; ++s) {
    std::vector<double> compute(32, 100.0);
    compute[3] = 130;  // a mildly slow rank makes everyone else wait: must not look like congestion
    std::vector<double> transfer(32, 20.0);
    if (s >= 5) {
      for (int r = 16; r < 24; ++r) transfer[r] = 80.0;  // node 2 at a quarter bandwidth
    }
    for (const auto& t : sync_step(s, compute, transfer)) REQUIRE(m.ingest(t).ok());
  }
  const Beliefs b = m.beliefs();
  CHECK(b.conditions.node_inter_bw[2] == doctest::Approx(0.25).epsilon(0.05));
  CHECK(b.conditions.node_inter_bw[0] == doctest::Approx(1.0).epsilon(0.05));
  CHECK(b.congested_nodes == std::vector<int>{2});
  bool congestion = false;
  for (const auto& e : m.take_events()) {
    if (e.kind == MonitorEvent::Kind::congested_link) {
      CHECK(e.node == 2);
      congestion = true;
    }
  }
  CHECK(congestion);
}

TEST_CASE("NaN, negative and absurd telemetry is rejected, counted and never acted on") {
  Monitor m(options(8));
  std::vector<double> transfer(8, 10.0);
  for (uint64_t s = 0; s < 6; ++s) {
    for (const auto& t : sync_step(s, std::vector<double>(8, 50.0), transfer)) REQUIRE(m.ingest(t).ok());
  }
  auto bad = sync_step(6, std::vector<double>(8, 50.0), transfer)[2];
  auto with = [&](auto f) {
    auto t = bad;
    f(t);
    const Status s = m.ingest(t);
    CHECK(s.code() == (s.ok() ? StatusCode::kOk : StatusCode::kRejected));
    return s.message();
  };
  CHECK(with([](auto& t) { t.compute_ms = std::numeric_limits<double>::quiet_NaN(); }) == "nan");
  CHECK(with([](auto& t) { t.compute_ms = std::numeric_limits<double>::infinity(); }) ==
        "infinite");
  CHECK(with([](auto& t) { t.compute_ms = -5; }) == "negative");
  CHECK(with([](auto& t) { t.compute_ms = -std::numeric_limits<double>::infinity(); }) ==
        "infinite");
  CHECK(with([](auto& t) { t.step_end_ns = t.step_start_ns - 1; }) == "negative");
  CHECK(with([](auto& t) { t.compute_ms = 5e8; }) == "absurd");
  CHECK(with([](auto& t) { t.compute_ms = 1e4; }) == "absurd");  // longer than its own step
  CHECK(with([](auto& t) { t.collectives["x/inter"].ms = std::nan(""); }) == "nan");
  CHECK(with([](auto& t) { t.layers[0].norm = -1; }) == "negative");
  CHECK(with([](auto& t) { t.rank = 99; }) == "unknown_rank");
  CHECK(with([](auto& t) { t.step = 1ull << 40; }) == "absurd_step");
  CHECK(with([](auto& t) { t.step = 2; }) == "duplicate");  // rank 2 reported step 2 already
  CHECK(m.ingest(bad).ok());
  CHECK(m.ingest(bad).message() == "duplicate");
  const MonitorCounters c = m.counters();
  CHECK(c.rejected == 13);
  CHECK(c.rejected_by_reason.at("absurd") == 2);
  CHECK(c.rejected_by_reason.at("nan") == 2);
  CHECK(c.rejected_by_reason.at("negative") == 3);
  CHECK(m.beliefs().slow_ranks.empty());
  CHECK(m.beliefs().conditions.gpu_speed[2] == doctest::Approx(1.0));

  // Without an upper bound an infinite time is still refused, and -0 is not negative.
  MonitorOptions unbounded = options(8);
  unbounded.max_compute_ms = std::numeric_limits<double>::infinity();
  Monitor u(unbounded);
  auto t = bad;
  t.compute_ms = std::numeric_limits<double>::infinity();
  CHECK(u.ingest(t).message() == "infinite");
  t.compute_ms = -0.0;
  CHECK(u.ingest(t).ok());
}

TEST_CASE("a sample that arrives after its step closed is used for its rank, not rejected") {
  Monitor m(options(4));
  std::vector<double> transfer(4, 10.0);
  std::vector<transport::Telemetry> held;
  for (uint64_t s = 0; s < 12; ++s) {
    std::vector<double> compute(4, 50.0);
    if (s >= 2) compute[3] = 150;  // rank 3 slows down, and its telemetry is delayed
    for (auto& t : sync_step(s, compute, transfer)) {
      if (t.rank == 3 && s >= 2) {
        held.push_back(t);
      } else {
        CHECK(m.ingest(t).ok());
      }
    }
  }
  REQUIRE(m.counters().steps_closed >= 2);  // steps 2.. closed without rank 3 (lag)
  for (const auto& t : held) CHECK(m.ingest(t).ok());
  const MonitorCounters c = m.counters();
  CHECK(c.rejected == 0);
  CHECK(c.late >= 1);
  // Used, not only counted: rank 3's own level learnt the slowdown only late samples carried.
  const Beliefs b = m.beliefs();
  REQUIRE(b.rank_compute_ms.size() == 4);
  CHECK(b.rank_compute_ms[3] > 120);
  CHECK(b.rank_compute_ms[0] == doctest::Approx(50).epsilon(0.05));
  CHECK(m.ingest(held.front()).message() == "duplicate");
}

TEST_CASE("a step closes when every live rank reported, or late with the missing counted") {
  Monitor m(options(8));
  for (int r = 0; r < 8; ++r) m.rank_connected(r);
  std::vector<uint64_t> closed;
  m.set_step_callback([&](uint64_t step, Clock::time_point) { closed.push_back(step); });
  auto step0 = sync_step(0, std::vector<double>(8, 50.0), std::vector<double>(8, 10.0));
  for (int r = 0; r < 7; ++r) REQUIRE(m.ingest(step0[r]).ok());
  CHECK(closed.empty());
  REQUIRE(m.ingest(step0[7]).ok());
  CHECK(closed == std::vector<uint64_t>{0});
  // Rank 7's samples of step 1 go missing; the step closes once a rank is two steps ahead.
  for (uint64_t s = 1; s <= 3; ++s) {
    auto ts = sync_step(s, std::vector<double>(8, 50.0), std::vector<double>(8, 10.0));
    for (int r = 0; r < (s == 1 ? 7 : 8); ++r) REQUIRE(m.ingest(ts[r]).ok());
  }
  CHECK(closed == std::vector<uint64_t>{0, 1, 2, 3});
  // A lost rank is believed failed and no longer awaited.
  m.rank_lost(7);
  auto ts = sync_step(4, std::vector<double>(8, 50.0), std::vector<double>(8, 10.0));
  for (int r = 0; r < 7; ++r) REQUIRE(m.ingest(ts[r]).ok());
  CHECK(closed.back() == 4);
  const Beliefs b = m.beliefs();
  REQUIRE(b.conditions.gpu_failed.size() == 8);
  CHECK(b.conditions.gpu_failed[7]);
  CHECK(b.live_ranks == 7);
}

TEST_CASE("nodes of another GPU type are compared with their own kind, not called congested") {
  MonitorOptions o = options(32);
  o.peer_group.assign(32, 0);
  for (int r = 16; r < 32; ++r) o.peer_group[r] = 1;  // nodes 2 and 3: another GPU type
  Monitor m(o);
  for (uint64_t s = 0; s < 10; ++s) {
    std::vector<double> compute(32, 100.0), transfer(32, 20.0);
    for (int r = 16; r < 32; ++r) {
      compute[r] = 40;   // a faster GPU...
      transfer[r] = 10;  // ...with a faster NIC
    }
    for (const auto& t : sync_step(s, compute, transfer)) REQUIRE(m.ingest(t).ok());
  }
  const Beliefs b = m.beliefs();
  CHECK(b.congested_nodes.empty());
  CHECK(b.slow_ranks.empty());
  REQUIRE(b.conditions.gpu_speed.size() == 32);
  REQUIRE(b.conditions.node_inter_bw.size() == 4);
  for (double v : b.conditions.gpu_speed) CHECK(v == 1.0);
  for (double v : b.conditions.node_inter_bw) CHECK(v == 1.0);
}

TEST_CASE("with reported samples, a slow rank given a smaller share still reads as slow") {
  // Rank 2 is 3x slower per sample. Elastic shares give it a third of the others' samples, so
  // its compute per step equals theirs: only compute per sample tells the two apart.
  for (const bool reported : {true, false}) {
    CAPTURE(reported);
    Monitor m(options(4));
    for (uint64_t s = 0; s < 12; ++s) {
      const std::vector<double> samples{9, 9, 3, 9};
      std::vector<double> compute;
      for (int r = 0; r < 4; ++r) compute.push_back(samples[r] * (r == 2 ? 30.0 : 10.0));
      for (auto t : sync_step(s, compute, std::vector<double>(4, 5.0))) {
        if (reported)
          keys::set_info(t, keys::kSamples, static_cast<uint64_t>(samples[t.rank]));
        CHECK(m.ingest(t).ok());
      }
    }
    const Beliefs b = m.beliefs();
    if (reported) {
      CHECK(b.conditions.gpu_speed[2] == doctest::Approx(1.0 / 3).epsilon(0.02));
      CHECK(b.rank_compute_ms[2] == doctest::Approx(30.0));
      REQUIRE(b.slow_ranks.size() == 1);
      CHECK(b.slow_ranks[0] == 2);
    } else {
      CHECK(b.conditions.gpu_speed[2] == 1.0);  // per step, every rank computes 90 ms
      CHECK(b.slow_ranks.empty());
    }
  }
}

TEST_CASE("measured waits in every collective name the rank that arrives last") {
  // Ranks report their waits: rank 1 waits least in the gradient reduction, rank 3 least in
  // the other collectives, and in all of them together rank 3. Another collective in every step,
  // or in every third (a barrier every few steps): fixed_apart only when most steps have one.
  for (const int every : {1, 3}) {
    CAPTURE(every);
    Monitor m(options(4));
    for (uint64_t s = 0; s < 20; ++s) {
      const bool other = s % static_cast<uint64_t>(every) == 0;
      for (auto t : sync_step(s, {10, 10, 10, 10}, std::vector<double>(4, 60.0))) {
        const double dp[4] = {30, 10, 30, 25};
        const double rest[4] = {20, 20, 20, 1};
        t.collectives[keys::kWaitDp] = {dp[t.rank], 0, 1};
        t.collectives[keys::kWaitOther] = {other ? rest[t.rank] : 0.0, 0, other ? 1u : 0u};
        CHECK(m.ingest(t).ok());
      }
    }
    const Beliefs b = m.beliefs();
    REQUIRE(b.rank_wait_ms.size() == 4);
    const auto least = std::min_element(b.rank_wait_ms.begin(), b.rank_wait_ms.end());
    if (every == 1) {
      CHECK(least - b.rank_wait_ms.begin() == 3);
      CHECK(b.rank_wait_ms[3] == doctest::Approx(26).epsilon(0.01));
    }
    CHECK(b.fixed_apart == (every == 1));
  }
  // Without measured waits the belief says so.
  Monitor m(options(4));
  for (uint64_t s = 0; s < 5; ++s) {
    for (auto t : sync_step(s, {10, 10, 10, 10}, std::vector<double>(4, 5.0))) CHECK(m.ingest(t).ok());
  }
  CHECK(m.beliefs().rank_wait_ms == std::vector<double>(4, -1.0));
  CHECK_FALSE(m.beliefs().fixed_apart);
}

TEST_CASE("a sample handed in directly and its bus message are read alike") {
  StepSample x;
  x.rank = 3;
  x.step = 17;
  x.start_ns = 1'000'000'000;
  x.end_ns = 1'250'000'000;
  x.compute_ms = 180;
  x.samples = 24;
  x.fixed_ms = 12;
  x.wait_ms = 20;
  x.other_wait_ms = 7;
  x.other_calls = 2;
  x.inter_bytes = 5e8;
  x.inter_ms = 60;
  x.queue_depth = 2;
  x.dp_bytes = 4e6;
  x.layers = {{0, 1.5f, 0.25f, 0}, {1, 0.5f, 0.125f, 3}};
  const StepSample back = to_sample(to_telemetry(x));
  CHECK(back.dp_bytes == x.dp_bytes);
  CHECK(back.rank == x.rank);
  CHECK(back.step == x.step);
  CHECK(back.start_ns == x.start_ns);
  CHECK(back.end_ns == x.end_ns);
  CHECK(back.compute_ms == x.compute_ms);
  CHECK(back.samples == x.samples);
  CHECK(back.fixed_ms == x.fixed_ms);
  CHECK(back.wait_ms == x.wait_ms);
  CHECK(back.other_wait_ms == x.other_wait_ms);
  CHECK(back.other_calls == x.other_calls);
  CHECK(back.inter_bytes == x.inter_bytes);
  CHECK(back.inter_ms == x.inter_ms);
  CHECK(back.queue_depth == x.queue_depth);
  CHECK(back.layers == x.layers);

  // Bad values are refused the same way on both paths.
  MonitorOptions o;
  o.ranks = 4;
  Monitor m(o);
  StepSample bad = x;
  bad.compute_ms = std::numeric_limits<double>::quiet_NaN();
  CHECK(m.ingest(bad).message() == "nan");
  CHECK(m.ingest(to_telemetry(bad)).message() == "nan");
  bad = x;
  bad.rank = 4;
  CHECK(m.ingest(bad).message() == "unknown_rank");
  bad = x;
  bad.fixed_ms = -3;
  CHECK(m.ingest(bad).message() == "negative");
  CHECK(m.ingest(x).ok());
  CHECK(m.counters().rejected == 4);
}

namespace {

// One synchronous DDP step as the Python client reports it: every rank starts together,
// computes compute_ms[r], reaches the gradient all-reduce and waits there for the last arrival
// and then for the transfer (link_ms after the last arrival); wait/dp and the bytes its
// collectives reduced are reported.
std::vector<StepSample> ddp_step(uint64_t step, const std::vector<double>& compute_ms,
                                 double link_ms, double bytes) {
  const double last = *std::max_element(compute_ms.begin(), compute_ms.end());
  const uint64_t start = 1'000'000'000ull * (step + 1);
  std::vector<StepSample> out;
  for (size_t r = 0; r < compute_ms.size(); ++r) {
    StepSample x;
    x.rank = static_cast<int>(r);
    x.step = step;
    x.start_ns = start;
    x.end_ns = start + static_cast<uint64_t>((last + link_ms) * 1e6);
    x.compute_ms = compute_ms[r];
    x.wait_ms = last - compute_ms[r] + link_ms;
    x.dp_bytes = bytes;
    out.push_back(x);
  }
  return out;
}

struct LinkRun {
  std::vector<MonitorEvent> events;
  Beliefs beliefs;
};

// `steps` steps of 4 ranks with seeded noise (+-5% compute, +-10% link): compute 2 ms per rank
// times slow(step, rank), the link `link(step)` ms for `bytes(step)` bytes.
template <class Slow, class Link, class Bytes>
LinkRun run_link(int steps, Slow slow, Link link, Bytes bytes) {
  Monitor m(options(4));
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(-1, 1);
  LinkRun out;
  for (int s = 0; s < steps; ++s) {
    std::vector<double> compute(4);
    for (int r = 0; r < 4; ++r) compute[r] = 2.0 * (1 + 0.05 * u(rng)) * slow(s, r);
    const double l = link(s) * (1 + 0.1 * u(rng));
    for (const StepSample& x : ddp_step(static_cast<uint64_t>(s), compute, l, bytes(s))) {
      REQUIRE(m.ingest(x).ok());
    }
    for (MonitorEvent& e : m.take_events()) out.events.push_back(std::move(e));
  }
  out.beliefs = m.beliefs();
  return out;
}

std::vector<MonitorEvent> of_kind(const std::vector<MonitorEvent>& events,
                                  MonitorEvent::Kind kind) {
  std::vector<MonitorEvent> out;
  for (const MonitorEvent& e : events) {
    if (e.kind == kind) out.push_back(e);
  }
  return out;
}

}  // namespace

TEST_CASE("a slow link: every rank's wait rises, compute does not: slow_link, then restored") {
  const LinkRun run = run_link(
      90, [](int, int) { return 1.0; },
      [](int s) { return s >= 30 && s < 60 ? 70.0 : 7.0; }, [](int) { return 1.1e6; });
  const auto slow = of_kind(run.events, MonitorEvent::Kind::slow_link);
  REQUIRE(slow.size() == 1);
  CHECK(slow[0].step >= 30);
  CHECK(slow[0].step <= 34);
  CHECK(slow[0].value < 0.2);  // 7 of 70 ms: a tenth of the reference bandwidth
  CHECK(slow[0].evidence.find("beyond the noise bound") != std::string::npos);
  const auto restored = of_kind(run.events, MonitorEvent::Kind::link_restored);
  REQUIRE(restored.size() == 1);
  CHECK(restored[0].step >= 60);
  CHECK(restored[0].step <= 64);
  CHECK(of_kind(run.events, MonitorEvent::Kind::slow_rank).empty());
  CHECK_FALSE(run.beliefs.slow_link);
  CHECK(run.beliefs.dp_bytes == doctest::Approx(1.1e6));
  CHECK(run.beliefs.dp_link_ms == doctest::Approx(7).epsilon(0.15));
  CHECK(run.beliefs.dp_bandwidth == doctest::Approx(1.1e6 / 7 / 1e3).epsilon(0.15));

  // While the link is slow the beliefs say so, with the figures.
  const LinkRun during = run_link(
      45, [](int, int) { return 1.0; }, [](int s) { return s >= 30 ? 70.0 : 7.0; },
      [](int) { return 1.1e6; });
  CHECK(during.beliefs.slow_link);
  CHECK(during.beliefs.dp_link_ms == doctest::Approx(70).epsilon(0.15));
  CHECK(during.beliefs.dp_explained_ms == doctest::Approx(7).epsilon(0.15));
  CHECK(during.beliefs.dp_reference == doctest::Approx(1.1e6 / 7 / 1e3).epsilon(0.15));
}

TEST_CASE("one slow rank raises the others' waits, not its own: slow_rank, not a slow link") {
  const LinkRun run = run_link(
      60, [](int s, int r) { return s >= 30 && r == 1 ? 3.0 : 1.0; }, [](int) { return 7.0; },
      [](int) { return 1.1e6; });
  const auto slow = of_kind(run.events, MonitorEvent::Kind::slow_rank);
  REQUIRE(slow.size() == 1);
  CHECK(slow[0].rank == 1);
  CHECK(of_kind(run.events, MonitorEvent::Kind::slow_link).empty());
  CHECK_FALSE(run.beliefs.slow_link);
  CHECK(run.beliefs.dp_link_ms == doctest::Approx(7).epsilon(0.15));
}

TEST_CASE("a slow rank and a slow link at once: both are named") {
  const LinkRun run = run_link(
      60, [](int s, int r) { return s >= 30 && r == 2 ? 3.0 : 1.0; },
      [](int s) { return s >= 30 ? 70.0 : 7.0; }, [](int) { return 1.1e6; });
  const auto slow = of_kind(run.events, MonitorEvent::Kind::slow_rank);
  REQUIRE(slow.size() == 1);
  CHECK(slow[0].rank == 2);
  CHECK(of_kind(run.events, MonitorEvent::Kind::slow_link).size() == 1);
  CHECK(run.beliefs.slow_link);
}

TEST_CASE("a wait that the bytes explain is no slow link: twice the bytes in twice the time") {
  const LinkRun run = run_link(
      60, [](int, int) { return 1.0; }, [](int s) { return s >= 30 ? 14.0 : 7.0; },
      [](int s) { return s >= 30 ? 2.2e6 : 1.1e6; });
  CHECK(run.events.empty());
  CHECK_FALSE(run.beliefs.slow_link);
  CHECK(run.beliefs.dp_bandwidth == doctest::Approx(1.1e6 / 7 / 1e3).epsilon(0.15));
  // Steps where the ranks do not report their gradient bytes say nothing of the link.
  const LinkRun silent = run_link(
      60, [](int, int) { return 1.0; }, [](int s) { return s >= 30 ? 70.0 : 7.0; },
      [](int) { return 0.0; });
  CHECK(silent.events.empty());
  CHECK(silent.beliefs.dp_bandwidth == 0);
}

namespace {

// A seeded stream of per-rank samples over `steps` steps of 32 ranks (4 nodes): noisy compute,
// a rank slowed 3x from step 10, node 2's network congested from step 14, samples missing,
// a duplicate and a NaN sample mixed in. One vector per delivery (two steps each).
std::vector<std::vector<StepSample>> sample_stream(int steps) {
  std::mt19937_64 rng(11);
  std::normal_distribution<double> noise(0.0, 0.05);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<std::vector<StepSample>> deliveries;
  for (int step = 0; step < steps; ++step) {
    if (step % 2 == 0) deliveries.emplace_back();
    std::vector<StepSample>& out = deliveries.back();
    const uint64_t start = 1'000'000'000ull * (step + 1);
    for (int r = 0; r < 32; ++r) {
      if (r != 3 && r != 9 && uniform(rng) < 0.05) continue;  // missing
      StepSample x;
      x.rank = r;
      x.step = static_cast<uint64_t>(step);
      x.start_ns = start;
      x.end_ns = start + 900'000'000;
      const double slow = r == 5 && step >= 10 ? 3.0 : 1.0;
      x.compute_ms = (r % 4 == 0 ? 200.0 : 150.0) * slow * std::exp(noise(rng));
      x.samples = r % 4 == 0 ? 8 : 6;
      x.fixed_ms = 10;
      x.inter_bytes = 1e8;
      const double bw = r / 8 == 2 && step >= 14 ? 0.25 : 1.0;
      x.inter_ms = 100.0 / bw * std::exp(noise(rng));
      out.push_back(x);
      if (r == 9 && step == 7) out.push_back(x);  // a duplicate
      if (r == 3 && step == 12) {
        x.compute_ms = std::numeric_limits<double>::quiet_NaN();
        out.push_back(x);
      }
    }
  }
  return deliveries;
}

void check_same(const Beliefs& a, const Beliefs& b) {
  CHECK(a.conditions.gpu_speed == b.conditions.gpu_speed);
  CHECK(a.conditions.node_inter_bw == b.conditions.node_inter_bw);
  CHECK(a.conditions.gpu_failed == b.conditions.gpu_failed);
  CHECK(a.rank_compute_ms == b.rank_compute_ms);
  CHECK(a.rank_fixed_ms == b.rank_fixed_ms);
  CHECK(a.rank_steps_per_s == b.rank_steps_per_s);
  CHECK(a.rank_lateness_ms == b.rank_lateness_ms);
  CHECK(a.last_step_ms == b.last_step_ms);
  CHECK(a.missing_fraction == b.missing_fraction);
  CHECK(a.last_closed_step == b.last_closed_step);
  CHECK(a.slow_ranks == b.slow_ranks);
  CHECK(a.congested_nodes == b.congested_nodes);
}

}  // namespace

TEST_CASE("samples handed in together leave the monitor as one at a time does") {
  // Peer groups by "GPU type" (ranks r % 4 == 0 are another kind), and the same partition
  // under other group ids: only which ranks share a group matters.
  MonitorOptions o = options(32);
  o.close_lag_steps = 1;
  MonitorOptions renamed = o;
  for (int r = 0; r < 32; ++r) {
    o.peer_group.push_back(r % 4 == 0 ? 1 : 0);
    renamed.peer_group.push_back(r % 4 == 0 ? -7 : 100);
  }
  Monitor one(o), together(o), other_ids(renamed);
  std::vector<uint64_t> closed_one, closed_together;
  one.set_step_callback([&](uint64_t step, Clock::time_point) { closed_one.push_back(step); });
  together.set_step_callback(
      [&](uint64_t step, Clock::time_point) { closed_together.push_back(step); });
  for (Monitor* m : {&one, &together, &other_ids}) {
    for (int r = 0; r < 32; ++r) m->rank_connected(r);
  }
  const Clock::time_point arrival{};
  size_t accepted_one = 0, accepted_together = 0;
  for (std::vector<StepSample>& delivery : sample_stream(24)) {
    for (const StepSample& x : delivery) {
      const bool accepted = one.ingest(x, arrival).ok();
      accepted_one += accepted;
      CHECK(other_ids.ingest(x, arrival).ok() == accepted);  // group ids do not change it
    }
    accepted_together += together.ingest(std::move(delivery), arrival);
    CHECK(delivery.empty());
    check_same(one.beliefs(), together.beliefs());
    check_same(one.beliefs(), other_ids.beliefs());
  }
  CHECK(accepted_one == accepted_together);
  CHECK(closed_one == closed_together);
  CHECK(closed_one.size() >= 20);
  const MonitorCounters a = one.counters(), b = together.counters();
  CHECK(a.accepted == b.accepted);
  CHECK(a.rejected == b.rejected);
  CHECK(a.rejected_by_reason == b.rejected_by_reason);
  CHECK(a.rejected == 2);  // the duplicate and the NaN
  CHECK(a.steps_closed == b.steps_closed);
  CHECK(a.outliers == b.outliers);
  // The stream's slow rank and congested node are found on every path.
  const Beliefs end = together.beliefs();
  CHECK(std::find(end.slow_ranks.begin(), end.slow_ranks.end(), 5) != end.slow_ranks.end());
  CHECK(std::find(end.congested_nodes.begin(), end.congested_nodes.end(), 2) !=
        end.congested_nodes.end());
  const auto events_one = one.take_events(), events_together = together.take_events();
  REQUIRE(events_one.size() == events_together.size());
  for (size_t i = 0; i < events_one.size(); ++i) {
    CHECK(events_one[i].kind == events_together[i].kind);
    CHECK(events_one[i].rank == events_together[i].rank);
    CHECK(events_one[i].node == events_together[i].node);
    CHECK(events_one[i].evidence == events_together[i].evidence);
  }
}

TEST_CASE("a pipeline stage's facts are read from its telemetry, smoothed, and start afresh when "
          "its blocks change") {
  StepSample x;
  x.rank = 1;
  x.step = 0;
  x.start_ns = 1'000'000'000;
  x.end_ns = 1'050'000'000;
  x.compute_ms = 20;
  x.stage = {4, 3, 8, {1.0, 2.0, 3.0}, 5.0, 1e6};
  CHECK(to_sample(to_telemetry(x)).stage == x.stage);
  // Not every block reported, or more blocks than a stage reports: no block's compute.
  transport::Telemetry t = to_telemetry(x);
  t.measures.erase(keys::block_ms_key(5));
  CHECK(to_sample(t).stage.block_ms.empty());
  CHECK(to_sample(t).stage.blocks == 3);
  StepSample wide = x;
  wide.stage.blocks = 61;
  wide.stage.block_ms.assign(61, 1.0);
  CHECK(to_sample(to_telemetry(wide)).stage.block_ms.empty());
  // A job that is no pipeline leaves rank_stage empty.
  CHECK(to_sample(sync_step(0, {1, 1}, {0, 0})[0]).stage.first_block == -1);

  Monitor m(options(2));
  auto step = [&](uint64_t s, int first, std::vector<double> block_ms) {
    StepSample a = x, b = x;
    a.rank = 0;
    a.stage = {0, first, 8, std::vector<double>(static_cast<size_t>(first), 1.0), 5.0, 1e6};
    b.stage.first_block = first;
    b.stage.block_ms = std::move(block_ms);
    for (StepSample* y : {&a, &b}) {
      y->step = s;
      y->start_ns = x.start_ns + s * 100'000'000;
      y->end_ns = y->start_ns + 50'000'000;
      REQUIRE(m.ingest(*y).ok());
    }
  };
  step(0, 4, {1.0, 2.0, 3.0});
  REQUIRE(m.beliefs().rank_stage.size() == 2);
  CHECK(m.beliefs().rank_stage[1] == x.stage);
  CHECK(m.beliefs().rank_stage[0].first_block == 0);
  step(1, 4, {2.0, 2.0, 3.0});
  CHECK(m.beliefs().rank_stage[1].block_ms[0] == doctest::Approx(1.2));
  CHECK(m.beliefs().rank_stage[1].block_ms[1] == doctest::Approx(2.0));
  // The stage now starts at block 5: what it measured before says nothing of its new blocks.
  step(2, 5, {4.0, 4.0, 4.0});
  CHECK(m.beliefs().rank_stage[1].first_block == 5);
  CHECK(m.beliefs().rank_stage[1].block_ms == std::vector<double>{4.0, 4.0, 4.0});
  // A block's compute is checked as every other figure is.
  StepSample bad = x;
  bad.step = 3;
  bad.stage.block_ms[1] = std::numeric_limits<double>::quiet_NaN();
  CHECK(m.ingest(bad).message() == "nan");
}
