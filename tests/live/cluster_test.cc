// Real multi-process Gloo clusters on loopback: this test program starts itself as the workers
// (main.cc, --live-worker). Assertions never depend on machine speed; every wait has a timeout.
#include <doctest/doctest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "env/env.h"
#include "env/live/live_env.h"
#include "env/live/local_cluster.h"
#include "env/live/worker.h"
#include "strategy/error.h"
#ifdef PARAPILOT_HAVE_NCCL
#include "env/live/nccl_comm.h"
#endif

using namespace parapilot::live;
using namespace std::chrono_literals;

namespace {

std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() /
           ("parapilot-live-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(p);
  return p.string();
}

std::vector<std::string> tiny_model_args() {
  return {"--layers",
          "1",
          "--d-model",
          "32",
          "--heads",
          "2",
          "--seq-len",
          "16",
          "--global-batch",
          "8",
          "--microbatch",
          "1",
          "--threads",
          "1",
          "--collective-timeout",
          "10",
          "--rendezvous-timeout",
          "30"};
}

LocalClusterOptions cluster(int workers, std::vector<std::string> extra, bool agent,
                            const std::string& logs) {
  LocalClusterOptions o;
  o.workers = workers;
  o.worker_command = {"/proc/self/exe", "--live-worker"};
  o.worker_args = tiny_model_args();
  o.worker_args.insert(o.worker_args.end(), extra.begin(), extra.end());
  o.host_agent = agent;
  o.log_dir = logs;
  return o;
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

void check_all_finished(const std::vector<RankExit>& exits, const std::string& logs) {
  for (const auto& e : exits) {
    INFO(e.describe() << " (logs in " << logs << ")");
    CHECK(e.exited);
    CHECK(e.signal == 0);
    CHECK(e.code == 0);
  }
}

}  // namespace

TEST_CASE(
    "elastic data parallel: unequal shares give the same update as one process on the whole "
    "batch") {
  const std::string dir = temp_dir("elastic");
  // Two ranks with shares 3:1 (6 and 2 of the 8 microbatches) ...
  {
    LocalCluster c(
        cluster(2, {"--steps", "3", "--shares", "0.75,0.25", "--dump-params", dir + "/two.bin"},
                false, dir));
    check_all_finished(c.wait(90), dir);
  }
  // ... and one process on the whole batch, same seed.
  {
    LocalCluster c(cluster(1, {"--steps", "3", "--dump-params", dir + "/one.bin"}, false, dir));
    check_all_finished(c.wait(90), dir);
  }
  const auto two = read_floats(dir + "/two.bin"), one = read_floats(dir + "/one.bin");
  REQUIRE(!one.empty());
  REQUIRE(two.size() == one.size());
  double max_diff = 0, max_abs = 0;
  for (std::size_t i = 0; i < one.size(); ++i) {
    max_diff =
        std::max(max_diff, std::abs(static_cast<double>(two[i]) - static_cast<double>(one[i])));
    max_abs = std::max(max_abs, std::abs(static_cast<double>(one[i])));
  }
  INFO("max |difference| " << max_diff << " of max |parameter| " << max_abs);
  CHECK(max_diff < 1e-4);
  std::filesystem::remove_all(dir);
}

TEST_CASE("telemetry arrives on the bus and an action is applied at an iteration boundary") {
  const std::string dir = temp_dir("bus");
  LocalCluster c(cluster(2, {"--steps", "0"}, true, dir));
  Controller& agent = *c.controller();
  REQUIRE(agent.wait_for_ranks(2, 60s));
  REQUIRE(agent.wait_for_step(2, 60s));
  auto before = agent.take_telemetry();
  REQUIRE(!before.empty());
  for (const auto& t : before) {
    CHECK(t.layers.size() == 2 + 12 + 4);
    CHECK(t.collectives.count("all_reduce/dp") == 1);
    CHECK(t.collectives.at("all_reduce/dp").bytes > 0);
    CHECK(t.collectives.at("info/microbatches").bytes == 4);
  }
  LiveAction a;
  a.shares = {0.75, 0.25};
  a.compression.assign(18, Compression::fp16);
  const auto r = agent.apply(a, 30s);
  INFO(r.status().message());
  REQUIRE(r.ok());
  REQUIRE(agent.wait_for_step(r->switch_at_step + 2, 60s));
  bool seen_new_plan = false;
  for (const auto& t : agent.take_telemetry()) {
    if (t.collectives.at("info/plan").bytes != r->plan_id) continue;
    seen_new_plan = true;
    CHECK(t.step >= r->switch_at_step);
    CHECK(t.collectives.at("info/microbatches").bytes == (t.rank == 0 ? 6u : 2u));
  }
  CHECK(seen_new_plan);
  // A plan that does not fit the model is refused by the ranks and aborted.
  LiveAction bad;
  bad.shares = {0.2, 0.3, 0.5};
  const auto refused = agent.apply(bad, 30s);
  CHECK(refused.status().code() == parapilot::StatusCode::kRejected);
  agent.request_stop("test done");
  check_all_finished(c.wait(60), dir);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a killed worker is reported and the others stop on the collective timeout, not hang") {
  const std::string dir = temp_dir("kill");
  LocalClusterOptions o = cluster(3, {"--steps", "0", "--collective-timeout", "5"}, true, dir);
  LocalCluster c(o);
  REQUIRE(c.controller()->wait_for_step(1, 60s));
  // Kill rank 1 now (launch --inject rank=1,kill,at=Ns does the same at a set time).
  const auto t0 = std::chrono::steady_clock::now();
  c.kill_rank(1);
  const std::vector<RankExit> exits = c.wait(60, 30);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 45);
  CHECK(exits[1].signal == 9);
  for (int r : {0, 2}) {
    INFO(exits[r].describe());
    CHECK(exits[r].exited);
    CHECK(exits[r].signal == 0);
    CHECK(exits[r].code == kWorkerCollectiveFailed);
  }
  const auto lost = c.controller()->lost_ranks();
  CHECK(std::find(lost.begin(), lost.end(), 1) != lost.end());
  std::filesystem::remove_all(dir);
}

TEST_CASE(
    "live:gloo is an Env: reset starts workers, step applies a candidate and measures a reward") {
  register_live_envs();
  register_live_envs();  // idempotent
  auto env = parapilot::env::make_env(
      "live:gloo(workers=2,interval_steps=3,horizon=2,slow_rank=1,slow_factor=2,layers=1,d_model="
      "32,"
      "seq_len=16,global_batch=8,exe=/proc/self/exe,worker_arg=--live-worker)");
  CHECK(env->horizon() == 2);
  const auto obs = env->reset(7);
  for (float v : obs.state) CHECK(std::isfinite(v));
  CHECK(obs.mask[1] == 1);
  const auto r1 = env->step(2);  // elastic shares
  CHECK(r1.info.migration_committed);
  CHECK(std::isfinite(r1.reward));
  CHECK(r1.reward > 0);
  CHECK(r1.info.tokens > 0);
  CHECK(!r1.truncated);
  CHECK(!r1.terminated);
  const auto r2 = env->step(0);
  CHECK(r2.truncated);
  CHECK(!env->events().empty());
  CHECK_THROWS_AS(parapilot::env::make_env("live:mpi(workers=2)"), parapilot::InputError);
  CHECK_THROWS_AS(parapilot::env::make_env("live:gloo(workers=0)"), parapilot::InputError);
  // A misspelt parameter is refused, not silently ignored.
  CHECK_THROWS_WITH_AS(parapilot::env::make_env("live:gloo(wokers=2)"),
                       doctest::Contains("unknown parameter \"wokers\""), parapilot::InputError);
}

// A case that cannot run here: says why and, when ctest runs it alone with
// PARAPILOT_SKIP_EXIT_CODE set, exits with that code so ctest reports it skipped, not passed.
static void skip(const std::string& why) {
  MESSAGE("skipped: " << why);
  if (const char* code = std::getenv("PARAPILOT_SKIP_EXIT_CODE")) {
    std::fprintf(stderr, "SKIPPED: %s\n", why.c_str());
    std::_Exit(std::atoi(code));
  }
}

TEST_CASE("nccl backend: elastic data parallel on GPUs matches Gloo (skips without a GPU)") {
#ifndef PARAPILOT_HAVE_NCCL
  skip("this build has no CUDA/NCCL (CMake found none)");
#else
  std::string why;
  const int gpus = cuda_device_count(&why);
  if (gpus == 0) {
    skip(why);
    return;
  }
  const int world = std::min(2, gpus);
  const std::string dir = temp_dir("nccl");
  const std::string shares = world == 2 ? "0.75,0.25" : "1";
  {
    LocalCluster c(cluster(world,
                           {"--backend", "nccl", "--steps", "3", "--shares", shares,
                            "--dump-params", dir + "/nccl.bin"},
                           false, dir));
    check_all_finished(c.wait(120), dir);
  }
  {
    LocalCluster c(cluster(1, {"--steps", "3", "--dump-params", dir + "/gloo.bin"}, false, dir));
    check_all_finished(c.wait(90), dir);
  }
  const auto a = read_floats(dir + "/nccl.bin"), b = read_floats(dir + "/gloo.bin");
  REQUIRE(a.size() == b.size());
  REQUIRE(!a.empty());
  double max_diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    max_diff = std::max(max_diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  CHECK(max_diff < 1e-4);
  std::filesystem::remove_all(dir);
#endif
}
