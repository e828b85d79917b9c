// bench_closed_loop: the deploy closed loop on a live Gloo cluster (issue figure 6a).
//
//   bench_closed_loop [--workers 2] [--slow 3] [--slow-at 12] [--steps 300] [--rounds 1]
//                     [--policy reactive|CKPT] [--keep DIR]
//
// Per round, two runs of the same job back to back (so they see similar background load):
// `parapilot launch --agent deploy` and `parapilot launch --agent none`, each with the last rank
// slowed --slow times from --slow-at seconds after its start. From the workers' recorded
// telemetry and the agent's log it prints: the time from the slowdown to the agent's slow_rank
// event (detection; measured to the end of the step whose telemetry raised it) and to the first
// switch committed after it (the start of the switch step); and throughput (samples/s, step
// wall time on rank 0) before the slowdown, between it and the switch, and after the switch,
// against the run without an agent over the same windows.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "env/trace/telemetry.h"

namespace {

struct Args {
  int workers = 2;
  double slow = 3;
  double slow_at = 12;
  int steps = 300;
  int rounds = 1;
  std::string policy = "reactive";
  std::string keep;
};

constexpr int kGlobalBatch = 16;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string flags(const Args& a) {
  return " --layers 2 --d-model 64 --heads 4 --seq-len 64 --global-batch 16 --microbatch 2"
         " --threads 1 --collective-timeout 120 --corpus " PARAPILOT_SOURCE_DIR "/docs"
         " --steps " +
         std::to_string(a.steps) + " --inject rank=" + std::to_string(a.workers - 1) +
         ",slow=" + std::to_string(a.slow) + "x,at=" + std::to_string(a.slow_at) + "s";
}

using Rows = std::vector<parapilot::trace::TelemetrySample>;

Rows launch(const Args& a, const std::string& dir, bool agent) {
  std::filesystem::create_directories(dir);
  const std::string cmd = std::string(PARAPILOT_BIN) + " launch --workers " +
                          std::to_string(a.workers) +
                          (agent ? " --agent deploy --agent-policy " + a.policy : " --agent none") +
                          " --log-dir " + dir + " --record " + dir + "/telemetry.csv" + flags(a) +
                          " > " + dir + "/launch.log 2>&1";
  const int status = std::system(cmd.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "bench_closed_loop: launch failed (logs in %s)\n", dir.c_str());
    std::exit(1);
  }
  return parapilot::trace::read_telemetry(dir + "/telemetry.csv").samples;
}

// Rank `rank`'s rows by step.
std::map<long, parapilot::trace::TelemetrySample> of_rank(const Rows& rows, int rank) {
  std::map<long, parapilot::trace::TelemetrySample> out;
  for (const auto& r : rows)
    if (r.rank == rank) out[r.step] = r;
  return out;
}

// Samples/s over steps [first, last) of rank 0 (its wall clock).
double throughput(const Rows& rows, long first, long last) {
  const auto r0 = of_rank(rows, 0);
  if (first >= last || !r0.count(first) || !r0.count(last - 1)) return kNaN;
  const double seconds = r0.at(last - 1).end_s - r0.at(first).start_s;
  return seconds > 0 ? static_cast<double>(last - first) * kGlobalBatch / seconds : kNaN;
}

// The first step of `rank` starting at or after `t` seconds.
long step_at(const Rows& rows, int rank, double t) {
  for (const auto& [step, r] : of_rank(rows, rank))
    if (r.start_s >= t) return step;
  return -1;
}

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_closed_loop: %s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (s == "--workers")
        a.workers = std::stoi(next());
      else if (s == "--slow")
        a.slow = std::stod(next());
      else if (s == "--slow-at")
        a.slow_at = std::stod(next());
      else if (s == "--steps")
        a.steps = std::stoi(next());
      else if (s == "--rounds")
        a.rounds = std::stoi(next());
      else if (s == "--policy")
        a.policy = next();
      else if (s == "--keep")
        a.keep = next();
      else
        throw std::invalid_argument(s);
    } catch (const std::exception&) {
      std::fprintf(stderr,
                   "usage: bench_closed_loop [--workers N] [--slow F] [--slow-at S] [--steps N] "
                   "[--rounds N] [--policy reactive|CKPT] [--keep DIR]\n");
      return 2;
    }
  }
  if (a.workers < 2 || a.slow < 1 || a.steps < 20 || a.rounds < 1) {
    std::fprintf(stderr, "bench_closed_loop: needs --workers >= 2, --slow >= 1, --steps >= 20\n");
    return 2;
  }
  const std::string base =
      a.keep.empty() ? (std::filesystem::temp_directory_path() /
                        ("parapilot-closed-loop-" + std::to_string(::getpid())))
                           .string()
                     : a.keep;
  const int slow_rank = a.workers - 1;
  std::printf(
      "closed loop: %d Gloo workers on loopback, rank %d slowed %.1fx from %.0f s, %d steps of "
      "%d x 64 bytes (2-layer transformer, d=64), policy %s, %d round(s)\n\n",
      a.workers, slow_rank, a.slow, a.slow_at, a.steps, kGlobalBatch, a.policy.c_str(), a.rounds);
  std::printf("%-5s %8s %8s %8s | %9s %9s %9s | %9s %9s | %9s %9s\n", "round", "onset", "detect",
              "commit", "before", "during", "after", "no-agent", "no-agent", "recovered",
              "of ideal");
  std::printf("%-5s %8s %8s %8s | %9s %9s %9s | %9s %9s | %9s %9s\n", "", "step", "+s", "+s",
              "samples/s", "samples/s", "samples/s", "before", "after", "", "");
  // Sum of speeds: with shares in proportion to speed, the slowed cluster can at best run at
  // (n - 1 + 1/slow) / n of the healthy rate.
  const double ideal_fraction = (a.workers - 1 + 1 / a.slow) / a.workers;
  std::vector<double> detect_s, commit_s, before, during, after, nb, na, rec, of_ideal;
  for (int round = 0; round < a.rounds; ++round) {
    const std::string dir = base + "/round" + std::to_string(round);
    const Rows with = launch(a, dir + "/agent", true);
    const Rows without = launch(a, dir + "/none", false);
    // Onset: the slowed rank's first step starting after the slowdown began (its own clock).
    const long onset = step_at(with, slow_rank, a.slow_at);
    const auto slowed = of_rank(with, slow_rank);
    long detect_step = -1, switch_step = -1;
    std::ifstream log(dir + "/agent/agent.log");
    std::string line;
    while (std::getline(log, line)) {
      const auto e = nlohmann::json::parse(line, nullptr, false);
      if (e.is_discarded() || !e.contains("event")) continue;
      if (detect_step < 0 && e["event"] == "slow_rank" && e["rank"] == slow_rank &&
          e["step"].get<long>() >= onset)
        detect_step = e["step"].get<long>();
      if (detect_step >= 0 && switch_step < 0 && e["event"] == "migration" &&
          e["outcome"] == "committed")
        switch_step = e["switch_at_step"].get<long>();
    }
    const double d = detect_step >= 0 && slowed.count(detect_step)
                         ? slowed.at(detect_step).end_s - a.slow_at
                         : kNaN;
    const double c = switch_step >= 0 && slowed.count(switch_step)
                         ? slowed.at(switch_step).start_s - a.slow_at
                         : kNaN;
    const long end = a.steps;
    const long after_from = switch_step >= 0 ? std::min<long>(switch_step + 2, end) : end;
    const double b = throughput(with, 2, onset), du = throughput(with, onset, after_from),
                 af = throughput(with, after_from, end);
    const long onset_none = step_at(without, slow_rank, a.slow_at);
    const double b0 = throughput(without, 2, onset_none);
    const double a0 = throughput(without, onset_none + 2, end);
    const double recovered = (af - a0) / (b0 - a0);
    const double ideal = (af - a0) / (ideal_fraction * b0 - a0);
    std::printf("%-5d %8ld %8.2f %8.2f | %9.1f %9.1f %9.1f | %9.1f %9.1f | %8.1f%% %8.1f%%\n",
                round, onset, d, c, b, du, af, b0, a0, 100 * recovered, 100 * ideal);
    std::fflush(stdout);
    detect_s.push_back(d);
    commit_s.push_back(c);
    before.push_back(b);
    during.push_back(du);
    after.push_back(af);
    nb.push_back(b0);
    na.push_back(a0);
    rec.push_back(recovered);
    of_ideal.push_back(ideal);
  }
  std::printf(
      "%-5s %8s %8.2f %8.2f | %9.1f %9.1f %9.1f | %9.1f %9.1f | %8.1f%% %8.1f%%\n", "median", "",
      median(detect_s), median(commit_s), median(before), median(during), median(after),
      median(nb), median(na), 100 * median(rec), 100 * median(of_ideal));
  std::printf(
      "\nrecovered = (after - no-agent after) / (no-agent before - no-agent after): the share of\n"
      "the throughput lost to the slow rank that the agent's switch won back. of ideal: the same\n"
      "against the most shares can win back, (n - 1 + 1/slow) / n of the healthy rate (%.3f).\n"
      "Logs: %s\n",
      ideal_fraction, base.c_str());
  if (a.keep.empty()) std::filesystem::remove_all(base);
  return 0;
}
