// bench_closed_loop: the deploy closed loop on a live Gloo cluster (docs/results.md, "Deploy on a
// live cluster").
//
//   bench_closed_loop [--workers 2] [--slow 3] [--slow-at 12] [--steps 300] [--rounds 1]
//                     [--policy reactive|CKPT] [--keep DIR] [--json FILE]
//   (--policy: default the shipped policy, as parapilot deploy runs it)
//
// Per round, two runs of the same job back to back (so they see similar background load):
// `parapilot launch --agent deploy` and `parapilot launch --agent none`, each with the last rank
// slowed --slow times from --slow-at seconds after its start. From the workers' recorded
// telemetry and the agent's log it prints: the time from the slowdown to the agent's slow_rank
// event (detection; measured to the end of the step whose telemetry raised it) and to the first
// switch committed after it (the start of the switch step); and throughput (samples/s, step
// wall time on rank 0) before the slowdown, between it and the switch, and after the switch,
// against the run without an agent over the same windows; the share of the lost throughput the
// switch won back, against the healthy rate and against the ideal (what shares in proportion to
// speed can reach), and after / ideal. --policy is passed to deploy (--agent-policy; by default
// none, so deploy runs the shipped policy); the policy the agent logged it ran is printed. --json FILE also writes every
// figure as JSON (benchmarks/report.h): "rounds" (one object per round), "median", "policy".
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

#include "benchmarks/report.h"
#include "env/trace/telemetry.h"
#include "core/error.h"

namespace {

struct Args {
  int workers = 2;
  double slow = 3;
  double slow_at = 12;
  int steps = 300;
  int rounds = 1;
  std::string policy = "default";  // deploy's own default: the shipped policy
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
                          (agent ? " --agent deploy" +
                                       (a.policy == "default" ? "" : " --agent-policy " + a.policy)
                                 : " --agent none") +
                          " --log-dir " + dir + " --record " + dir + "/telemetry.csv" + flags(a) +
                          " > " + dir + "/launch.log 2>&1";
  const int status = std::system(cmd.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "bench_closed_loop: launch failed (logs in %s)\n", dir.c_str());
    std::exit(1);
  }
  return parapilot::take(parapilot::trace::read_telemetry(dir + "/telemetry.csv")).samples;
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

/// A figure for the JSON report: null when not measured (NaN).
nlohmann::json num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); }
nlohmann::json step(long s) { return s >= 0 ? nlohmann::json(s) : nlohmann::json(); }

/// The policy the agent says it ran (its agent_started and policy_fallback log events).
struct RanPolicy {
  std::string name = "unknown";
  bool fallback = false;
  std::string reason;
};

}  // namespace

const char* const kUsage =
    "usage: bench_closed_loop [--workers N] [--slow F] [--slow-at S] [--steps N] "
    "[--rounds N] [--policy reactive|CKPT] [--keep DIR] [--json FILE]\n";

int main(int argc, char** argv) {
  if (parapilot::bench::print_help(argc, argv, kUsage)) return 0;
  const std::string json_path = parapilot::bench::take_json_flag(argc, argv);
  parapilot::bench::Report report("bench_closed_loop", argc, argv);
  nlohmann::json& fig = report.figures();
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
      std::fputs(kUsage, stderr);
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
  std::printf("%-5s %8s %8s %8s | %9s %9s %9s | %9s %9s | %9s %13s %9s\n", "round", "onset",
              "detect", "commit", "before", "during", "after", "no-agent", "no-agent", "recovered",
              "recovered", "after /");
  std::printf("%-5s %8s %8s %8s | %9s %9s %9s | %9s %9s | %9s %13s %9s\n", "", "step", "+s", "+s",
              "samples/s", "samples/s", "samples/s", "before", "after", "of total", "(of the loss)",
              "ideal");
  // Sum of speeds: with shares in proportion to speed, the slowed cluster can at best run at
  // (n - 1 + 1/slow) / n of the healthy rate.
  const double ideal_fraction = (a.workers - 1 + 1 / a.slow) / a.workers;
  fig["config"] = {{"workers", a.workers},         {"slow_rank", slow_rank}, {"slow", a.slow},
                   {"slow_at_s", a.slow_at},       {"steps", a.steps},       {"rounds", a.rounds},
                   {"global_batch", kGlobalBatch}, {"policy", a.policy}};
  fig["ideal_fraction"] = ideal_fraction;
  fig["rounds"] = nlohmann::json::array();
  std::vector<double> detect_s, commit_s, before, during, after, nb, na, rec, of_loss, over_ideal,
      ideals;
  std::vector<RanPolicy> policies;
  for (int round = 0; round < a.rounds; ++round) {
    const std::string dir = base + "/round" + std::to_string(round);
    const Rows with = launch(a, dir + "/agent", true);
    const Rows without = launch(a, dir + "/none", false);
    // Onset: the slowed rank's first step starting after the slowdown began (its own clock).
    const long onset = step_at(with, slow_rank, a.slow_at);
    const auto slowed = of_rank(with, slow_rank);
    long detect_step = -1, switch_step = -1;
    RanPolicy ran;
    std::ifstream log(dir + "/agent/agent.log");
    std::string line;
    while (std::getline(log, line)) {
      const auto e = nlohmann::json::parse(line, nullptr, false);
      if (e.is_discarded() || !e.contains("event")) continue;
      if (e["event"] == "agent_started") {
        if (e.contains("policy") && e["policy"].is_string()) ran.name = e["policy"];
        if (e.contains("fallback") && e["fallback"].is_boolean()) ran.fallback = e["fallback"];
      }
      if (e["event"] == "policy_fallback" && e.contains("reason") && e["reason"].is_string()) {
        ran.fallback = true;
        ran.reason = e["reason"];
      }
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
    // The ideal: the healthy rate (the run without an agent, before the slowdown) scaled to the
    // slowed cluster's capacity.
    const double ideal = ideal_fraction * b0;
    const double recovered = (af - a0) / (b0 - a0);
    const double recovered_of_loss = (af - a0) / (ideal - a0);
    const double after_ideal = af / ideal;
    std::printf(
        "%-5d %8ld %8.2f %8.2f | %9.1f %9.1f %9.1f | %9.1f %9.1f | %8.1f%% %12.1f%% %8.1f%%\n",
        round, onset, d, c, b, du, af, b0, a0, 100 * recovered, 100 * recovered_of_loss,
        100 * after_ideal);
    std::printf("      policy %s%s%s\n", ran.name.c_str(),
                ran.fallback ? " (FELL BACK to the reactive baseline) " : "", ran.reason.c_str());
    std::fflush(stdout);
    fig["rounds"].push_back(
        {{"round", round},
         {"onset_step", step(onset)},
         {"detect_step", step(detect_step)},
         {"switch_step", step(switch_step)},
         {"detection_delay_s", num(d)},
         {"commit_delay_s", num(c)},
         {"windows",
          {{"before", {2, onset}},
           {"during", {onset, after_from}},
           {"after", {after_from, end}},
           {"no_agent_before", {2, onset_none}},
           {"no_agent_after", {onset_none + 2, end}}}},
         {"samples_per_s",
          {{"with_agent", {{"before", num(b)}, {"during", num(du)}, {"after", num(af)}}},
           {"without_agent", {{"before", num(b0)}, {"after", num(a0)}}},
           {"ideal", num(ideal)}}},
         {"recovered_share_of_total_loss", num(recovered)},
         {"recovered_share_of_loss", num(recovered_of_loss)},
         {"after_over_ideal", num(after_ideal)},
         {"policy",
          {{"name", ran.name}, {"fallback", ran.fallback}, {"fallback_reason", ran.reason}}}});
    detect_s.push_back(d);
    commit_s.push_back(c);
    before.push_back(b);
    during.push_back(du);
    after.push_back(af);
    nb.push_back(b0);
    na.push_back(a0);
    rec.push_back(recovered);
    of_loss.push_back(recovered_of_loss);
    over_ideal.push_back(after_ideal);
    ideals.push_back(ideal);
    policies.push_back(ran);
  }
  std::printf("%-5s %8s %8.2f %8.2f | %9.1f %9.1f %9.1f | %9.1f %9.1f | %8.1f%% %12.1f%% %8.1f%%\n",
              "median", "", median(detect_s), median(commit_s), median(before), median(during),
              median(after), median(nb), median(na), 100 * median(rec), 100 * median(of_loss),
              100 * median(over_ideal));
  fig["median"] = {{"detection_delay_s", num(median(detect_s))},
                   {"commit_delay_s", num(median(commit_s))},
                   {"samples_per_s",
                    {{"with_agent",
                      {{"before", num(median(before))},
                       {"during", num(median(during))},
                       {"after", num(median(after))}}},
                     {"without_agent", {{"before", num(median(nb))}, {"after", num(median(na))}}},
                     {"ideal", num(median(ideals))}}},
                   {"recovered_share_of_total_loss", num(median(rec))},
                   {"recovered_share_of_loss", num(median(of_loss))},
                   {"after_over_ideal", num(median(over_ideal))}};
  // The policy that ran: the same in every round, unless something changed between them.
  bool same = true;
  for (const RanPolicy& p : policies)
    same = same && p.name == policies.front().name && p.fallback == policies.front().fallback;
  fig["policy"] = {{"requested", a.policy},
                   {"name", same ? policies.front().name : "mixed"},
                   {"fallback", !same || policies.front().fallback},
                   {"fallback_reason", policies.front().reason}};
  std::printf(
      "\npolicy asked for: %s; the agent ran: %s%s\n"
      "recovered of total = (after - no-agent after) / (no-agent before - no-agent after): the\n"
      "share of the throughput lost to the slow rank that the agent's switch won back, against "
      "the\n"
      "healthy rate (never 100%%: the slow rank's lost capacity cannot be won back).\n"
      "recovered (of the loss) = (after - no-agent after) / (ideal - no-agent after): the share "
      "of\n"
      "the recoverable loss won back, where ideal = (n - 1 + 1/slow) / n x no-agent before\n"
      "(%.3f of the healthy rate), the most shares in proportion to speed can reach.\n"
      "after / ideal: the throughput after the switch against that ideal.\n"
      "Logs: %s\n",
      a.policy.c_str(), same ? policies.front().name.c_str() : "different policies per round",
      !same || policies.front().fallback ? " (fell back to the reactive baseline)" : "",
      ideal_fraction, base.c_str());
  if (a.keep.empty()) std::filesystem::remove_all(base);
  return report.write(json_path) ? 0 : 1;
}
