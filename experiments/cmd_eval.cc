// parapilot eval: policies and baselines on a scenario, against the hindsight oracle.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>

#include "agent/train/evaluate.h"
#include "policy/loader.h"
#include "policy/registry.h"
#include "env/sim/sim_env.h"
#include "env/trace/telemetry.h"
#include "experiments/cli_common.h"
#include "experiments/commands.h"
#include "core/error.h"

namespace parapilot::cli {

namespace {

struct EvalOptions {
  std::string scenario = "mixed";
  int episodes = 5;
  uint64_t seed = 1000;
  std::string policies = "rl,static,reactive,reactive-tuned,threshold,ski-rental,uniform-dp,oracle";
  bool json = false;
  std::string plot;
  std::string record;  // telemetry CSV of the first policy's first episode
  std::string reference;  // "": the best non-learned baseline among --policies
};

// "straggler" -> "sim:straggler"; ids and .toml paths pass through.
std::string env_id_of(const std::string& scenario) {
  if (scenario.find(':') != std::string::npos || scenario.find(".toml") != std::string::npos) {
    return scenario;
  }
  return "sim:" + scenario;
}

struct PolicyResult {
  std::string name;
  policy::PolicyCapabilities capabilities;
  std::vector<double> throughput, score, migrations;
  std::vector<double> curve;  // mean tokens/s per interval over episodes
  std::map<std::string, int> clipped;  // inputs read at the clip, summed over episodes
  std::map<std::string, int> unseen;   // inputs outside training's range, summed over episodes
  // Per episode, the shortfall against the oracle by kind of interval (agent::gap_by_change);
  // empty when the env does not say when its truth changed.
  std::vector<double> gap_onset, gap_next, gap_later;
};

void write_plot(const std::string& path, const std::vector<PolicyResult>& results,
                const std::vector<std::pair<int, std::string>>& events, double interval_s,
                const std::string& title) {
  const std::string data = path + ".dat";
  {
    std::ofstream out(data);
    const size_t H = results.front().curve.size();
    for (size_t t = 0; t < H; ++t) {
      out << static_cast<double>(t + 1) * interval_s / 3600.0;
      for (const auto& r : results) out << ' ' << r.curve[t];
      out << '\n';
    }
  }
  std::ostringstream script;
  script << "set terminal pngcairo size 1100,560 font ',10'\n";
  script << "set output '" << path << ".tmp'\n";
  script << "set title '" << title << " (mean over episodes; events of the first episode)'\n";
  script << "set xlabel 'hours'\nset ylabel 'tokens/s'\nset key outside right\nset grid\n";
  int n = 0;
  for (const auto& [interval, text] : events) {
    if (++n > 12) break;
    const double x = interval * interval_s / 3600.0;
    script << "set arrow from " << x << ", graph 0 to " << x
           << ", graph 1 nohead dt 3 lc rgb '#999999'\n";
    std::string label = text;
    for (char& c : label) {
      if (c == '\'') c = ' ';
    }
    script << "set label '" << label << "' at " << x << ", graph " << (0.98 - 0.04 * (n % 6))
           << " font ',7' tc rgb '#666666'\n";
  }
  script << "plot ";
  for (size_t i = 0; i < results.size(); ++i) {
    script << (i ? ", " : "") << "'" << data << "' using 1:" << i + 2 << " with lines lw 2 title '"
           << results[i].name << "'";
  }
  script << "\n";
  FILE* gp = ::popen("gnuplot 2>&1", "w");
  if (!gp) throw InputError("--plot: cannot run gnuplot");
  std::fputs(script.str().c_str(), gp);
  const int status = ::pclose(gp);
  std::remove(data.c_str());
  if (status != 0 || std::rename((path + ".tmp").c_str(), path.c_str()) != 0) {
    std::remove((path + ".tmp").c_str());
    throw InputError("--plot: gnuplot could not write " + path);
  }
}

// Whether every episode of r said where it fell short (the env marks when its truth changed).
bool has_gaps(const PolicyResult& r, int episodes) {
  return r.gap_onset.size() == static_cast<size_t>(episodes);
}

// --json: one object keyed by policy; `reference` may be null.
void print_json(const EvalOptions& o, const env::Env& env, const std::vector<PolicyResult>& results,
                const PolicyResult* reference) {
  nlohmann::json j;
  j["scenario"] = env.id();
  j["episodes"] = o.episodes;
  j["seed"] = o.seed;
  for (const auto& r : results) {
    const auto t = agent::mean_interval(r.throughput);
    const auto s = agent::mean_interval(r.score);
    const auto m = agent::mean_interval(r.migrations);
    j["policies"][r.name] = {{"throughput_tokens_per_s", t.mean},
                             {"throughput_ci95", t.half_width},
                             {"score", s.mean},
                             {"score_ci95", s.half_width},
                             {"migrations_per_episode", m.mean}};
    auto total = [](const std::map<std::string, int>& by_input) {
      int n = 0;
      for (const auto& [name, k] : by_input) n += k;
      return n;
    };
    j["policies"][r.name]["inputs_clipped"] = total(r.clipped);
    j["policies"][r.name]["inputs_clipped_by_input"] = r.clipped;
    j["policies"][r.name]["inputs_unseen"] = total(r.unseen);
    j["policies"][r.name]["inputs_unseen_by_input"] = r.unseen;
    if (has_gaps(r, o.episodes)) {
      auto part = [](const std::vector<double>& v) {
        const auto i = agent::mean_interval(v);
        return nlohmann::json{{"share", i.mean}, {"ci95", i.half_width}};
      };
      j["policies"][r.name]["gap_to_oracle"] = {{"onset", part(r.gap_onset)},
                                                {"next", part(r.gap_next)},
                                                {"later", part(r.gap_later)}};
    }
    if (reference && &r != reference) {
      const agent::PairedDifference d = agent::paired_difference(r.score, reference->score);
      j["policies"][r.name]["vs_reference"] = {{"score_difference", d.difference.mean},
                                               {"ci95", d.difference.half_width},
                                               {"verdict", d.verdict()}};
    }
  }
  if (reference) j["reference"] = reference->name;
  std::cout << j.dump(2) << "\n";
}

// The table, the shortfall by kind of interval and the inputs read outside training's range.
void print_table(const EvalOptions& o, const env::Env& env,
                 const std::vector<PolicyResult>& results, const PolicyResult* reference) {
  std::printf("scenario %s: %d episodes from seed %llu, %d intervals of %.0f s\n\n",
              env.id().c_str(), o.episodes, static_cast<unsigned long long>(o.seed),
              env.horizon(), env.interval_s());
  int width = 12;
  for (const auto& r : results) width = std::max(width, static_cast<int>(r.name.size()));
  const std::string vs = reference ? "vs " + reference->name + " (paired)" : "";
  std::printf("%-*s %26s %22s %12s   %s\n", width, "policy", "throughput (tokens/s)",
              "score vs oracle", "migrations", vs.c_str());
  for (const auto& r : results) {
    const auto t = agent::mean_interval(r.throughput);
    const auto s = agent::mean_interval(r.score);
    const auto m = agent::mean_interval(r.migrations);
    std::string paired = reference == &r ? "reference" : "";
    if (reference && reference != &r) {
      const agent::PairedDifference d = agent::paired_difference(r.score, reference->score);
      char buf[96];
      std::snprintf(buf, sizeof buf, "%+.4f ± %.4f %s", d.difference.mean, d.difference.half_width,
                    d.verdict());
      paired = buf;
    }
    std::printf("%-*s %14.0f ± %-9.0f %12.3f ± %-7.3f %12.1f   %s\n", width, r.name.c_str(),
                t.mean, t.half_width, s.mean, s.half_width, m.mean, paired.c_str());
  }
  // Where each policy falls short of the oracle (agent::gap_by_change).
  const bool gaps = std::any_of(results.begin(), results.end(), [&](const PolicyResult& r) {
    return !r.capabilities.hindsight && has_gaps(r, o.episodes);
  });
  if (gaps) {
    std::printf("\nshortfall against the oracle, as a share of its tokens (mean over episodes):\n");
    std::printf("%-*s %24s %20s %10s\n", width, "policy", "where the truth changed",
                "the interval after", "the rest");
    for (const auto& r : results) {
      if (r.capabilities.hindsight || !has_gaps(r, o.episodes)) continue;
      std::printf("%-*s %24.4f %20.4f %10.4f\n", width, r.name.c_str(),
                  agent::mean_interval(r.gap_onset).mean, agent::mean_interval(r.gap_next).mean,
                  agent::mean_interval(r.gap_later).mean);
    }
  }
  auto report = [](const std::string& policy, const std::map<std::string, int>& by_input,
                   const char* what) {
    if (by_input.empty()) return;
    std::string list;
    int total = 0;
    for (const auto& [name, n] : by_input) {
      list += " " + name + "=" + std::to_string(n);
      total += n;
    }
    std::printf("\n%s read %d inputs %s:%s\n", policy.c_str(), total, what, list.c_str());
  };
  for (const auto& r : results) {
    report(r.name, r.clipped, "at the normaliser's clip");
    report(r.name, r.unseen, "outside the range training produced");
  }
  if (!o.plot.empty()) std::printf("\nplot written to %s\n", o.plot.c_str());
}

void run_eval(const EvalOptions& o) {
  if (o.episodes < 1) throw InputError("--episodes must be >= 1");
  const std::string id = env_id_of(o.scenario);
  std::unique_ptr<env::Env> env = take(env::make_env(id));
  const auto names = env::split_ids(o.policies);  // "lookahead(k=8,h=4),static": two
  if (names.empty()) throw InputError("--policies: name at least one policy");
  std::vector<policy::PolicyCapabilities> can(names.size());
  std::vector<std::unique_ptr<parapilot::policy::Policy>> policies(names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    can[i] = take(policy::parse_policy(names[i])).info().capabilities;
    // A hindsight policy (the oracle) is the env's to compute: run_oracle below.
    if (!can[i].hindsight) policies[i] = take(policy::make_policy(names[i], env.get()));
  }
  // The oracle normalises every score, so it always runs.
  std::vector<agent::EpisodeStats> oracle;
  for (int e = 0; e < o.episodes; ++e) {
    oracle.push_back(take(agent::run_oracle(*env, o.seed + static_cast<uint64_t>(e))));
  }
  const bool progress = ::isatty(STDERR_FILENO) != 0;
  // --record: the simulator reports telemetry during the first non-oracle policy's first episode.
  std::vector<trace::TelemetrySample> recorded;
  int recorded_migrations = 0;  // layout changes in the recorded episode
  auto* sim = dynamic_cast<env::SimEnv*>(env.get());
  size_t record_policy = names.size();
  if (!o.record.empty()) {
    if (!sim) throw InputError("--record: env " + env->id() + " does not record telemetry");
    for (size_t i = 0; i < names.size() && record_policy == names.size(); ++i) {
      if (!can[i].hindsight) record_policy = i;
    }
    if (record_policy == names.size()) throw InputError("--record: name a policy besides oracle");
  }
  std::vector<PolicyResult> results;
  for (size_t i = 0; i < names.size(); ++i) {
    PolicyResult r;
    r.name = names[i];
    r.capabilities = can[i];
    for (int e = 0; e < o.episodes; ++e) {
      if (progress)
        std::fprintf(stderr, "\r%-12s episode %d/%d", names[i].c_str(), e + 1, o.episodes);
      const bool recording = i == record_policy && e == 0;
      if (recording) sim->record_telemetry(&recorded);
      const agent::EpisodeStats stats =
          can[i].hindsight
              ? oracle[e]
              : take(agent::run_episode(*env, *policies[i], o.seed + static_cast<uint64_t>(e)));
      if (recording) {
        sim->record_telemetry(nullptr);
        recorded_migrations = stats.migrations + stats.restarts;
      }
      r.throughput.push_back(stats.throughput_tokens_per_s);
      r.score.push_back(stats.throughput_tokens_per_s / oracle[e].throughput_tokens_per_s);
      r.migrations.push_back(stats.migrations);
      if (const auto gap = agent::gap_by_change(stats, oracle[e])) {
        r.gap_onset.push_back(gap->onset);
        r.gap_next.push_back(gap->next);
        r.gap_later.push_back(gap->later);
      }
      for (const auto& [name, n] : stats.clipped_inputs) r.clipped[name] += n;
      for (const auto& [name, n] : stats.unseen_inputs) r.unseen[name] += n;
      if (r.curve.empty()) r.curve.assign(stats.tokens_per_s_by_interval.size(), 0.0);
      for (size_t t = 0; t < r.curve.size(); ++t) {
        r.curve[t] += stats.tokens_per_s_by_interval[t] / o.episodes;
      }
    }
    results.push_back(std::move(r));
  }
  if (progress) std::fprintf(stderr, "\r%40s\r", "");
  take(env->reset(o.seed));
  if (!o.plot.empty()) write_plot(o.plot, results, env->events(), env->interval_s(), env->id());
  if (!o.record.empty()) {
    check(write_file_atomically(
        o.record, [&](std::ostream& out) { trace::write_telemetry(recorded, out); }));
    if (recorded_migrations > 0) {
      std::fprintf(stderr,
                   "warning: --record %s: the recorded episode (%s's first) changed layout %d "
                   "time(s) (switches, and restarts after a failure), and trace analyze and the trace env read one layout: they will "
                   "refuse the file from the first change on (record a policy that keeps its "
                   "layout, on a scenario without failures, for a file they read)\n",
                   o.record.c_str(), names[record_policy].c_str(), recorded_migrations);
    }
  }

  // Every policy against one reference on the same episodes: by default the strongest rule (the
  // best mean score among the non-learned baselines run), the one a learned policy must beat.
  const PolicyResult* reference = nullptr;
  auto mean_score = [](const PolicyResult& r) { return agent::mean_interval(r.score).mean; };
  for (const auto& r : results) {
    if (!o.reference.empty()) {
      if (r.name == o.reference) reference = &r;
    } else if (!r.capabilities.learned && !r.capabilities.hindsight &&
               (!reference || mean_score(r) > mean_score(*reference))) {
      reference = &r;
    }
  }
  if (!o.reference.empty() && !reference)
    throw InputError("--reference " + o.reference + ": not among --policies " + o.policies);
  if (o.json) {
    print_json(o, *env, results, reference);
  } else {
    print_table(o, *env, results, reference);
  }
}

}  // namespace

void add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalOptions>();
  CLI::App* cmd =
      app.add_subcommand("eval", "Evaluate policies and baselines against the hindsight oracle");
  cmd->add_option("--scenario", o->scenario,
                  "Scenario family (hetero, straggler, congestion, failure, phase, mixed, "
                  "failslow), env id (sim:straggler(gpus=64)) or scenario TOML")
      ->capture_default_str();
  cmd->add_option("--episodes", o->episodes, "Episodes per policy")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the first episode")->capture_default_str();
  policy::register_learned_policies();
  cmd->add_option("--policies", o->policies,
                  "Comma-separated policy ids, NAME or NAME(KEY=VALUE,...), from the policy "
                  "registry (lookahead is slower and simulator-only, so not in the default "
                  "list):\n" + policy::describe_policies())
      ->capture_default_str();
  cmd->add_option("--reference", o->reference,
                  "Policy every other is compared with, paired on the same episodes (default: "
                  "the best-scoring non-learned baseline among --policies)");
  cmd->add_flag("--json", o->json, "Print one JSON object keyed by policy");
  cmd->add_option("--plot", o->plot, "Write a PNG of throughput over time per policy (gnuplot)");
  cmd->add_option("--record", o->record,
                  "Write the simulated telemetry of the first policy's first episode as a CSV "
                  "(the format `trace analyze` and the trace env read)");
  cmd->callback([o] { run_eval(*o); });
}

}  // namespace parapilot::cli
