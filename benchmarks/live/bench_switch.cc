// bench_switch: live layout switches on a 4-rank Gloo job against what users do without them
// (docs/results.md, "Live layout switches"). Runs the built parapilot (launch).
//
//   bench_switch [pause|slowed|staging|all] [--steps N] [--keep DIR] [--json FILE]
//
//   pause    For each switch kind: a scripted switch (launch --agent builtin --action
//            20:LAYOUT) and its pause (the largest over the ranks, from --summary-json) and bytes
//            moved, the same switch with --switch-transfer at-boundary (the whole move in the
//            pause), against a stop-checkpoint-relaunch-load cycle of the same job to the same
//            layout (run A saves at step 20 and exits, run B is launched on the target layout
//            with --load-state). Restart downtime = the end of B's first step - the end of A's
//            last step - B's normal step time (the median of its later steps): the wall time the
//            restart added, through A's save, its exit, the relaunch, the rendezvous and B's
//            load. Also the switch step's own excess over the job's median step.
//   slowed   dp=2,pp=2 with stage 1 (ranks 1 and 3) slowed 3x from --slow-at seconds:
//            throughput before the slowdown, during it before the first switch, after it, for
//            launch --agent deploy --agent-switches hybrid (the shipped policy, and reactive),
//            against --agent none and against the best of some static layouts run slowed
//            from the start.
//   staging  dp=2,pp=2 -> dp=1,pp=4 at step 20, staging stretched by --stage-delay-ms: step
//            times between PlanPrepare and PlanReady (staging), between PlanReady and the
//            commit (the staged copy held), against the steps before.
//
// Figures are printed and, with --json FILE, written as JSON (benchmarks/report.h): "pause",
// "slowed", "staging", each the mode's figures.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "benchmarks/report.h"

namespace {

constexpr int kWorkers = 4;
constexpr int kGlobalBatch = 16;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct Args {
  std::string mode = "all";
  int steps = 30;         // pause and staging: steps of the switch runs
  int slowed_steps = 80;  // slowed: steps of each run
  double slow_at = 8;     // slowed: seconds after the workers start
  double stage_delay_ms = 1500;
  std::string keep;
};

// The job every mode runs: the default model with 4 blocks (d = 64, 4 heads, 64 bytes a
// sequence), 16 sequences a step in microbatches of 2, one thread a rank.
const char* kJob =
    " --workers 4 --layers 4 --d-model 64 --heads 4 --seq-len 64 --global-batch 16"
    " --microbatch 2 --threads 1 --collective-timeout 120 --rendezvous-timeout 120"
    " --corpus " PARAPILOT_SOURCE_DIR "/docs";

double unix_now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

nlohmann::json num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); }

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kNaN;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return kNaN;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Runs `parapilot launch` + flags, its output in dir/launch.log; exits on failure.
void launch(const std::string& dir, const std::string& flags) {
  std::filesystem::create_directories(dir);
  const std::string cmd = std::string(PARAPILOT_BIN) + " launch" + kJob + " --log-dir " + dir +
                          " " + flags + " > " + dir + "/launch.log 2>&1";
  const int status = std::system(cmd.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "bench_switch: launch failed (logs in %s): %s\n", dir.c_str(),
                 cmd.c_str());
    std::exit(1);
  }
}

nlohmann::json summary(const std::string& path) {
  const nlohmann::json j = nlohmann::json::parse(read_text(path), nullptr, false);
  if (!j.is_object()) {
    std::fprintf(stderr, "bench_switch: no run summary in %s\n", path.c_str());
    std::exit(1);
  }
  return j;
}

std::vector<double> step_ms(const nlohmann::json& s) {
  return s["step_ms"].get<std::vector<double>>();
}

// Samples/s of the steps with index (within the run) in [first, last), from their wall times.
double throughput(const nlohmann::json& s, long first, long last) {
  const std::vector<double> ms = step_ms(s);
  last = std::min<long>(last, static_cast<long>(ms.size()));
  if (first < 0 || first >= last) return kNaN;
  double total = 0;
  for (long i = first; i < last; ++i) total += ms[static_cast<std::size_t>(i)];
  return static_cast<double>(last - first) * kGlobalBatch / (total / 1000);
}

// The index of the first step that ended at or after `t` seconds since its worker started.
long step_ending_after(const nlohmann::json& s, double t) {
  const std::vector<double> end = s["step_end_s"].get<std::vector<double>>();
  for (std::size_t i = 0; i < end.size(); ++i)
    if (end[i] >= t) return static_cast<long>(i);
  return static_cast<long>(end.size());
}

// ---- (b) pause against restart ---------------------------------------------------------------

struct Kind {
  const char* name;
  const char* from;
  const char* to;
};
const Kind kKinds[] = {
    {"pp deeper", "dp=2,pp=2", "dp=1,pp=4"},
    {"tp -> dp", "tp=2,dp=2", "dp=4"},
    {"dp -> pp", "dp=4", "dp=2,pp=2"},
    {"stage move", "dp=2,pp=2,stages=[1,3]", "dp=2,pp=2,stages=[2,2]"},
    {"dp -> tp", "dp=4", "dp=2,tp=2"},
    {"tp=4 -> dp", "dp=1,tp=4", "dp=4"},
};

nlohmann::json pause_mode(const Args& a, const std::string& base) {
  const int switch_step = 20;
  std::printf(
      "pause: a scripted switch at step %d (launch --agent builtin --action %d:LAYOUT, "
      "%d steps)\nagainst stop at step %d, save, relaunch on the target layout, load "
      "(%d ranks, 4-block transformer d=64)\n\n",
      switch_step, switch_step, a.steps, switch_step, kWorkers);
  std::printf("%-11s %-24s %-24s | %8s %8s %10s %8s | %8s %10s | %9s %9s %8s\n", "kind", "from",
              "to", "pause", "excess", "moved", "staged", "boundary", "moved", "restart", "step",
              "pause /");
  std::printf("%-11s %-24s %-24s | %8s %8s %10s %8s | %8s %10s | %9s %9s %8s\n", "", "", "", "ms",
              "ms", "bytes", "ms", "pause ms", "bytes", "downtime", "ms", "restart");
  nlohmann::json out = nlohmann::json::array();
  for (const Kind& k : kKinds) {
    const std::string dir = base + "/pause/" + std::to_string(&k - kKinds);
    // The live switch.
    launch(dir + "/switch", std::string("--agent builtin --layout ") + k.from + " --action " +
                                std::to_string(switch_step) + ":" + k.to + " --steps " +
                                std::to_string(a.steps) + " --summary-json " + dir +
                                "/switch.json");
    const nlohmann::json sw = summary(dir + "/switch.json");
    if (sw["switches"].size() != 1) {
      std::fprintf(stderr, "bench_switch: %s -> %s: %zu switches (logs in %s)\n", k.from, k.to,
                   sw["switches"].size(), dir.c_str());
      std::exit(1);
    }
    const nlohmann::json& rec = sw["switches"][0];
    // The same switch with the whole move in the pause (--switch-transfer at-boundary).
    launch(dir + "/boundary", std::string("--agent builtin --layout ") + k.from + " --action " +
                                  std::to_string(switch_step) + ":" + k.to + " --steps " +
                                  std::to_string(a.steps) +
                                  " --switch-transfer at-boundary --summary-json " + dir +
                                  "/boundary.json");
    const nlohmann::json bw = summary(dir + "/boundary.json");
    if (bw["switches"].size() != 1) {
      std::fprintf(stderr, "bench_switch: %s -> %s at the boundary: %zu switches (logs in %s)\n",
                   k.from, k.to, bw["switches"].size(), dir.c_str());
      std::exit(1);
    }
    const nlohmann::json& brec = bw["switches"][0];
    const std::vector<double> ms = step_ms(sw);
    const auto at =
        static_cast<std::size_t>(rec["at_step"].get<long>() - sw["first_step"].get<long>());
    // The median step of the target layout, after the switch step.
    const double after_median = median(
        std::vector<double>(ms.begin() + static_cast<long>(std::min(at + 1, ms.size())), ms.end()));
    const double excess = at < ms.size() ? ms[at] - after_median : kNaN;
    // Stop, save, relaunch, load.
    launch(dir + "/first", std::string("--agent none --layout ") + k.from + " --steps " +
                               std::to_string(switch_step) + " --save-state " + dir +
                               "/state --summary-json " + dir + "/first.json");
    const double first_exited_unix_s = unix_now_s();  // its launch (and so every worker) ended
    launch(dir + "/second", std::string("--agent none --layout ") + k.to + " --steps " +
                                std::to_string(switch_step + 10) + " --load-state " + dir +
                                "/state --summary-json " + dir + "/second.json");
    const nlohmann::json first = summary(dir + "/first.json"),
                         second = summary(dir + "/second.json");
    const std::vector<double> second_ms = step_ms(second);
    const double normal = median(std::vector<double>(second_ms.begin() + 1, second_ms.end()));
    const double downtime_ms = (second["first_step_end_unix_s"].get<double>() -
                                first["last_step_end_unix_s"].get<double>()) *
                                   1000 -
                               normal;
    const double pause = rec["pause_ms"].get<double>();
    std::printf(
        "%-11s %-24s %-24s | %8.1f %8.1f %10.0f %8.0f | %8.1f %10.0f | %9.0f %9.1f %7.2f%%\n",
        k.name, k.from, k.to, pause, excess, rec["bytes_moved"].get<double>(),
        rec["staged_ms"].get<double>(), brec["pause_ms"].get<double>(),
        brec["bytes_moved"].get<double>(), downtime_ms, normal, 100 * pause / downtime_ms);
    std::fflush(stdout);
    out.push_back(
        {{"kind", k.name},
         {"from", k.from},
         {"to", sw["layout"]},
         {"at_step", rec["at_step"]},
         {"pause_ms", pause},
         {"switch_step_excess_ms", num(excess)},
         {"bytes_moved", rec["bytes_moved"]},
         {"staged_ms", rec["staged_ms"]},
         {"step_ms_after_switch", num(after_median)},
         {"boundary_pause_ms", brec["pause_ms"]},
         {"boundary_bytes_moved", brec["bytes_moved"]},
         {"restart_downtime_ms", downtime_ms},
         {"restart_step_ms", num(normal)},
         {"restart_gap_ms", (second["first_step_end_unix_s"].get<double>() -
                             first["last_step_end_unix_s"].get<double>()) *
                                1000},
         // Where the downtime goes: from the first job's last step to the relaunched
         // workers' start (save, exit, relaunch), and from there to the end of their
         // first step less a normal step (library load, rendezvous, checkpoint load).
         {"restart_stop_to_exit_ms",
          (first_exited_unix_s - first["last_step_end_unix_s"].get<double>()) * 1000},
         {"restart_exit_to_start_ms",
          (second["started_unix_s"].get<double>() - first_exited_unix_s) * 1000},
         {"restart_start_to_first_step_ms",
          (second["first_step_end_unix_s"].get<double>() - second["started_unix_s"].get<double>()) *
                  1000 -
              normal},
         {"pause_over_restart", pause / downtime_ms},
         {"excess_over_restart", num(excess / downtime_ms)}});
  }
  std::printf(
      "\npause: the switch's wall time on the switching step (waiting for the last streamed "
      "step, installing the state, the swap),\nthe largest over the ranks; boundary: the same "
      "switch with --switch-transfer at-boundary (the whole move in the pause);\nexcess: the "
      "switching step's wall "
      "time on rank 0 minus the median step after it;\nmoved: bytes sent between ranks, summed "
      "over them; restart downtime: end of the relaunched job's first step\n- end of the first "
      "job's last step - the relaunched job's median step.\n\n");
  return out;
}

// ---- (a) a slowed stage ----------------------------------------------------------------------

std::string slow_flags(double at_s) {
  char buf[160];
  std::snprintf(buf, sizeof buf, " --inject rank=1,slow=3x,at=%gs --inject rank=3,slow=3x,at=%gs",
                at_s, at_s);
  return buf;
}

// The deploy agent's log lines worth quoting: its migrations and its summary.
std::vector<std::string> agent_lines(const std::string& launch_log) {
  std::vector<std::string> out;
  std::istringstream in(read_text(launch_log));
  bool in_summary = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("agent:", 0) == 0) in_summary = true;
    if (in_summary && (line.rfind("agent:", 0) == 0 || line.rfind("  ", 0) == 0))
      out.push_back(line);
    else if (in_summary)
      in_summary = false;
  }
  return out;
}

nlohmann::json slowed_mode(const Args& a, const std::string& base) {
  std::printf(
      "slowed: dp=2,pp=2, stage 1 (ranks 1 and 3) slowed 3x from %.0f s after the "
      "workers start, %d steps\n\n",
      a.slow_at, a.slowed_steps);
  nlohmann::json out;
  const std::string steps = " --steps " + std::to_string(a.slowed_steps);
  // Windows: before = steps 2 .. the slowdown's onset; during = onset + 1 .. the first switch
  // the agent committed after the onset (layout or shares: deploy's log); after = from two
  // steps after that switch to the end. Switches before the onset are listed apart.
  auto windows = [&](const nlohmann::json& s, const std::string& agent_log) {
    const long n = static_cast<long>(s["step_ms"].size());
    const long first = s["first_step"].get<long>();
    const long onset = step_ending_after(s, a.slow_at);
    long sw = n;
    std::string switched_to;
    nlohmann::json early = nlohmann::json::array();
    std::istringstream log(agent_log.empty() ? std::string() : read_text(agent_log));
    for (std::string line; std::getline(log, line);) {
      const nlohmann::json e = nlohmann::json::parse(line, nullptr, false);
      if (!e.is_object() || e.value("event", "") != "migration" ||
          e.value("outcome", "") != "committed")
        continue;
      const long at = e.value("switch_at_step", 0L) - first;
      const std::string what = e.value("layout", "");
      if (at <= onset)
        early.push_back({{"step", at}, {"to", what}});
      else if (at < sw) {
        sw = at;
        switched_to = what;
      }
    }
    const double before = throughput(s, 2, onset);
    const double during = throughput(s, onset + 1, sw);
    const double after = sw < n ? throughput(s, std::min(sw + 2, n), n) : kNaN;
    return nlohmann::json{{"onset_step", onset},
                          {"switch_step", sw < n ? nlohmann::json(sw) : nlohmann::json()},
                          {"switched_to", switched_to},
                          {"switches_before_onset", early},
                          {"final_layout", s["layout"]},
                          {"layout_switches", s["switches"].size()},
                          {"before", num(before)},
                          {"during", num(during)},
                          {"after", num(after)}};
  };
  std::printf("%-26s | %9s %9s %9s | %s\n", "run", "before", "during", "after", "switch");
  auto row = [&](const std::string& name, const nlohmann::json& w) {
    auto f = [](const nlohmann::json& x) { return x.is_number() ? x.get<double>() : kNaN; };
    std::string early;
    for (const auto& e : w["switches_before_onset"])
      early += " (before it: step " + std::to_string(e["step"].get<long>()) + " to " +
               e["to"].get<std::string>() + ")";
    std::printf("%-26s | %9.1f %9.1f %9.1f | %s%s; slowdown from step %ld\n", name.c_str(),
                f(w["before"]), f(w["during"]), f(w["after"]),
                w["switch_step"].is_null()
                    ? "none after the slowdown"
                    : ("step " + std::to_string(w["switch_step"].get<long>()) + " to " +
                       w["switched_to"].get<std::string>())
                          .c_str(),
                early.c_str(), w["onset_step"].get<long>());
    std::fflush(stdout);
  };
  for (const char* policy : {"default", "reactive"}) {
    const std::string dir = base + "/slowed/deploy-" + policy;
    launch(dir, std::string("--agent deploy --agent-switches hybrid --layout dp=2,pp=2") +
                    (std::string(policy) == "default" ? "" : " --agent-policy reactive") +
                    slow_flags(a.slow_at) + steps + " --summary-json " + dir + "/summary.json");
    nlohmann::json w = windows(summary(dir + "/summary.json"), dir + "/agent.log");
    w["agent"] = agent_lines(dir + "/launch.log");
    row(std::string("deploy (") + (std::string(policy) == "default" ? "shipped policy" : policy) +
            ")",
        w);
    for (const auto& l : w["agent"]) std::printf("    %s\n", l.get<std::string>().c_str());
    out[std::string("deploy_") + policy] = w;
  }
  {
    const std::string dir = base + "/slowed/none";
    launch(dir, "--agent none --layout dp=2,pp=2" + slow_flags(a.slow_at) + steps +
                    " --summary-json " + dir + "/summary.json");
    const nlohmann::json w = windows(summary(dir + "/summary.json"), "");
    row("no agent", w);
    out["none"] = w;
  }
  // Static layouts slowed from the start: throughput over steps 2 .. end.
  // Layouts, and last data parallel with shares in proportion to speed (3:1) fixed from the
  // start.
  struct Static {
    const char* layout;
    const char* shares;
  };
  const Static statics[] = {{"dp=2,pp=2", ""}, {"dp=2,pp=2,stages=[3,1]", ""},
                            {"dp=4", ""},      {"dp=1,pp=4", ""},
                            {"tp=2,dp=2", ""}, {"dp=4", "0.375,0.125,0.375,0.125"}};
  const std::string static_steps = " --steps " + std::to_string(std::max(16, a.slowed_steps / 5));
  out["static"] = nlohmann::json::array();
  double best = 0;
  std::string best_layout;
  for (std::size_t k = 0; k < std::size(statics); ++k) {
    const Static& st = statics[k];
    const std::string dir = base + "/slowed/static-" + std::to_string(k);
    const std::string shares = st.shares;
    launch(dir, std::string("--agent none --layout ") + st.layout +
                    (shares.empty() ? "" : " --shares " + shares) + slow_flags(0) + static_steps +
                    " --summary-json " + dir + "/summary.json");
    const nlohmann::json s = summary(dir + "/summary.json");
    const double t = throughput(s, 2, static_cast<long>(s["step_ms"].size()));
    const std::string name =
        s["layout"].get<std::string>() + (shares.empty() ? "" : ", shares " + shares);
    std::printf("static %-19s | %9s %9.1f %9s |\n", name.c_str(), "", t, "");
    std::fflush(stdout);
    out["static"].push_back({{"layout", name}, {"slowed", num(t)}});
    if (t > best) {
      best = t;
      best_layout = name;
    }
  }
  out["best_static"] = {{"layout", best_layout}, {"slowed", best}};
  std::printf("best static layout slowed: %s, %.1f samples/s\n\n", best_layout.c_str(), best);
  return out;
}

// ---- (c) the price of staging ----------------------------------------------------------------

nlohmann::json staging_mode(const Args& a, const std::string& base) {
  const int switch_step = 20;
  std::printf("staging: dp=2,pp=2 -> dp=1,pp=4 scripted at step %d; rank 0's step times (ms)\n\n",
              switch_step);
  std::printf("%-14s | %8s | %6s %9s %9s | %6s %9s | %s\n", "stage delay", "before", "steps",
              "staging", "max", "steps", "held", "prepared / ready / switch at step");
  nlohmann::json out = nlohmann::json::array();
  for (double delay : {0.0, a.stage_delay_ms}) {
    const std::string dir = base + "/staging/" + std::to_string(static_cast<int>(delay));
    char d[32];
    std::snprintf(d, sizeof d, "%g", delay);
    launch(dir, std::string("--agent builtin --layout dp=2,pp=2 --action ") +
                    std::to_string(switch_step) + ":dp=1,pp=4 --steps " + std::to_string(a.steps) +
                    " --stage-delay-ms " + d + " --summary-json " + dir + "/summary.json");
    const nlohmann::json s = summary(dir + "/summary.json");
    if (s["switches"].size() != 1) {
      std::fprintf(stderr, "bench_switch: staging run did not switch (logs in %s)\n", dir.c_str());
      std::exit(1);
    }
    const nlohmann::json& w = s["switches"][0];
    const long first = s["first_step"].get<long>();
    const long prepared = w["prepared_at_step"].get<long>() - first;
    const long ready = w["ready_at_step"].get<long>() - first;
    const long at = w["at_step"].get<long>() - first;
    const std::vector<double> ms = step_ms(s);
    auto slice = [&](long b, long e) {
      b = std::max<long>(b, 0);
      e = std::min<long>(e, static_cast<long>(ms.size()));
      return b < e ? std::vector<double>(ms.begin() + b, ms.begin() + e) : std::vector<double>();
    };
    // Before: the 10 steps before staging began (skipping the first two).
    const std::vector<double> before = slice(std::max<long>(2, prepared - 10), prepared);
    // Staging: from the step during which PlanPrepare arrived to the one during which staging
    // ended; held: after it, up to the switch step (not included: its pause is not staging's).
    const std::vector<double> staging = slice(prepared, ready + 1);
    const std::vector<double> held = slice(ready + 1, at);
    const double max_staging =
        staging.empty() ? kNaN : *std::max_element(staging.begin(), staging.end());
    std::printf("%11.0f ms | %8.1f | %6zu %9.1f %9.1f | %6zu %9.1f | %ld / %ld / %ld\n", delay,
                mean(before), staging.size(), mean(staging), max_staging, held.size(), mean(held),
                prepared + first, ready + first, at + first);
    std::fflush(stdout);
    out.push_back({{"stage_delay_ms", delay},
                   {"prepared_at_step", w["prepared_at_step"]},
                   {"ready_at_step", w["ready_at_step"]},
                   {"at_step", w["at_step"]},
                   {"staged_ms", w["staged_ms"]},
                   {"step_ms_before", num(mean(before))},
                   {"step_ms_staging", num(mean(staging))},
                   {"step_ms_staging_max", num(max_staging)},
                   {"step_ms_held", num(mean(held))},
                   {"staging_steps", staging.size()},
                   {"held_steps", held.size()},
                   {"staging_over_before", num(mean(staging) / mean(before))},
                   {"step_ms", ms}});
  }
  std::printf(
      "\nbefore: mean of the 10 steps before PlanPrepare; staging: mean (and max) of the "
      "steps from the one PlanPrepare\narrived in to the one staging ended in; held: "
      "the steps after, before the switch step.\n\n");
  return out;
}

}  // namespace

const char* const kUsage =
    "usage: bench_switch [pause|slowed|staging|all] [--steps N] [--slowed-steps N] "
    "[--slow-at S] [--stage-delay-ms MS] [--keep DIR] [--json FILE]\n";

int main(int argc, char** argv) {
  if (parapilot::bench::print_help(argc, argv, kUsage)) return 0;
  const std::string json_path = parapilot::bench::take_json_flag(argc, argv);
  parapilot::bench::Report report("bench_switch", argc, argv);
  nlohmann::json& fig = report.figures();
  Args a;
  int i = 1;
  if (i < argc && argv[i][0] != '-') a.mode = argv[i++];
  for (; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_switch: %s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (s == "--steps")
        a.steps = std::stoi(next());
      else if (s == "--slowed-steps")
        a.slowed_steps = std::stoi(next());
      else if (s == "--slow-at")
        a.slow_at = std::stod(next());
      else if (s == "--stage-delay-ms")
        a.stage_delay_ms = std::stod(next());
      else if (s == "--keep")
        a.keep = next();
      else
        throw std::invalid_argument(s);
    } catch (const std::exception&) {
      std::fputs(kUsage, stderr);
      return 2;
    }
  }
  if (a.mode != "pause" && a.mode != "slowed" && a.mode != "staging" && a.mode != "all") {
    std::fprintf(stderr, "bench_switch: mode '%s' is not pause, slowed, staging or all\n",
                 a.mode.c_str());
    return 2;
  }
  if (a.steps < 30 || a.slowed_steps < 40 || a.slow_at < 0 || a.stage_delay_ms < 0) {
    std::fprintf(stderr,
                 "bench_switch: needs --steps >= 30, --slowed-steps >= 40, --slow-at >= 0, "
                 "--stage-delay-ms >= 0\n");
    return 2;
  }
  const std::string base = a.keep.empty()
                               ? (std::filesystem::temp_directory_path() /
                                  ("parapilot-bench-switch-" + std::to_string(::getpid())))
                                     .string()
                               : a.keep;
  fig["config"] = {{"workers", kWorkers},     {"global_batch", kGlobalBatch},
                   {"steps", a.steps},        {"slowed_steps", a.slowed_steps},
                   {"slow_at_s", a.slow_at},  {"stage_delay_ms", a.stage_delay_ms},
                   {"job", std::string(kJob)}};
  if (a.mode == "pause" || a.mode == "all") fig["pause"] = pause_mode(a, base);
  if (a.mode == "slowed" || a.mode == "all") fig["slowed"] = slowed_mode(a, base);
  if (a.mode == "staging" || a.mode == "all") fig["staging"] = staging_mode(a, base);
  std::printf("logs: %s\n", a.keep.empty() ? "(removed; --keep DIR keeps them)" : base.c_str());
  if (a.keep.empty()) std::filesystem::remove_all(base);
  return report.write(json_path) ? 0 : 1;
}
