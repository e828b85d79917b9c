// tune_reactive: the reactive rule's hysteresis (min_gain), margin and cool-down chosen on
// training seeds, so that the `reactive-tuned` baseline (policy/baselines.h) is not hand-set.
// Runs every combination of a small grid on the training distribution's scenarios (seeds from
// 2^40, where training draws its episodes; evaluation uses 1000+) and prints each combination's
// mean score against the oracle, best first (ties: fewer migrations, then the longer cool-down
// and the larger margin, the more conservative rule). Usage: tune_reactive [--episodes 10]
// [SCENARIO_DIR]
// (default experiments/scenarios/train, relative to the working directory).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "agent/train/evaluate.h"
#include "env/env.h"
#include "policy/baselines.h"
#include "core/error.h"

using namespace parapilot;

int main(int argc, char** argv) {
  int episodes = 10;
  std::string dir = "experiments/scenarios/train";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--episodes") == 0 && i + 1 < argc) {
      episodes = std::atoi(argv[++i]);
    } else if (argv[i][0] == '-') {
      std::fprintf(stderr, "usage: tune_reactive [--episodes N] [SCENARIO_DIR]\n");
      return 2;
    } else {
      dir = argv[i];
    }
  }
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().extension() == ".toml") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  if (files.empty() || episodes < 1) {
    std::fprintf(stderr, "tune_reactive: no scenario files in %s (or --episodes < 1)\n", dir.c_str());
    return 2;
  }
  const uint64_t first_seed = 1ULL << 40;
  struct Env {
    std::unique_ptr<env::Env> env;
    std::vector<double> oracle;
  };
  std::vector<Env> envs;
  for (const std::string& f : files) {
    auto made = env::make_env(f);
    if (!made.ok()) {
      std::fprintf(stderr, "tune_reactive: %s\n", made.status().message().c_str());
      return 2;
    }
    Env e{std::move(*made), {}};
    for (int k = 0; k < episodes; ++k)
      e.oracle.push_back(
          parapilot::take(agent::run_oracle(*e.env, first_seed + k)).throughput_tokens_per_s);
    envs.push_back(std::move(e));
  }
  struct Row {
    policy::ReactiveOptions o;
    double score = 0, migrations = 0;
  };
  std::vector<Row> rows;
  for (double min_gain : {1.02, 1.05, 1.10, 1.15})
    for (double margin : {1.0, 2.0, 4.0})
      for (int cooldown : {0, 1, 2, 4}) {
        Row r;
        r.o.min_gain = min_gain;
        r.o.margin = margin;
        r.o.cooldown_intervals = cooldown;
        auto rule = policy::make_reactive(r.o);
        int n = 0;
        for (auto& e : envs) {
          for (int k = 0; k < episodes; ++k, ++n) {
            const auto s = parapilot::take(agent::run_episode(*e.env, *rule, first_seed + k));
            r.score += s.throughput_tokens_per_s / e.oracle[k];
            r.migrations += s.migrations;
          }
        }
        r.score /= n;
        r.migrations /= n;
        rows.push_back(r);
      }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.migrations != b.migrations) return a.migrations < b.migrations;
    if (a.o.cooldown_intervals != b.o.cooldown_intervals)
      return a.o.cooldown_intervals > b.o.cooldown_intervals;
    return a.o.margin > b.o.margin;
  });
  std::printf("reactive on %zu training scenarios x %d training seeds (from 2^40)\n", files.size(),
              episodes);
  std::printf("%8s %7s %9s %12s %11s\n", "min_gain", "margin", "cooldown", "mean score", "migrations");
  for (const Row& r : rows)
    std::printf("%8.2f %7.1f %9d %12.4f %11.2f\n", r.o.min_gain, r.o.margin, r.o.cooldown_intervals,
                r.score, r.migrations);
  const Row& best = rows.front();
  std::printf("best: min_gain %.2f, margin %.1f, cooldown %d\n", best.o.min_gain, best.o.margin,
              best.o.cooldown_intervals);
  return 0;
}
