#include "policy/lookahead.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <random>
#include <unordered_map>
#include <vector>

#include "env/observation.h"
#include "env/sim/futures.h"
#include "env/sim/planning_view.h"
#include "core/error.h"
#include "core/random.h"

namespace parapilot::policy {

namespace {

bool same(const Conditions& a, const Conditions& b) {
  return a.gpu_speed == b.gpu_speed && a.node_inter_bw == b.node_inter_bw &&
         a.node_intra_bw == b.node_intra_bw && a.gpu_failed == b.gpu_failed;
}

// Conditions as an exact key: each vector's size and its entries other than nominal.
std::string key_of(const Conditions& c) {
  std::string key;
  auto put = [&](const auto& v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); };
  for (const std::vector<double>* v : {&c.gpu_speed, &c.node_inter_bw, &c.node_intra_bw}) {
    put(v->size());
    for (size_t i = 0; i < v->size(); ++i) {
      if ((*v)[i] != 1.0) {
        put(i);
        put((*v)[i]);
      }
    }
  }
  put(c.gpu_failed.size());
  for (size_t i = 0; i < c.gpu_failed.size(); ++i) {
    if (c.gpu_failed[i]) put(i);
  }
  return key;
}

// Since when (the decision interval it was first believed) a GPU or node has been in a
// condition. A condition believed over for `forget_after` decisions in a row is forgotten, so
// that beliefs briefly back at nominal (the monitor restarts its levels after a switch) do not
// make an old slowdown look new.
struct ConditionClock {
  int since = -1;  // -1: none
  int clear_for = 0;

  void update(bool in_condition, int t, int forget_after) {
    if (in_condition) {
      if (since < 0) since = t;
      clear_for = 0;
    } else if (since >= 0 && ++clear_for >= forget_after) {
      since = -1;
      clear_for = 0;
    }
  }
  // Seconds the condition has lasted at interval t, counting `lag` intervals before it was first
  // believed (the telemetry delay); 0 when none.
  double age_s(int t, int lag, double interval_s) const {
    return since < 0 ? 0.0 : (t - since + lag) * interval_s;
  }
};

class LookaheadPolicy : public Policy {
 public:
  LookaheadPolicy(const env::Env& env, LookaheadOptions options) : env_(env), options_(options) {}
  std::string name() const override { return "lookahead"; }
  void begin_episode() override { started_ = false; }

  int act(const env::Observation& o) override {
    const env::PlanningView* view = env_.planning_view();
    assert(view);  // make_lookahead checked it; an env keeps its kind
    if (!started_ && options_.family_dynamics) {
      // The episode's scenario (a distribution env draws one per episode) with its family's
      // built-in dynamics in place of its own.
      prior_ = view->scenario();
      const env::Scenario family = env::builtin_scenario(prior_.family, 8);
      prior_.straggler = family.straggler;
      prior_.congestion = family.congestion;
      prior_.failure = family.failure;
    }
    const env::Scenario& s = options_.family_dynamics ? prior_ : view->scenario();
    const int t = view->interval();
    track(*view, t);
    if (feature(o, env::StateFeature::kStaging) > 0.5f) return 0;  // a switch is staged

    // The layouts priced: keeping (0) and every candidate the observation offers (k).
    const std::vector<Candidate>& candidates = view->candidates();
    std::vector<const Strategy*> layouts = {&view->current_layout()};
    std::vector<double> migration_s = {0.0};
    std::vector<int> action = {0};
    for (int k = 0; k < static_cast<int>(candidates.size()) && k < env::kMaxCandidates; ++k) {
      if (!o.mask[k]) continue;
      layouts.push_back(&candidates[k].strategy);
      migration_s.push_back(candidates[k].migration_s);
      action.push_back(k + 1);
    }
    if (layouts.size() == 1) return 0;
    const int L = static_cast<int>(layouts.size());
    int H = options_.intervals;
    if (const std::optional<int> left = view->intervals_left()) H = std::clamp(*left, 1, H);

    env::ConditionAges ages;
    const int gpus = static_cast<int>(slow_.size());
    const int lag = s.telemetry.delay_intervals;
    ages.gpu_slow_s.resize(gpus);
    ages.gpu_failed_s.resize(gpus);
    for (int g = 0; g < gpus; ++g) {
      ages.gpu_slow_s[g] = slow_[g].age_s(t, lag, s.interval_s);
      ages.gpu_failed_s[g] = failed_[g].age_s(t, 0, s.interval_s);  // seen at once
    }
    ages.node_congested_s.resize(congested_.size());
    for (size_t n = 0; n < congested_.size(); ++n) {
      ages.node_congested_s[n] = congested_[n].age_s(t, lag, s.interval_s);
    }

    std::mt19937_64 rng(splitmix64(options_.seed ^ splitmix64(static_cast<uint64_t>(t))));
    std::unordered_map<std::string, std::vector<double>> priced;  // conditions -> tps per layout
    auto price = [&](const Conditions& c) -> const std::vector<double>& {
      auto [it, fresh] = priced.try_emplace(key_of(c));
      if (fresh) {
        it->second.resize(L);
        for (int l = 0; l < L; ++l) it->second[l] = view->tokens_per_s(*layouts[l], c);
      }
      return it->second;
    };
    std::vector<double> expected(L, 0.0);
    std::vector<const std::vector<double>*> tps(H);
    for (int f = 0; f < options_.futures; ++f) {
      const std::vector<Conditions> future = env::sample_future(s, view->beliefs(), ages, H, rng);
      for (int i = 0; i < H; ++i) {
        tps[i] = i > 0 && same(future[i], future[i - 1]) ? tps[i - 1] : &price(future[i]);
      }
      for (int l = 0; l < L; ++l) expected[l] += tokens(s, tps, l, migration_s[l]);
    }
    int best = 0;
    for (int l = 1; l < L; ++l) {
      if (expected[l] > expected[best]) best = l;
    }
    return expected[best] >= options_.min_gain * expected[0] ? action[best] : 0;
  }

 private:
  // Tokens over one future's intervals for keeping (l = 0) or switching to layout l, as the
  // simulator counts them: the new layout is staged for its migration time less the pause at
  // the staging slowdown, then the pause, then it runs; a layout that cannot run crashes and
  // restarts (restart_s lost) on the best of the priced layouts, as an operator restarts on the
  // best plan.
  static double tokens(const env::Scenario& s, const std::vector<const std::vector<double>*>& tps,
                       int l, double migration_s) {
    const double I = s.interval_s;
    bool switching = l != 0, crashed = false;
    double staging_left = std::max(0.0, migration_s - s.switch_pause_s);
    double pause_left = 0;
    int on = 0;
    double total = 0;
    for (const std::vector<double>* row : tps) {
      const double best = *std::max_element(row->begin(), row->end());
      if (crashed) {
        total += best * I;
        continue;
      }
      double rate = (*row)[on];
      if (rate == 0) {
        crashed = true;
        total += best * (I - std::min(I, s.restart_s));
        continue;
      }
      double remaining = env::run_pause(pause_left, I);
      if (switching) {
        const env::StagedInterval staged =
            env::stage_switch(staging_left, remaining, s.switch_pause_s);
        total += rate * (1.0 - s.staging_slowdown) * staged.staged_s;
        remaining = staged.rest_s;
        if (staged.committed) {
          pause_left = staged.pause_left_s;
          on = l;
          switching = false;
          rate = (*row)[on];
        }
      }
      total += rate * remaining;
    }
    return total;
  }

  void track(const env::PlanningView& view, int t) {
    const Conditions& b = view.beliefs();
    const int gpus = view.scenario().cluster.num_gpus();
    const int nodes = view.scenario().cluster.num_nodes();
    if (!started_) {
      slow_.assign(gpus, {});
      failed_.assign(gpus, {});
      congested_.assign(nodes, {});
      started_ = true;
    }
    for (int g = 0; g < gpus; ++g) {
      slow_[g].update(b.speed(g) < 1.0, t, 2);
      failed_[g].update(b.failed(g), t, 1);
    }
    for (int n = 0; n < nodes; ++n) congested_[n].update(b.inter(n) < 1.0, t, 2);
  }

  const env::Env& env_;
  LookaheadOptions options_;
  bool started_ = false;
  std::vector<ConditionClock> slow_, failed_, congested_;
  env::Scenario prior_;  // options_.family_dynamics: this episode's scenario with them
};

}  // namespace

StatusOr<std::unique_ptr<Policy>> make_lookahead(const env::Env& env,
                                                 const LookaheadOptions& options) {
  if (!env.planning_view()) {
    return Status::invalid_argument(
        "lookahead samples futures from the scenario's dynamics, and env " + env.id() +
        " has none (only simulator envs generated from a scenario do; a trace replay or a live "
        "job does not)");
  }
  if (options.futures < 1) {
    return Status::invalid_argument("lookahead: k (futures per decision) must be >= 1");
  }
  if (options.intervals < 1) {
    return Status::invalid_argument("lookahead: h (intervals ahead) must be >= 1");
  }
  return std::unique_ptr<Policy>(std::make_unique<LookaheadPolicy>(env, options));
}

LookaheadOptions lookahead_options(const PolicyArgs& args) {
  assert(args.info().name == "lookahead");  // precondition
  LookaheadOptions o;
  o.futures = static_cast<int>(args.number("k"));
  o.intervals = static_cast<int>(args.number("h"));
  o.min_gain = args.number("min_gain");
  o.seed = static_cast<uint64_t>(args.number("seed"));
  o.family_dynamics = args.text("dynamics") == "family";
  return o;
}

}  // namespace parapilot::policy
