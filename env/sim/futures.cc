#include "env/sim/futures.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <map>
#include <utility>

namespace parapilot::env {

namespace {

double uniform01(std::mt19937_64& rng) {
  return std::uniform_real_distribution<double>(0.0, 1.0)(rng);
}

int poisson(double mean, std::mt19937_64& rng) {
  return mean > 0 ? std::poisson_distribution<int>(mean)(rng) : 0;
}

// A standard normal draw conditioned on being at least `lo`: plain rejection where that keeps
// most draws, else Robert's (1995) exponential proposal. Exact either way.
double normal_at_least(double lo, std::mt19937_64& rng) {
  if (lo < 0.5) {
    while (true) {
      const double z = std::normal_distribution<double>(0, 1)(rng);
      if (z >= lo) return z;
    }
  }
  const double rate = 0.5 * (lo + std::sqrt(lo * lo + 4));
  while (true) {
    const double z = lo + std::exponential_distribution<double>(rate)(rng);
    if (uniform01(rng) <= std::exp(-0.5 * (z - rate) * (z - rate))) return z;
  }
}

// The probability that a lognormal(median, sigma) duration exceeds `age_s`.
double lognormal_survival(double median, double sigma, double age_s) {
  if (age_s <= 0) return 1;
  if (sigma <= 0) return median > age_s ? 1 : 0;
  return 0.5 * std::erfc(std::log(age_s / median) / (sigma * std::sqrt(2.0)));
}

// A lognormal(median, sigma) duration drawn given that it exceeds `age_s`.
double lognormal_at_least(double median, double sigma, double age_s, std::mt19937_64& rng) {
  if (sigma <= 0) return std::max(median, age_s);
  if (age_s <= 0) return median * std::exp(sigma * std::normal_distribution<double>(0, 1)(rng));
  const double z = normal_at_least(std::log(age_s / median) / sigma, rng);
  return std::max(median * std::exp(sigma * z), age_s);
}

// The rest of a straggler's slowdown that has lasted age_s: transient or persistent in
// proportion to each kind's chance of having lasted that long.
double slowdown_left_s(const StragglerDynamics& d, double age_s, std::mt19937_64& rng) {
  double transient_alive;
  if (age_s < d.transient_s_min) {
    transient_alive = 1;
  } else if (age_s >= d.transient_s_max) {
    transient_alive = 0;
  } else {
    transient_alive = (d.transient_s_max - age_s) / (d.transient_s_max - d.transient_s_min);
  }
  const double p_transient = d.transient_fraction * transient_alive;
  const double p_persistent =
      age_s >= kMaxPersistentSlowdownS
          ? 0.0
          : (1 - d.transient_fraction) *
                lognormal_survival(d.persistent_median_h * 3600, d.persistent_sigma, age_s);
  if (p_transient + p_persistent <= 0) return 0;  // outlasted every duration the scenario has
  double duration;
  if (uniform01(rng) * (p_transient + p_persistent) < p_transient) {
    const double lo = std::max(age_s, d.transient_s_min);
    duration = lo + uniform01(rng) * (d.transient_s_max - lo);
  } else {
    duration = std::min(
        lognormal_at_least(d.persistent_median_h * 3600, d.persistent_sigma, age_s, rng),
        kMaxPersistentSlowdownS);
  }
  return std::max(0.0, duration - age_s);
}

// The rest of a fail-slow of this kind that has lasted age_s (capped as generate_truth caps it).
// A flapping one believed slow is taken to stay slow for the rest.
double failslow_left_s(const FailSlowKind& k, double age_s, std::mt19937_64& rng) {
  if (age_s >= kMaxPersistentSlowdownS) return 0;
  const double median_s = k.mean_s * std::exp(-0.5 * k.sigma * k.sigma);
  return std::min(lognormal_at_least(median_s, k.sigma, age_s, rng), kMaxPersistentSlowdownS) -
         age_s;
}

double age_of(const std::vector<double>& ages, int i) {
  return ages.empty() ? 0.0 : ages[static_cast<size_t>(i)];
}

bool all_nominal(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return x == 1.0; });
}

}  // namespace

std::vector<Conditions> sample_future(const Scenario& s, const Conditions& beliefs,
                                      const ConditionAges& ages, int intervals,
                                      std::mt19937_64& rng) {
  assert(intervals >= 1);  // precondition
  const ClusterTopology topo(s.cluster);
  const int gpus = topo.num_gpus();
  const int nodes = topo.num_nodes();
  const double I = s.interval_s;
  const double window_s = intervals * I;
  const double window_h = window_s / 3600.0;

  // Slowdowns, as extra time per interval (factor - 1, weighted by the overlap).
  std::vector<std::vector<double>> gpu_extra(gpus);
  auto slow = [&](int g, double start_s, double end_s, double factor_minus_one) {
    if (gpu_extra[g].empty()) gpu_extra[g].assign(intervals, 0.0);
    add_slowdown(gpu_extra[g], I, start_s, end_s, factor_minus_one);
  };
  // A slowdown or congestion believed in a scenario whose dynamics have none is the monitor's
  // noise, not a condition: it is read as nominal.
  const bool stragglers = s.straggler.rate_per_gpu_hour > 0;
  const bool congestion = s.congestion.rate_per_node_hour > 0;
  const FailSlowDynamics& fs = s.failslow;
  const bool compute_failslows = fs.compute.rate > 0;
  const bool comm_failslows = fs.communication.rate > 0;
  for (int g = 0; g < gpus && (stragglers || compute_failslows); ++g) {
    const double b = beliefs.speed(g);
    if (b < 1.0) {
      const double age = age_of(ages.gpu_slow_s, g);
      slow(g, 0,
           stragglers ? slowdown_left_s(s.straggler, age, rng)
                      : failslow_left_s(fs.compute, age, rng),
           1.0 / std::max(b, 1e-3) - 1.0);
    }
  }
  for (int e = poisson(s.straggler.rate_per_gpu_hour * gpus * window_h, rng); e > 0; --e) {
    const int g = static_cast<int>(uniform01(rng) * gpus) % gpus;
    const double start = uniform01(rng) * window_s;
    const SlowdownDraw d = draw_slowdown(s.straggler, rng);
    slow(g, start, start + d.duration_s, d.factor - 1);
  }

  // Congestion, the same way on the nodes' network bandwidth.
  std::vector<std::vector<double>> node_extra(nodes);
  auto congest = [&](int n, double start_s, double end_s, double factor_minus_one) {
    if (node_extra[n].empty()) node_extra[n].assign(intervals, 0.0);
    add_slowdown(node_extra[n], I, start_s, end_s, factor_minus_one);
  };
  for (int n = 0; n < nodes && (congestion || comm_failslows); ++n) {
    const double b = beliefs.inter(n);
    if (b < 1.0) {
      const CongestionDynamics& d = s.congestion;
      const double age = age_of(ages.node_congested_s, n);
      const double left =
          congestion ? lognormal_at_least(d.duration_median_s, d.duration_sigma, age, rng) - age
                     : failslow_left_s(fs.communication, age, rng);
      congest(n, 0, left, 1.0 / std::max(b, 1e-3) - 1.0);
    }
  }
  for (int e = poisson(s.congestion.rate_per_node_hour * nodes * window_h, rng); e > 0; --e) {
    const int n = static_cast<int>(uniform01(rng) * nodes) % nodes;
    const double start = uniform01(rng) * window_s;
    const CongestionDraw d = draw_congestion(s.congestion, rng);
    congest(n, start, start + d.duration_s, d.factor - 1);
  }

  // Failures: believed losses return after the rest of a repair (one draw per node and age:
  // a node lost whole returns whole), new ones start at the scenario's rate.
  std::vector<std::vector<bool>> failed(intervals);
  auto lose = [&](int g, double start_s, double end_s) {
    for (int i = static_cast<int>(start_s / I); i < intervals && i * I < end_s; ++i) {
      if (failed[i].empty()) failed[i].assign(gpus, false);
      failed[i][g] = true;
    }
  };
  std::map<std::pair<int, double>, double> repair_left;  // (node, age) -> seconds left
  for (int g = 0; g < gpus; ++g) {
    if (!beliefs.failed(g)) continue;
    const double age = age_of(ages.gpu_failed_s, g);
    auto [it, fresh] = repair_left.try_emplace({topo.node_of_gpu[g], age}, 0.0);
    if (fresh) {
      it->second =
          lognormal_at_least(s.failure.repair_median_s, s.failure.repair_sigma, age, rng) - age;
    }
    lose(g, 0, it->second);
  }
  for (int e = poisson(s.failure.rate_per_node_hour * nodes * window_h, rng); e > 0; --e) {
    const int n = static_cast<int>(uniform01(rng) * nodes) % nodes;
    const bool whole_node = uniform01(rng) < s.failure.node_fraction;
    const int first_gpu = topo.nodes[n].first_gpu;
    const int count = topo.nodes[n].gpus;
    const int gpu = first_gpu + static_cast<int>(uniform01(rng) * count) % count;
    const double start = uniform01(rng) * window_s;
    const double end = start + draw_repair_s(s.failure, rng);
    if (whole_node) {
      for (int g = first_gpu; g < first_gpu + count; ++g) lose(g, start, end);
    } else {
      lose(gpu, start, end);
    }
  }

  // Fail-slows: new ones of each kind start at its rate, drawn and laid out (flapping ones in
  // phases) as generate_truth does.
  for (const bool communication : {true, false}) {
    const FailSlowKind& kind = communication ? fs.communication : fs.compute;
    const int places = communication ? nodes : gpus;
    for (int e = poisson(kind.rate * places * window_h, rng); e > 0; --e) {
      const int place = static_cast<int>(uniform01(rng) * places) % places;
      const double start = uniform01(rng) * window_s;
      const FailSlowDraw d = draw_failslow(kind, fs.flap_fraction, rng);
      std::vector<double>& extra = communication ? node_extra[place] : gpu_extra[place];
      if (extra.empty()) extra.assign(intervals, 0.0);
      add_failslow(extra, I, start, d, fs, rng);
    }
  }

  std::vector<Conditions> future(intervals);
  for (int i = 0; i < intervals; ++i) {
    Conditions& c = future[i];
    c.node_intra_bw = beliefs.node_intra_bw;
    c.gpu_speed.assign(gpus, 1.0);
    for (int g = 0; g < gpus; ++g) {
      // A slowed GPU's slowdown is extra; a GPU believed faster than nominal stays so.
      const double base = std::max(beliefs.speed(g), 1.0);
      c.gpu_speed[g] = base / (1.0 + (gpu_extra[g].empty() ? 0.0 : gpu_extra[g][i]));
    }
    if (all_nominal(c.gpu_speed)) c.gpu_speed.clear();
    c.node_inter_bw.assign(nodes, 1.0);
    for (int n = 0; n < nodes; ++n) {
      const double base = std::max(beliefs.inter(n), 1.0);
      c.node_inter_bw[n] = base / (1.0 + (node_extra[n].empty() ? 0.0 : node_extra[n][i]));
    }
    if (all_nominal(c.node_inter_bw)) c.node_inter_bw.clear();
    c.gpu_failed = std::move(failed[i]);
  }
  return future;
}

}  // namespace parapilot::env
