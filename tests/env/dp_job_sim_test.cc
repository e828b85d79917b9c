// The data-parallel job simulator (env/dp/job_sim.h): the truth and telemetry of one job.
#include <doctest/doctest.h>

#include <vector>

#include "env/dp/job_sim.h"

using namespace parapilot::env;

namespace {

// 4 ranks, 32 samples a step at 2 ms each plus a 5 ms optimizer step, a 10 ms all-reduce; no
// noise, hiccups or drops; no events.
dp::Episode small_episode() {
  dp::Episode e;
  e.job.ranks = 4;
  e.job.global_batch = 32;
  e.job.per_sample_ms = 2;
  e.job.fixed_ms = 5;
  e.job.allreduce_ms = 10;
  e.job.base_slowdown = {1, 1, 1, 1};
  return e;
}

}  // namespace

TEST_CASE("dp job sim: same seed, same steps bit for bit; another seed, other steps") {
  auto steps = [](uint64_t seed) {
    dp::DataParallelJobSim sim(dp::draw_episode({dp::Family::mixed, 16, 10, 20}, seed), seed + 1);
    std::vector<double> out;
    for (int i = 0; i < 200; ++i) {
      if (i == 50) sim.set_counts(sim.best_counts());
      const auto& s = sim.step();
      out.push_back(s.wall_ms);
      out.push_back(s.best_ms);
      for (const auto& x : s.samples) {
        out.insert(out.end(), {static_cast<double>(x.rank), x.compute_ms, x.samples, x.fixed_ms,
                               x.wait_ms, x.other_wait_ms, static_cast<double>(x.end_ns)});
      }
    }
    return out;
  };
  const std::vector<double> a = steps(3);
  CHECK(a == steps(3));
  CHECK(a != steps(4));
}

TEST_CASE("dp job sim: a rank's compute is its fixed part plus its samples, slowed") {
  dp::Episode e = small_episode();
  dp::FailSlow slow;
  slow.rank = 2;
  slow.factor = 3;
  slow.start_step = 1;
  slow.end_step = 3;
  e.events = {slow};
  dp::DataParallelJobSim sim(e, 1);  // noise sigma 0, no hiccups, no drops
  const auto& first = sim.step();
  REQUIRE(first.samples.size() == 4);
  CHECK(first.samples[2].compute_ms == doctest::Approx(5 + 2 * 8));
  CHECK(first.wall_ms == doctest::Approx(21 + 10));
  CHECK(first.best_ms == doctest::Approx(first.wall_ms));
  const auto& slowed = sim.step();  // rank 2 three times slower
  CHECK(slowed.samples[2].compute_ms == doctest::Approx(3 * 21));
  CHECK(slowed.samples[2].wait_ms == doctest::Approx(0));
  CHECK(slowed.samples[0].wait_ms == doctest::Approx(3 * 21 - 21));
  CHECK(slowed.wall_ms == doctest::Approx(63 + 10));
  CHECK(slowed.best_ms < slowed.wall_ms);
  // A switch to the best shares pays one step's wall time plus 5 ms at the next step.
  const std::vector<int> best = sim.best_counts();
  CHECK(best[2] < best[0]);
  sim.set_counts(best);
  const auto& switched = sim.step();
  CHECK(switched.paused_ms == doctest::Approx(63 + 10 + 5));
  CHECK(switched.wall_ms == doctest::Approx(switched.best_ms + switched.paused_ms));
  const auto& recovered = sim.step();  // the event ended: the new shares are now the slow ones
  CHECK(recovered.paused_ms == 0);
  CHECK(recovered.best_ms < recovered.wall_ms);
}

TEST_CASE("dp job sim: with a second collective, the slowest work and the slowest fixed part add") {
  dp::Episode e;
  e.job.ranks = 2;
  e.job.global_batch = 8;
  e.job.per_sample_ms = 1;
  e.job.fixed_ms = 4;
  e.job.allreduce_ms = 2;
  e.job.fixed_apart = true;
  e.job.other_collective_ms = 0.5;
  e.job.base_slowdown = {1, 2};  // rank 1 is twice as slow
  dp::DataParallelJobSim sim(e, 1);
  const auto& s = sim.step();  // even shares: 4 samples each
  REQUIRE(s.samples.size() == 2);
  CHECK(s.wall_ms == doctest::Approx(2 * 4 + 2 + 2 * 4 + 0.5));
  CHECK(s.samples[0].wait_ms == doctest::Approx(8 - 4));
  CHECK(s.samples[0].other_wait_ms == doctest::Approx(8 - 4));
  CHECK(s.samples[0].other_calls == 1);
  CHECK(s.samples[1].wait_ms == doctest::Approx(0));
  // Shares balance only the per-sample work: about 2:1 (5.3 ms each before rounding).
  const std::vector<int> best = sim.best_counts();
  CHECK(best[0] > best[1]);
  CHECK(sim.best_step_ms() < sim.true_step_ms(sim.counts()));
}

TEST_CASE("dp job sim: a misreport changes only the telemetry, interference the truth too") {
  dp::Episode e = small_episode();
  dp::FailSlow misreport;
  misreport.kind = dp::FailSlow::Kind::misreport;
  misreport.rank = 1;
  misreport.factor = 0.5;
  misreport.start_step = 0;
  misreport.end_step = 1;
  dp::FailSlow interference = misreport;
  interference.kind = dp::FailSlow::Kind::interference;
  interference.factor = 2;
  interference.start_step = 1;
  interference.end_step = 2;
  e.events = {misreport, interference};
  dp::DataParallelJobSim sim(e, 1);
  const auto& first = sim.step();  // rank 1 reports half its per-sample work; nothing is slower
  CHECK(first.samples[1].compute_ms == doctest::Approx(5 + 0.5 * 2 * 8));
  CHECK(first.samples[1].wait_ms == doctest::Approx(0));
  CHECK(first.wall_ms == doctest::Approx(21 + 10));
  CHECK(first.best_ms == doctest::Approx(first.wall_ms));
  const auto& second = sim.step();  // rank 1 really twice as slow
  CHECK(second.samples[1].compute_ms == doctest::Approx(2 * 21));
  CHECK(second.wall_ms == doctest::Approx(42 + 10));
  CHECK(second.best_ms < second.wall_ms);
  CHECK(sim.step().wall_ms == doctest::Approx(21 + 10));  // over
}
