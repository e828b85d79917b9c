// Hybrid layouts on real multi-process Gloo clusters on loopback (the test program starts
// itself as the workers, main.cc --live-worker), against one process on the whole batch; and
// the boundary's control reduction on every backend this machine has. Assertions never depend
// on machine speed; every wait has a timeout.
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "env/live/collectives.h"
#include "env/live/local_cluster.h"
#include "env/live/worker.h"
// c10d's headers bring glog, whose CHECK would replace doctest's: doctest comes last.
#undef CHECK
#include <doctest/doctest.h>

#include "tests/live/live_test_util.h"
#include "tests/test_util.h"

using namespace parapilot::live;
using parapilot::testing::ok;

namespace {

using parapilot::live::testing::check_all_finished;
using parapilot::live::testing::four_block_args;
using parapilot::live::testing::read_floats;
using parapilot::live::testing::read_text;

std::string temp_dir(const std::string& name) {
  return parapilot::live::testing::temp_dir("hybrid", name);
}

// four_block_args for 3 steps, the whole model dumped to `dump`.
std::vector<std::string> three_steps_args(const std::string& dump) {
  std::vector<std::string> args = four_block_args();
  args.insert(args.end(), {"--steps", "3", "--dump-params", dump});
  return args;
}

// Runs `workers` ranks with `extra` flags; every rank must finish cleanly.
void run_cluster(int workers, std::vector<std::string> args, const std::string& logs) {
  const auto started =
      ok(LocalCluster::start(parapilot::live::testing::cluster(workers, std::move(args), false, logs)));
  LocalCluster& c = *started;
  for (const auto& e : c.wait(120)) {
    INFO(e.describe() << " (logs in " << logs << ")");
    CHECK(e.exited);
    CHECK(e.signal == 0);
    CHECK(e.code == 0);
  }
}

}  // namespace

TEST_CASE(
    "hybrid layouts: pipeline, tensor and data parallel give the update of one process on "
    "the whole batch") {
  const std::string dir = temp_dir("layouts");
  run_cluster(1, three_steps_args(dir + "/one.bin"), dir);
  const std::vector<float> one = read_floats(dir + "/one.bin");
  REQUIRE(one.size() == 68032);  // the whole 4-block model
  double max_abs = 0;
  for (float x : one) max_abs = std::max(max_abs, std::abs(static_cast<double>(x)));
  REQUIRE(max_abs > 0);

  struct Case {
    const char* layout;
    int workers;
  };
  for (const Case c : {Case{"dp=1,pp=2", 2}, Case{"pp=2,stages=[1,3]", 2}, Case{"tp=2", 2},
                       Case{"dp=2,tp=2", 4}, Case{"dp=2,pp=2", 4}, Case{"tp=2,pp=2", 4}}) {
    {
      const std::string layout = c.layout;
      CAPTURE(layout);
      const std::string logs = dir + "/" + std::to_string(c.workers) + "-" +
                               std::to_string(std::hash<std::string>{}(c.layout));
      std::filesystem::create_directories(logs);
      std::vector<std::string> args = three_steps_args(logs + "/params.bin");
      args.insert(args.end(), {"--layout", c.layout});
      run_cluster(c.workers, args, logs);
      const std::vector<float> got = read_floats(logs + "/params.bin");
      REQUIRE(got.size() == one.size());
      // Relative error: the largest |difference| over the largest |parameter|.
      double max_diff = 0;
      for (std::size_t i = 0; i < one.size(); ++i)
        max_diff =
            std::max(max_diff, std::abs(static_cast<double>(got[i]) - static_cast<double>(one[i])));
      INFO("max |difference| " << max_diff << " of max |parameter| " << max_abs);
      CHECK(max_diff / max_abs < 1e-4);
      MESSAGE(layout << ": parameters within " << max_diff / max_abs << " of one process");
      const std::string log = read_text(logs + "/worker-0.log");
      INFO(log);
      CHECK(log.find("3 steps, final loss") != std::string::npos);
      if (std::string(c.layout).find("tp=2") != std::string::npos) {
        // Tensors replicated in a TP group (norms, biases after the all-reduce, embeddings,
        // the head) stay equal on its ranks.
        const std::string key = "tensor-parallel replicas differ by at most ";
        const std::size_t at = log.find(key);
        REQUIRE(at != std::string::npos);
        CHECK(std::stod(log.substr(at + key.size())) <= 1e-6);
      }
    }
  }
  // The bound can fail: one step fewer of the same training is far outside it.
  std::vector<std::string> shorter = three_steps_args(dir + "/shorter.bin");
  shorter[static_cast<std::size_t>(std::find(shorter.begin(), shorter.end(), "--steps") -
                                   shorter.begin() + 1)] = "2";
  run_cluster(1, shorter, dir);
  const std::vector<float> two_steps = read_floats(dir + "/shorter.bin");
  REQUIRE(two_steps.size() == one.size());
  double step_diff = 0;
  for (std::size_t i = 0; i < one.size(); ++i)
    step_diff = std::max(step_diff,
                         std::abs(static_cast<double>(two_steps[i]) - static_cast<double>(one[i])));
  MESSAGE("one Adam step moves the parameters by " << step_diff / max_abs << " relative");
  CHECK(step_diff / max_abs > 3e-4);
  std::filesystem::remove_all(dir);
}

TEST_CASE("control reduction: a deploy-sized plan id survives exactly (local and Gloo)") {
  constexpr std::uint64_t kPlan = 1'800'000'000'000'123ull;
  // The id float32 would make of it: the bug this guards against.
  CHECK(static_cast<std::uint64_t>(static_cast<double>(static_cast<float>(kPlan))) != kPlan);
  {
    auto local = make_local_collectives();
    const BoundaryDecision d = ok(agree_at_boundary(*local, kPlan, false));
    CHECK(d.plan_id == kPlan);
    CHECK(!d.stop);
  }
  // Two Gloo ranks in this process over an in-memory store: the maximum of the ids and flags.
  auto store = c10::make_intrusive<c10d::HashStore>();
  BoundaryDecision got[2];
  std::string errors[2];
  auto rank = [&](int r) {
    GroupOptions o;
    o.timeout_s = 20;
    auto c = make_gloo_collectives(store, r, 2, o);
    if (!c.ok()) {
      errors[r] = c.status().message();
      return;
    }
    const auto d = agree_at_boundary(**c, r == 0 ? kPlan : kPlan - 100, r == 1);
    if (!d.ok()) {
      errors[r] = d.status().message();
      return;
    }
    got[r] = *d;
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].empty());
    CHECK(got[r].plan_id == kPlan);
    CHECK(got[r].stop);
  }
}

TEST_CASE(
    "hybrid layouts: a killed rank stops its pipeline and TP peers on the failed transfer, "
    "no hang") {
  const std::string dir = temp_dir("kill");
  LocalClusterOptions o;
  o.workers = 4;
  o.worker_command = {"/proc/self/exe", "--live-worker"};
  o.worker_args = three_steps_args(dir + "/unused.bin");
  o.worker_args.insert(o.worker_args.end(),
                       {"--layout", "tp=2,pp=2", "--steps", "0", "--collective-timeout", "5"});
  o.host_agent = true;
  o.log_dir = dir;
  const auto started = ok(LocalCluster::start(o));
  LocalCluster& c = *started;
  REQUIRE(c.controller()->wait_for_step(1, std::chrono::seconds(60)));
  const auto t0 = std::chrono::steady_clock::now();
  c.kill_rank(2);  // TP rank 0 of the last stage
  const std::vector<RankExit> exits = c.wait(60, 30);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 45);
  CHECK(exits[2].signal == 9);
  for (int r : {0, 1, 3}) {
    INFO(exits[r].describe() << " (logs in " << dir << ")");
    CHECK(exits[r].exited);
    CHECK(exits[r].code == kWorkerCollectiveFailed);
  }
  std::filesystem::remove_all(dir);
}
