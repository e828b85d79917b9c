// parapilot train: PPO training of the scheduling policy on a scenario, with a progress bar,
// a CSV log, periodic and best checkpoints and a learning-curve PNG.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include "agent/train/ppo.h"
#include "checkpoints/checkpoint.h"
#include "experiments/cli_common.h"
#include "experiments/commands.h"
#include "core/error.h"

namespace parapilot::cli {

namespace {

struct TrainOptions {
  std::string scenario = "mixed";
  int64_t steps = 200000;
  int envs = 8;
  int threads = 2;
  uint64_t seed = 1;
  std::string out;
  bool resume = false;
  bool overwrite = false;
  bool keep = false;          // also keep every periodic checkpoint as step-N.ckpt
  int validate_every = 5;     // updates
  int checkpoint_every = 10;  // updates
  int validation_episodes = 8;
  int hidden = 64;
  double learning_rate = 3e-4;
  double entropy_coef = 0.01;
  double switch_penalty = 0.0;
};

// "straggler" -> "sim:straggler"; ids and .toml paths pass through; a folder stands for its
// .toml files (scenarios) in name order; "ITEM*N" for N copies of ITEM (one parallel env
// each: a weight in the mix); lists stay lists.
std::string env_ids_of(const std::string& scenarios) {
  std::string out;
  // One item, without a copy count.
  auto add = [&](const std::string& item) {
    std::error_code ec;
    if (std::filesystem::is_directory(item, ec)) {
      std::vector<std::string> files;
      for (const auto& e : std::filesystem::directory_iterator(item, ec)) {
        if (e.is_regular_file() && e.path().extension() == ".toml")
          files.push_back(e.path().string());
      }
      if (files.empty()) throw InputError("--scenario " + item + ": no scenario files in this folder");
      std::sort(files.begin(), files.end());
      for (const std::string& f : files) out += (out.empty() ? "" : ",") + f;
      return;
    }
    const bool plain = item.find(':') == std::string::npos &&
                       item.find(".toml") == std::string::npos &&
                       item.find('(') == std::string::npos;
    out += (out.empty() ? "" : ",") + (plain ? "sim:" + item : item);
  };
  auto flush = [&](const std::string& item) {
    if (item.empty()) return;
    const size_t star = item.rfind('*');
    if (star == std::string::npos) return add(item);
    const std::string count = item.substr(star + 1);
    const bool digits = !count.empty() && count.size() <= 4 &&
                        std::all_of(count.begin(), count.end(), ::isdigit);
    const int copies = digits ? std::stoi(count) : 0;
    if (copies < 1) {
      throw InputError("--scenario " + item + ": a copy count after '*' must be 1 to 9999");
    }
    for (int k = 0; k < copies; ++k) add(item.substr(0, star));
  };
  std::string item;
  int depth = 0;
  for (char c : scenarios) {
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (c == ',' && depth == 0) {
      flush(item);
      item.clear();
    } else {
      item.push_back(c);
    }
  }
  flush(item);
  return out;
}

const char* kCsvHeader =
    "update,step,elapsed_s,steps_per_s,mean_reward,episode_reward,validation_score,policy_loss,"
    "value_loss,"
    "entropy,approx_kl,clip_fraction,learning_rate,cpu_s";

// Keeps the CSV rows up to `update` (a resumed run rewrites what came after its checkpoint).
void truncate_csv(const std::string& path, int64_t update) {
  std::ifstream in(path);
  std::vector<std::string> keep;
  std::string line;
  while (std::getline(in, line)) {
    if (keep.empty()) {
      keep.push_back(kCsvHeader);
      continue;
    }
    try {
      if (std::stoll(line.substr(0, line.find(','))) <= update) keep.push_back(line);
    } catch (const std::exception&) {
      // A row cut short when the run was stopped: dropped, the resumed run writes it again.
    }
  }
  if (keep.empty()) keep.push_back(kCsvHeader);
  std::ofstream out(path, std::ios::trunc);
  for (const auto& l : keep) out << l << '\n';
}

void write_learning_curve(const std::string& csv, const std::string& png,
                          const std::string& title) {
  // Validation rows only (the CSV has -1 where an update was not validated).
  const std::string data = png + ".dat";
  {
    std::ifstream in(csv);
    std::ofstream out(data);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::vector<std::string> f;
      std::stringstream fields(line);
      std::string item;
      while (std::getline(fields, item, ',')) f.push_back(item);
      if (f.size() < 10) continue;
      // minutes, steps, mean reward, validation score (or ?), entropy
      const bool validated = std::stod(f[6]) >= 0;
      out << std::stod(f[2]) / 60.0 << ' ' << f[1] << ' ' << f[4] << ' ' << (validated ? f[6] : "?")
          << ' ' << f[9] << '\n';
    }
  }
  std::ostringstream script;
  script << "set terminal pngcairo size 1100,480 font ',10'\n";
  script << "set output '" << png << ".tmp'\n";
  script << "set datafile missing '?'\nset key bottom right\nset grid\n";
  script << "set multiplot layout 1,2 title '" << title << "'\n";
  script << "set xlabel 'wall time (minutes)'\nset ylabel 'score vs oracle'\n";
  script << "plot '" << data
         << "' using 1:4 with linespoints lw 2 pt 7 ps 0.4 title 'validation (greedy)', "
         << "'' using 1:3 with lines title 'mean reward (sampled)'\n";
  script << "set xlabel 'env steps'\nset ylabel 'score vs oracle'\nset y2label 'entropy'\nset "
            "y2tics\n";
  script << "plot '" << data
         << "' using 2:4 with linespoints lw 2 pt 7 ps 0.4 title 'validation (greedy)', "
         << "'' using 2:5 axes x1y2 with lines title 'policy entropy'\n";
  script << "unset multiplot\n";
  FILE* gp = ::popen("gnuplot 2>&1", "w");
  if (!gp) throw InputError("train: cannot run gnuplot");
  std::fputs(script.str().c_str(), gp);
  const int status = ::pclose(gp);
  std::remove(data.c_str());
  if (status != 0 || std::rename((png + ".tmp").c_str(), png.c_str()) != 0) {
    std::remove((png + ".tmp").c_str());
    throw InputError("train: gnuplot could not write " + png);
  }
}

void run_train(const TrainOptions& o, bool steps_given, bool scenario_given) {
  if (o.out.empty()) throw InputError("--out: name a folder for checkpoints and logs");
  if (o.validate_every < 1 || o.checkpoint_every < 1) {
    throw InputError("--validate-every and --checkpoint-every must be >= 1");
  }
  namespace fs = std::filesystem;
  const std::string dir = o.out;
  const std::string last = (fs::path(dir) / "last.ckpt").string();
  const std::string best = (fs::path(dir) / "best.ckpt").string();
  const std::string csv = (fs::path(dir) / "metrics.csv").string();
  const std::string png = (fs::path(dir) / "learning-curve.png").string();

  std::unique_ptr<agent::PpoTrainer> trainer;
  double best_score = -1;
  // CPU seconds of the run, all threads, across resumes: its cost independent of machine load.
  double cpu_before = 0;
  auto cpu_s = [&cpu_before] {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return cpu_before + static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
  };
  if (o.resume) {
    const checkpoints::PolicyCheckpoint c = take(checkpoints::read_checkpoint(last));
    if (scenario_given && env_ids_of(o.scenario) != c.env_id) {
      throw InputError("--resume: " + last + " was trained on " + c.env_id + ", not " +
                       env_ids_of(o.scenario));
    }
    trainer = take(agent::PpoTrainer::resume(c, steps_given ? o.steps : 0));
    if (auto it = c.metrics.find("best_validation_score"); it != c.metrics.end())
      best_score = it->second;
    if (auto it = c.metrics.find("cpu_s"); it != c.metrics.end()) cpu_before = it->second;
    truncate_csv(csv, c.update);
    std::fprintf(stderr, "resuming %s at step %lld (update %lld)\n", last.c_str(),
                 static_cast<long long>(c.step), static_cast<long long>(c.update));
  } else {
    if (fs::exists(last) && !o.overwrite) {
      throw InputError(
          "--out " + dir +
          " already holds a run (last.ckpt); pass --resume, --overwrite or another folder");
    }
    agent::PpoConfig config;
    config.env_ids = env_ids_of(o.scenario);
    config.total_steps = o.steps;
    config.envs = o.envs;
    config.threads = o.threads;
    config.seed = o.seed;
    config.validation_episodes = o.validation_episodes;
    config.hidden = o.hidden;
    config.learning_rate = o.learning_rate;
    config.entropy_coef = o.entropy_coef;
    config.switch_penalty = o.switch_penalty;
    trainer = take(agent::PpoTrainer::start(config));  // validates config and env ids
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw InputError("--out " + dir + ": " + ec.message());
    fs::remove(best, ec);  // with --overwrite: no stale best.ckpt from the previous run
    std::ofstream(csv, std::ios::trunc) << kCsvHeader << '\n';
  }
  const agent::PpoConfig& config = trainer->config();
  std::ofstream log(csv, std::ios::app);
  if (!log) throw InputError("cannot write " + csv);
  std::fprintf(
      stderr,
      "training on %s: %lld steps, %d envs x %d steps per update, %lld parameters, seed %llu\n",
      config.env_ids.c_str(), static_cast<long long>(config.total_steps), config.envs,
      trainer->steps_per_update(), static_cast<long long>(trainer->parameter_count()),
      static_cast<unsigned long long>(config.seed));
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  double last_score = -1;
  while (!trainer->done()) {
    const agent::UpdateReport r = take(trainer->update());
    const bool final_update = trainer->done();
    double score = -1;
    if (r.update % o.validate_every == 0 || final_update) {
      const agent::ValidationReport v = take(trainer->validate());
      score = last_score = v.score;
      if (config.validation_episodes > 0 && score > best_score) {
        best_score = score;
        check(checkpoints::write_checkpoint(
            best, trainer->checkpoint({{"validation_score", score},
                                       {"best_validation_score", best_score},
                                       {"cpu_s", cpu_s()},
                                       {"mean_reward", r.mean_reward}})));
      }
    }
    log << r.update << ',' << r.step << ',' << r.elapsed_s << ',' << r.steps_per_s << ','
        << r.mean_reward << ',' << r.episode_reward << ',' << score << ',' << r.policy_loss << ','
        << r.value_loss << ',' << r.entropy << ',' << r.approx_kl << ',' << r.clip_fraction << ','
        << r.learning_rate << ',' << cpu_s() << '\n';
    log.flush();
    if (r.update % o.checkpoint_every == 0 || final_update) {
      const checkpoints::PolicyCheckpoint c = trainer->checkpoint({{"validation_score", last_score},
                                                             {"best_validation_score", best_score},
                                                             {"cpu_s", cpu_s()},
                                                             {"mean_reward", r.mean_reward}});
      check(checkpoints::write_checkpoint(last, c));
      if (o.keep) {
        check(checkpoints::write_checkpoint(
            (fs::path(dir) / ("step-" + std::to_string(r.step) + ".ckpt")).string(), c));
      }
    }
    const double frac = static_cast<double>(r.step) / static_cast<double>(config.total_steps);
    const int filled = static_cast<int>(std::min(1.0, frac) * 30);
    char line[256];
    std::snprintf(
        line, sizeof line,
        "[%-30s] %9lld/%lld steps %6.0f steps/s  reward %.3f  val %.3f (best %.3f)  %5.1f min",
        std::string(filled, '#').c_str(), static_cast<long long>(r.step),
        static_cast<long long>(config.total_steps), r.steps_per_s, r.mean_reward, last_score,
        best_score, r.elapsed_s / 60.0);
    if (tty) {
      std::fprintf(stderr, "\r%s", line);
    } else if (score >= 0) {
      std::fprintf(stderr, "%s\n", line);
    }
  }
  if (tty) std::fprintf(stderr, "\n");
  log.close();
  write_learning_curve(csv, png, "parapilot train " + config.env_ids);
  std::printf("trained %lld steps on %s; best validation score vs oracle %.3f\n",
              static_cast<long long>(trainer->step()), config.env_ids.c_str(), best_score);
  std::printf("wrote %s, %s, %s, %s\n", best.c_str(), last.c_str(), csv.c_str(), png.c_str());
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* cmd = app.add_subcommand("train", "Train the scheduling policy with PPO on a scenario");
  CLI::Option* scenario =
      cmd->add_option(
             "--scenario", o->scenario,
             "Scenario family, env id, scenario TOML or folder of them; a comma-separated list trains "
             "on several, one parallel env each; ITEM*N counts ITEM N times")
          ->capture_default_str();
  CLI::Option* steps =
      cmd->add_option("--steps", o->steps, "Env steps in total")->capture_default_str();
  cmd->add_option("--envs", o->envs, "Parallel envs (one episode each per update)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Env worker threads")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the run (same seed, same run)")
      ->capture_default_str();
  cmd->add_option("--out", o->out,
                  "Folder for checkpoints (best.ckpt, last.ckpt), metrics.csv and the plot")
      ->required();
  cmd->add_flag("--resume", o->resume, "Continue the run saved in --out/last.ckpt");
  cmd->add_flag("--keep", o->keep,
                "Also keep each periodic checkpoint as step-STEPS.ckpt (for time-to-quality)");
  cmd->add_flag("--overwrite", o->overwrite,
                "Start afresh even if --out holds a run (replaces its files)")
      ->excludes("--resume");
  cmd->add_option("--validate-every", o->validate_every, "Updates between validations")
      ->capture_default_str();
  cmd->add_option("--checkpoint-every", o->checkpoint_every, "Updates between last.ckpt writes")
      ->capture_default_str();
  cmd->add_option("--validation-episodes", o->validation_episodes,
                  "Validation episodes per scenario")
      ->capture_default_str();
  cmd->add_option("--hidden", o->hidden, "Width of the network's hidden layers")
      ->capture_default_str();
  cmd->add_option("--lr", o->learning_rate, "Initial learning rate (decays linearly to 10%)")
      ->capture_default_str();
  cmd->add_option("--entropy", o->entropy_coef, "Entropy bonus coefficient")->capture_default_str();
  cmd->add_option("--switch-penalty", o->switch_penalty,
                  "Reward subtracted per switch started, against thrashing (training only)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->callback([o, steps, scenario] { run_train(*o, steps->count() > 0, scenario->count() > 0); });
}

}  // namespace parapilot::cli
