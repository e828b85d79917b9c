// tune_rules: a rule's parameters chosen on training seeds, so that the tuned baselines are not
// hand-set. Runs every combination of a small grid on training envs (seeds from 2^40, where
// training draws its episodes; evaluation uses 1000+) and prints each combination's mean score
// against the oracle, best first (ties: fewer migrations, then the more conservative rule).
//
//   tune_rules reactive [--episodes 10] [SCENARIO_DIR | ENV_ID...]
//       min_gain, margin and cool-down of `reactive` (default: experiments/scenarios/train, the
//       13 training files); the result is `reactive-tuned` (policy/baselines.h).
//   tune_rules measured-shares [--episodes 10] [ENV_ID...]
//       min_gain and confirm of `measured-shares` (default: the dp: families the shipped policy
//       trains on); the result is the contest's measured-shares(min_gain=..,confirm=..).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "agent/train/evaluate.h"
#include "core/error.h"
#include "env/env.h"
#include "policy/baselines.h"

using namespace parapilot;

namespace {

struct Row {
  std::string params;
  double conservative = 0;  // larger: the more conservative setting, preferred on a tie
  double score = 0, migrations = 0;
};

struct TrainingEnv {
  std::unique_ptr<env::Env> env;
  std::vector<double> oracle;
};

// Scenario files of a folder, or the ids as given.
std::vector<std::string> env_ids(const std::vector<std::string>& args) {
  if (args.size() == 1 && std::filesystem::is_directory(args[0])) {
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(args[0]))
      if (e.path().extension() == ".toml") files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    return files;
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string usage =
      "usage: tune_rules reactive|measured-shares [--episodes N] [SCENARIO_DIR | ENV_ID...]\n";
  if (argc < 2 || (std::strcmp(argv[1], "reactive") != 0 &&
                   std::strcmp(argv[1], "measured-shares") != 0)) {
    std::fprintf(stderr, "%s", usage.c_str());
    return 2;
  }
  const std::string rule = argv[1];
  int episodes = 10;
  std::vector<std::string> args;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--episodes") == 0 && i + 1 < argc) {
      episodes = std::atoi(argv[++i]);
    } else if (argv[i][0] == '-') {
      std::fprintf(stderr, "%s", usage.c_str());
      return 2;
    } else {
      args.push_back(argv[i]);
    }
  }
  if (args.empty()) {
    args = rule == "reactive"
               ? std::vector<std::string>{"experiments/scenarios/train"}
               : std::vector<std::string>{"dp:random", "dp:straggler", "dp:flap", "dp:mixed",
                                          "dp:comm"};
  }
  const std::vector<std::string> ids = env_ids(args);
  if (ids.empty() || episodes < 1) {
    std::fprintf(stderr, "tune_rules: no envs (or --episodes < 1)\n");
    return 2;
  }
  const uint64_t first_seed = 1ULL << 40;
  std::vector<TrainingEnv> envs;
  for (const std::string& id : ids) {
    auto made = env::make_env(id);
    if (!made.ok()) {
      std::fprintf(stderr, "tune_rules: %s\n", made.status().message().c_str());
      return 2;
    }
    TrainingEnv e{std::move(*made), {}};
    for (int k = 0; k < episodes; ++k)
      e.oracle.push_back(
          parapilot::take(agent::run_oracle(*e.env, first_seed + k)).throughput_tokens_per_s);
    envs.push_back(std::move(e));
  }
  auto score = [&](policy::Policy& p, Row r) {
    int n = 0;
    for (auto& e : envs) {
      for (int k = 0; k < episodes; ++k, ++n) {
        const auto s = parapilot::take(agent::run_episode(*e.env, p, first_seed + k));
        r.score += s.throughput_tokens_per_s / e.oracle[k];
        r.migrations += s.migrations;
      }
    }
    r.score /= n;
    r.migrations /= n;
    return r;
  };
  std::vector<Row> rows;
  char text[160];
  if (rule == "reactive") {
    for (double min_gain : {1.02, 1.05, 1.10, 1.15})
      for (double margin : {1.0, 2.0, 4.0})
        for (int cooldown : {0, 1, 2, 4}) {
          policy::ReactiveOptions o;
          o.min_gain = min_gain;
          o.margin = margin;
          o.cooldown_intervals = cooldown;
          std::snprintf(text, sizeof text, "min_gain=%.2f,margin=%.1f,cooldown=%d", min_gain,
                        margin, cooldown);
          auto p = policy::make_reactive(o);
          rows.push_back(score(*p, {text, cooldown * 100 + margin}));
        }
  } else {
    for (double min_gain : {1.02, 1.05, 1.10, 1.15, 1.20, 1.30})
      for (int confirm : {1, 2, 3, 4}) {
        std::snprintf(text, sizeof text, "min_gain=%.2f,confirm=%d", min_gain, confirm);
        auto p = policy::make_measured_shares({min_gain, confirm});
        rows.push_back(score(*p, {text, confirm * 100 + min_gain}));
      }
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.migrations != b.migrations) return a.migrations < b.migrations;
    return a.conservative > b.conservative;
  });
  std::printf("%s on %zu training envs x %d training seeds (from 2^40)\n", rule.c_str(),
              ids.size(), episodes);
  std::printf("%-42s %12s %11s\n", "parameters", "mean score", "migrations");
  for (const Row& r : rows)
    std::printf("%-42s %12.4f %11.2f\n", r.params.c_str(), r.score, r.migrations);
  std::printf("best: %s(%s)\n", rule.c_str(), rows.front().params.c_str());
  return 0;
}
