// Simulator env steps per second, candidate generation (planning) and episode resets
// included: one thread, and vectorised on 2 threads, at 64 and 1024 GPUs. Prints figures;
// not a test. Usage: bench_env [--json FILE] [seconds_per_case] [env id...] (default: the six
// families at 64 and 1024 GPUs). --json FILE: also write the figures as JSON
// (benchmarks/report.h): "envs", one row per env id with the steps/s on one thread and
// vectorised.
//
// bench_env --steps N [env id...]: a fixed amount of work instead, N steps on one thread from
// the same seeds and actions, and a checksum of everything the steps returned (observations,
// rewards, tokens): a change that only makes the env faster leaves every checksum as it was.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/report.h"
#include "core/error.h"
#include "env/env.h"

using namespace parapilot::env;

namespace {

// The env of `id`, or the program exits with code 2 naming what is wrong with it.
std::unique_ptr<Env> env_of(const std::string& id) {
  auto env = make_env(id);
  if (!env.ok()) {
    std::fprintf(stderr, "bench_env: %s\n", env.status().message().c_str());
    std::exit(2);
  }
  return std::move(*env);
}

// A policy that mostly keeps its layout and sometimes switches, as a learner does.
int action_for(std::mt19937_64& rng) {
  return rng() % 10 == 0 ? 1 + static_cast<int>(rng() % kMaxCandidates) : 0;
}

double single(const std::string& id, double seconds) {
  auto env = env_of(id);
  std::mt19937_64 rng(1);
  uint64_t seed = 0;
  parapilot::take(env->reset(seed++));
  long steps = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    const StepResult r = env->step(action_for(rng));
    ++steps;
    if (r.truncated || r.terminated) parapilot::take(env->reset(seed++));
    if (steps % 64 == 0) {
      elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  }
  return static_cast<double>(steps) / elapsed;
}

// N steps from seed 0 with the actions of single(): the wall time and an FNV-1a checksum of
// the bytes of every observation, reward and step info.
std::pair<double, uint64_t> fixed_work(const std::string& id, long n) {
  auto env = env_of(id);
  std::mt19937_64 rng(1);
  uint64_t seed = 0, hash = 1469598103934665603ULL;
  auto mix = [&](const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 1099511628211ULL;
  };
  auto mix_observation = [&](const Observation& o) {
    mix(o.state.data(), sizeof o.state);
    mix(o.candidates.data(), sizeof o.candidates);
    mix(o.mask.data(), sizeof o.mask);
  };
  const auto start = std::chrono::steady_clock::now();
  mix_observation(parapilot::take(env->reset(seed++)));
  for (long i = 0; i < n; ++i) {
    const StepResult r = env->step(action_for(rng));
    mix_observation(r.observation);
    const double figures[] = {r.reward, r.info.tokens, r.info.best_tokens};
    mix(figures, sizeof figures);
    const int flags = r.info.migration_started | r.info.migration_committed << 1 |
                      r.info.restarted << 2 | r.truncated << 3 | r.terminated << 4;
    mix(&flags, sizeof flags);
    if (r.truncated || r.terminated) mix_observation(parapilot::take(env->reset(seed++)));
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {elapsed, hash};
}

double vectorised(const std::string& id, int envs, int threads, double seconds) {
  std::vector<std::unique_ptr<Env>> list;
  for (int i = 0; i < envs; ++i) list.push_back(env_of(id));
  VectorEnv vec(std::move(list), threads);
  parapilot::take(vec.reset(0));
  std::mt19937_64 rng(1);
  std::vector<int> actions(envs);
  long steps = 0;
  const auto start = std::chrono::steady_clock::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int& a : actions) a = action_for(rng);
    parapilot::take(vec.step(actions));
    steps += envs;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return static_cast<double>(steps) / elapsed;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json_path = parapilot::bench::take_json_flag(argc, argv);
  parapilot::bench::Report report("bench_env", argc, argv);
  nlohmann::json& fig = report.figures();
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf(
          "usage: bench_env [--json FILE] [SECONDS [ENV_ID...]]\n"
          "       bench_env [--json FILE] --steps N [ENV_ID...]\n"
          "  env steps per second, one thread and 8 envs on 2 threads, SECONDS each (3);\n"
          "  default envs: the six sim families at 64 and 1024 GPUs\n"
          "  --steps N: N steps on one thread from fixed seeds and actions, timed, with a\n"
          "    checksum of what they returned (default envs: sim:mixed at 64 and 1024 GPUs)\n"
          "  --json FILE: also write the figures as JSON\n");
      return 0;
    }
  }
  if (argc > 2 && std::strcmp(argv[1], "--steps") == 0) {
    char* end = nullptr;
    const long n = std::strtol(argv[2], &end, 10);
    if (end == argv[2] || *end != '\0' || n < 1) {
      std::fprintf(stderr, "bench_env: --steps \"%s\" is not a positive count (--help)\n",
                   argv[2]);
      return 2;
    }
    std::vector<std::string> ids;
    for (int i = 3; i < argc; ++i) ids.emplace_back(argv[i]);
    if (ids.empty()) ids = {"sim:mixed(gpus=64)", "sim:mixed(gpus=1024)"};
    std::printf("%-34s %8s %12s %16s\n", "env", "steps", "steps/s", "checksum");
    fig["fixed_work"] = nlohmann::json::array();
    for (const std::string& id : ids) {
      const auto [elapsed, hash] = fixed_work(id, n);
      std::printf("%-34s %8ld %12.0f %016llx\n", id.c_str(), n, static_cast<double>(n) / elapsed,
                  static_cast<unsigned long long>(hash));
      std::fflush(stdout);
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
      fig["fixed_work"].push_back(
          {{"env", id}, {"steps", n}, {"steps_per_s", static_cast<double>(n) / elapsed}, {"checksum", hex}});
    }
    return report.write(json_path) ? 0 : 1;
  }
  char* end = nullptr;
  const double seconds = argc > 1 ? std::strtod(argv[1], &end) : 3.0;
  if (argc > 1 && (end == argv[1] || *end != '\0' || !(seconds > 0))) {
    std::fprintf(stderr, "bench_env: SECONDS \"%s\" is not a positive number (--help)\n", argv[1]);
    return 2;
  }
  std::printf("simulator env steps/s (planning and resets included; 10%% of actions switch)\n");
  std::printf("%-34s %14s %22s\n", "env", "1 thread", "8 envs on 2 threads");
  std::vector<std::string> ids;
  for (int i = 2; i < argc; ++i) ids.emplace_back(argv[i]);
  if (ids.empty()) {
    // Every family at both sizes: the targets hold for each.
    for (const char* gpus : {"64", "1024"}) {
      for (const char* family :
           {"hetero", "straggler", "congestion", "failure", "phase", "mixed"}) {
        ids.push_back(std::string("sim:") + family + "(gpus=" + gpus + ")");
      }
    }
  }
  const int vector_envs = 8, vector_threads = 2;
  fig["seconds_per_case"] = seconds;
  fig["envs"] = nlohmann::json::array();
  for (const std::string& id : ids) {
    const double one = single(id, seconds);
    const double two = vectorised(id, vector_envs, vector_threads, seconds);
    std::printf("%-34s %14.0f %22.0f\n", id.c_str(), one, two);
    std::fflush(stdout);
    fig["envs"].push_back({{"env", id},
                           {"steps_per_s_one_thread", one},
                           {"steps_per_s_vectorised", two},
                           {"vector_envs", vector_envs},
                           {"vector_threads", vector_threads}});
  }
  std::printf("targets: >= 5000 steps/s per core at 64 GPUs, >= 500 at 1024\n");
  fig["target_steps_per_s_64_gpus"] = 5000;
  fig["target_steps_per_s_1024_gpus"] = 500;
  return report.write(json_path) ? 0 : 1;
}
