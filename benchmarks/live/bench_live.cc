// bench_live: the live cluster's two measurements on this machine (real Gloo workers on
// loopback), printed as figures.
//
//   bench_live elastic     [--workers 2] [--slow 3] [--steps 40] [--rounds 3] [--json FILE]
//     (a) one rank slowed (it sleeps (f-1) x its compute per microbatch): throughput of a
//     healthy cluster, of the slowed cluster on uniform shares, and on elastic shares that the
//     agent sets from the measured per-rank speed after a warm-up; the share of the lost
//     throughput the elastic shares recover.
//   bench_live compression [--workers 2] [--steps 300] [--out DIR] [--json FILE]
//     (b) the same training (seed, data, token budget) without compression and with adaptive
//     per-layer compression chosen from the first steps' gradient statistics: all-reduce bytes
//     and the training loss at the end; loss curves as CSV (and a PNG when gnuplot is present).
//     The bytes are modelled, not counted on the wire: each gradient collective's payload under
//     the ring formulas (2(W-1)/W x payload per all-reduce, (W-1) x payload per all-gather of the
//     top-k layers), summed over the run by rank 0 (env/live/grad_sync.cc).
//
// Both modes: --json FILE also writes every printed figure as JSON (benchmarks/report.h).
// With --live-worker as the first argument it runs one worker (how the cluster starts it).
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/report.h"
#include "env/live/local_cluster.h"
#include "env/live/worker.h"
#include "core/error.h"

using namespace parapilot::live;
using namespace std::chrono_literals;

namespace {

struct Args {
  std::string mode;
  int workers = 2;
  double slow = 3;
  int steps = 0;
  int rounds = 3;
  std::string out;
  std::string corpus = std::string(PARAPILOT_SOURCE_DIR) + "/docs";
};

std::vector<std::string> model_args(const Args& a) {
  return {"--layers",
          "2",
          "--d-model",
          "64",
          "--heads",
          "4",
          "--seq-len",
          "64",
          "--threads",
          "1",
          "--corpus",
          a.corpus,
          "--collective-timeout",
          "60"};
}

LocalClusterOptions make_cluster(const Args& a, std::vector<std::string> extra, bool agent) {
  LocalClusterOptions o;
  o.workers = a.workers;
  o.worker_command = {"/proc/self/exe", "--live-worker"};
  o.worker_args = model_args(a);
  o.worker_args.insert(o.worker_args.end(), extra.begin(), extra.end());
  o.host_agent = agent;
  return o;
}

void require_ok(const std::vector<RankExit>& exits) {
  for (const auto& e : exits)
    if (!e.exited || e.signal || e.code) {
      std::fprintf(stderr, "bench_live: %s\n", e.describe().c_str());
      std::exit(1);
    }
}

/// Runs `steps` steps; optionally applies elastic shares after `warmup` steps. Returns tokens/s
/// over the measured steps (after the switch, or after warm-up when none).
double run_elastic_case(const Args& a, bool slowed, bool elastic, int steps, int warmup,
                        std::vector<double>* shares_out) {
  std::vector<std::string> extra = {"--steps", std::to_string(steps), "--global-batch",
                                    "16",      "--microbatch",        "1"};
  LocalClusterOptions o = make_cluster(a, extra, true);
  if (slowed) {
    FaultSpec f;
    f.rank = a.workers - 1;
    f.kind = FaultSpec::Kind::slow;
    f.factor = a.slow;
    o.faults.push_back(f);
  }
  const std::unique_ptr<LocalCluster> started = parapilot::take(LocalCluster::start(o));
  LocalCluster& c = *started;
  Controller& agent = *c.controller();
  std::int64_t measure_from = warmup;
  if (elastic) {
    if (!agent.wait_for_step(static_cast<std::uint64_t>(warmup - 1), 300s)) {
      std::fprintf(stderr, "bench_live: workers did not reach the warm-up\n");
      std::exit(1);
    }
    LiveAction act;
    act.shares = elastic_shares(agent.take_telemetry(), a.workers);
    for (double& v : act.shares) v = std::round(v * 1e4) / 1e4;
    const auto r = agent.apply(act, 60s);
    if (!r.ok()) {
      std::fprintf(stderr, "bench_live: %s\n", r.status().message().c_str());
      std::exit(1);
    }
    if (shares_out) *shares_out = act.shares;
    measure_from = static_cast<std::int64_t>(r->switch_at_step) + 1;
  }
  require_ok(c.wait(600));
  const double sps = measured_steps_per_s(agent.recorded(), measure_from, steps - 1);
  return sps * 16 * 64;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int elastic(Args a, nlohmann::json& fig) {
  if (a.steps == 0) a.steps = 40;
  const int warmup = 8;
  std::printf(
      "elastic shares, %d Gloo workers on loopback, rank %d slowed %.1fx, %d measured steps "
      "of 16 x 64 bytes (2-layer transformer, d=64), %d rounds of the three cases\n\n",
      a.workers, a.workers - 1, a.slow, a.steps - warmup, a.rounds);
  std::printf("%-6s %10s %10s %10s %10s %10s   %s\n", "round", "healthy", "uniform", "elastic",
              "ideal", "recovered", "elastic shares");
  std::fflush(stdout);
  fig["config"] = {
      {"workers", a.workers}, {"slow_rank", a.workers - 1}, {"slow", a.slow},
      {"steps", a.steps},     {"warmup_steps", warmup},     {"measured_steps", a.steps - warmup},
      {"rounds", a.rounds},   {"global_batch", 16},         {"seq_len", 64}};
  fig["rounds"] = nlohmann::json::array();
  std::vector<double> h, u, e, rec;
  for (int round = 0; round < a.rounds; ++round) {
    // The three cases back to back, so that they see similar background load.
    std::vector<double> shares;
    const double healthy = run_elastic_case(a, false, false, a.steps, warmup, nullptr);
    const double uniform = run_elastic_case(a, true, false, a.steps, warmup, nullptr);
    const double elastic_tps = run_elastic_case(a, true, true, a.steps + warmup, warmup, &shares);
    // The best the slowed cluster can do: its compute capacity, (W - 1 + 1/f) / W of healthy.
    const double ideal = healthy * (a.workers - 1 + 1 / a.slow) / a.workers;
    const double recovered = (elastic_tps - uniform) / (ideal - uniform);
    std::string s;
    for (double v : shares) {
      if (!s.empty()) s.push_back('/');
      s.append(std::to_string(v).substr(0, 6));
    }
    std::printf("%-6d %10.0f %10.0f %10.0f %10.0f %9.1f%%   %s\n", round + 1, healthy, uniform,
                elastic_tps, ideal, 100 * recovered, s.c_str());
    std::fflush(stdout);
    fig["rounds"].push_back({{"round", round + 1},
                             {"healthy_tokens_per_s", healthy},
                             {"uniform_tokens_per_s", uniform},
                             {"elastic_tokens_per_s", elastic_tps},
                             {"ideal_tokens_per_s", ideal},
                             {"recovered_share_of_loss", recovered},
                             {"elastic_over_ideal", elastic_tps / ideal},
                             {"elastic_shares", shares}});
    h.push_back(healthy);
    u.push_back(uniform);
    e.push_back(elastic_tps);
    rec.push_back(recovered);
  }
  const double healthy = median(h), uniform = median(u), elastic_tps = median(e);
  const double ideal = healthy * (a.workers - 1 + 1 / a.slow) / a.workers;
  std::printf("%-6s %10.0f %10.0f %10.0f %10.0f %9.1f%%   (medians; tokens/s)\n", "median", healthy,
              uniform, elastic_tps, ideal, 100 * median(rec));
  std::printf(
      "\nrecovered = (elastic - uniform) / (ideal - uniform): the share of the throughput that "
      "uniform shares lose against the slowed cluster's capacity, which elastic shares win "
      "back. Against the healthy cluster, (elastic - uniform) / (healthy - uniform) = %.1f%% "
      "of at most %.1f%% (the slow rank's lost capacity cannot be won back).\n",
      100 * (elastic_tps - uniform) / (healthy - uniform),
      100 * (ideal - uniform) / (healthy - uniform));
  fig["median"] = {{"healthy_tokens_per_s", healthy},
                   {"uniform_tokens_per_s", uniform},
                   {"elastic_tokens_per_s", elastic_tps},
                   {"ideal_tokens_per_s", ideal},
                   {"recovered_share_of_loss", median(rec)},
                   {"elastic_over_ideal", elastic_tps / ideal},
                   {"recovered_share_of_total_loss", (elastic_tps - uniform) / (healthy - uniform)},
                   {"recoverable_share_of_total_loss", (ideal - uniform) / (healthy - uniform)}};
  return 0;
}

struct LossRun {
  std::vector<double> loss;
  std::uint64_t dp_bytes = 0;
  double seconds = 0;
};

LossRun read_loss_log(const std::string& path) {
  LossRun r;
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string f;
    std::vector<std::string> fields;
    while (std::getline(ss, f, ',')) fields.push_back(f);
    if (fields.size() < 5) continue;
    r.loss.push_back(std::stod(fields[1]));
    r.dp_bytes = std::stoull(fields[3]);
    r.seconds += std::stod(fields[4]);
  }
  return r;
}

LossRun run_compression_case(const Args& a, bool adaptive, const SelectorOptions& selector,
                             const std::string& log, int warmup, std::string* plan,
                             nlohmann::json* plan_json) {
  std::vector<std::string> extra = {"--steps",        std::to_string(a.steps),
                                    "--global-batch", "16",
                                    "--microbatch",   "2",
                                    "--seed",         "11",
                                    "--loss-log",     log};
  const std::unique_ptr<LocalCluster> started =
      parapilot::take(LocalCluster::start(make_cluster(a, extra, true)));
  LocalCluster& c = *started;
  Controller& agent = *c.controller();
  if (adaptive) {
    if (!agent.wait_for_step(static_cast<std::uint64_t>(warmup - 1), 300s)) {
      std::fprintf(stderr, "bench_live: workers did not reach the warm-up\n");
      std::exit(1);
    }
    ModelConfig m;
    m.layers = 2;
    m.d_model = 64;
    m.heads = 4;
    m.seq_len = 64;
    const auto layers = model_layers(m);
    LiveAction act;
    act.compression =
        select_compression(layers, grad_summary(agent.take_telemetry(), layers.size()), selector);
    act.powersgd_rank = selector.powersgd_rank;
    const auto r = agent.apply(act, 60s);
    if (!r.ok()) {
      std::fprintf(stderr, "bench_live: %s\n", r.status().message().c_str());
      std::exit(1);
    }
    if (plan) {
      std::map<std::string, int> count;
      for (Compression x : act.compression) ++count[std::string(compression_name(x))];
      for (const auto& [k, v] : count)
        *plan += (plan->empty() ? "" : ", ") + std::to_string(v) + " " + k;
      *plan += " (switched at step " + std::to_string(r->switch_at_step) + ")";
    }
    if (plan_json) {
      std::vector<std::string> per_layer;
      for (Compression x : act.compression) per_layer.emplace_back(compression_name(x));
      std::map<std::string, int> count;
      for (const auto& x : per_layer) ++count[x];
      *plan_json = {{"layers", count},
                    {"per_layer", per_layer},
                    {"powersgd_rank", act.powersgd_rank},
                    {"switch_at_step", r->switch_at_step}};
      if (plan) (*plan_json)["summary"] = *plan;
    }
  }
  require_ok(c.wait(1200));
  return read_loss_log(log);
}

double tail_mean(const std::vector<double>& v, std::size_t n) {
  n = std::min(n, v.size());
  double s = 0;
  for (std::size_t i = v.size() - n; i < v.size(); ++i) s += v[i];
  return n ? s / static_cast<double>(n) : 0;
}

int compression(Args a, nlohmann::json& fig) {
  if (a.steps == 0) a.steps = 300;
  if (a.out.empty())
    a.out = std::filesystem::temp_directory_path() /
            ("parapilot-bench-live-" + std::to_string(::getpid()));
  std::filesystem::create_directories(a.out);
  const int warmup = 5;
  std::printf(
      "adaptive compression, %d Gloo workers on loopback, %d steps of 16 x 64 bytes of %s "
      "(2-layer transformer, d=64, seed 11)\n\n",
      a.workers, a.steps, a.corpus.c_str());
  std::fflush(stdout);
  const LossRun plain =
      run_compression_case(a, false, {}, a.out + "/loss-none.csv", warmup, nullptr, nullptr);
  std::string plan, plan_aggressive;
  nlohmann::json plan_json, plan_aggressive_json;
  const SelectorOptions adaptive_options;  // the default selector
  const LossRun comp = run_compression_case(a, true, adaptive_options, a.out + "/loss-adaptive.csv",
                                            warmup, &plan, &plan_json);
  SelectorOptions aggressive_options;
  aggressive_options.powersgd_min_saving = 4;  // PowerSGD r=4 on every matrix that saves 4x
  const LossRun aggr =
      run_compression_case(a, true, aggressive_options, a.out + "/loss-powersgd.csv", warmup,
                           &plan_aggressive, &plan_aggressive_json);
  const std::size_t tail = std::max<std::size_t>(1, static_cast<std::size_t>(a.steps) / 10);
  const double l0 = tail_mean(plain.loss, tail), l1 = tail_mean(comp.loss, tail),
               l2 = tail_mean(aggr.loss, tail);
  std::printf("adaptive plan (default selector): %s\n", plan.c_str());
  std::printf("aggressive plan (PowerSGD from 4x savings): %s\n\n", plan_aggressive.c_str());
  std::printf("%-28s %14s %9s %12s %9s %9s\n", "run", "dp bytes/rank", "cut", "final loss",
              "vs none", "seconds");
  fig["config"] = {{"workers", a.workers}, {"steps", a.steps},        {"warmup_steps", warmup},
                   {"global_batch", 16},   {"seq_len", 64},           {"seed", 11},
                   {"corpus", a.corpus},   {"final_loss_steps", tail}};
  fig["runs"] = nlohmann::json::array();
  auto row = [&](const char* id, const char* name, const LossRun& r, double l,
                 const nlohmann::json& p) {
    const double cut = 1 - static_cast<double>(r.dp_bytes) / static_cast<double>(plain.dp_bytes);
    std::printf("%-28s %14llu %8.1f%% %12.4f %+8.2f%% %9.1f\n", name,
                static_cast<unsigned long long>(r.dp_bytes), 100 * cut, l, 100 * (l - l0) / l0,
                r.seconds);
    fig["runs"].push_back({{"run", id},
                           {"label", name},
                           {"plan", p},
                           {"allreduce_bytes_per_rank_modelled", r.dp_bytes},
                           {"bytes_cut_share", cut},
                           {"final_loss", l},
                           {"final_loss_vs_uncompressed", (l - l0) / l0},
                           {"seconds", r.seconds}});
  };
  row("uncompressed", "uncompressed", plain, l0, nullptr);
  row("adaptive", "adaptive (default)", comp, l1, plan_json);
  row("powersgd_aggressive", "PowerSGD r=4 (aggressive)", aggr, l2, plan_aggressive_json);
  std::printf(
      "\ndp bytes/rank (modelled: ring all-reduce bytes): rank 0's gradient-sync bytes over the\n"
      "run, computed from each collective's payload with the ring formulas (2(W-1)/W x payload\n"
      "per all-reduce; (W-1) x payload per all-gather of a top-k layer), not counted on the wire.\n"
      "cut = 1 - bytes / uncompressed bytes; seconds = the sum of rank 0's step times.\n");
  std::printf(
      "final loss = mean training loss of the last %zu steps (same seed, data and token "
      "budget in every run)\n",
      tail);
  // Loss curves.
  const std::string csv = a.out + "/loss-curves.csv";
  {
    std::ofstream out(csv);
    out << "step,uncompressed,adaptive,powersgd\n";
    const std::size_t n = std::min({plain.loss.size(), comp.loss.size(), aggr.loss.size()});
    for (std::size_t i = 0; i < n; ++i)
      out << i << ',' << plain.loss[i] << ',' << comp.loss[i] << ',' << aggr.loss[i] << '\n';
  }
  const std::string png = a.out + "/loss-curves.png";
  const std::string gp = a.out + "/loss-curves.gp";
  {
    std::ofstream out(gp);
    out << "set terminal pngcairo size 900,500 noenhanced\nset output '" << png << "'\n"
        << "set datafile separator ','\nset key top right\nset grid\n"
        << "set xlabel 'step (16 sequences x 64 bytes, 2 ranks)'\n"
        << "set ylabel 'training loss (nats/byte, 10-step moving mean)'\n"
        << "set title 'Live Gloo cluster: uncompressed vs adaptive per-layer compression'\n"
        << "mean(c) = (b9=b8, b8=b7, b7=b6, b6=b5, b5=b4, b4=b3, b3=b2, b2=b1, b1=b0, "
           "b0=column(c), "
           "(b0+b1+b2+b3+b4+b5+b6+b7+b8+b9)/10.0)\n"
        << "init(x) = (b0=b1=b2=b3=b4=b5=b6=b7=b8=b9=x)\n"
        << "plot x=init(3.6) '" << csv
        << "' using 1:(mean(2)) every ::9 with lines lw 6 lc rgb '#f0a0a0' title 'uncompressed', "
        << "x=init(3.6) '" << csv
        << "' using 1:(mean(3)) every ::9 with lines lw 2 title 'adaptive (default selector)', "
        << "x=init(3.6) '" << csv
        << "' using 1:(mean(4)) every ::9 with lines lw 1 dt 2 title 'PowerSGD r=4 everywhere it "
           "fits'\n";
  }
  if (std::system(("gnuplot " + gp + " 2>/dev/null").c_str()) == 0) {
    std::printf("loss curves: %s (data %s)\n", png.c_str(), csv.c_str());
    fig["loss_curves_png"] = png;
  } else {
    std::printf("loss curves: %s (gnuplot not found or failed; script %s)\n", csv.c_str(),
                gp.c_str());
  }
  fig["loss_curves_csv"] = csv;
  return 0;
}

}  // namespace

const char* const kUsage =
    "usage: bench_live elastic|compression [--workers N] [--slow F] [--steps N] "
    "[--rounds N] [--out DIR] [--corpus PATH] [--json FILE]\n";

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--live-worker") == 0) {
    argv[1] = argv[0];
    return worker_main(argc - 1, argv + 1);
  }
  if (parapilot::bench::print_help(argc, argv, kUsage)) return 0;
  // The benchmark's own arguments (a worker's are its own, above).
  const std::string json_path = parapilot::bench::take_json_flag(argc, argv);
  parapilot::bench::Report report("bench_live", argc, argv);
  nlohmann::json& fig = report.figures();
  Args a;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string s = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) {
          std::fprintf(stderr, "bench_live: %s needs a value\n", s.c_str());
          std::exit(2);
        }
        return argv[++i];
      };
      if (s == "--workers")
        a.workers = std::stoi(next());
      else if (s == "--slow")
        a.slow = std::stod(next());
      else if (s == "--steps")
        a.steps = std::stoi(next());
      else if (s == "--rounds")
        a.rounds = std::stoi(next());
      else if (s == "--out")
        a.out = next();
      else if (s == "--corpus")
        a.corpus = next();
      else if (a.mode.empty())
        a.mode = s;
      else {
        std::fprintf(stderr, "bench_live: unknown argument %s\n", s.c_str());
        return 2;
      }
    }
  } catch (const std::exception&) {
    std::fprintf(stderr, "bench_live: a numeric flag has a value that is not a number\n");
    return 2;
  }
  if (a.workers < 1 || a.steps < 0 || a.rounds < 1 || !(a.slow >= 1)) {
    std::fprintf(stderr,
                 "bench_live: needs --workers >= 1, --steps >= 0 (0: the mode's default), "
                 "--rounds >= 1, --slow >= 1\n");
    return 2;
  }
  if (a.mode == "elastic" || a.mode == "compression") {
    fig["mode"] = a.mode;
    const int rc = a.mode == "elastic" ? elastic(a, fig) : compression(a, fig);
    return rc == 0 && !report.write(json_path) ? 1 : rc;
  }
  std::fputs(kUsage, stderr);
  return 2;
}
