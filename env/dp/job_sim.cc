#include "env/dp/job_sim.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>

#include "env/dp/draws.h"
#include "env/dp/shares.h"
#include "env/dp/shares_model.h"

namespace parapilot::env::dp {

namespace {

// Fail-slow durations in decision intervals (job_sim.h): the published log-normal shape, one
// decision standing for one published minute.
constexpr double kDurationSigma = 1.5;
constexpr double kComputeMedianDecisions = 3.1;
constexpr double kCommMedianDecisions = 7.5;
constexpr double kSwitchExtraMs = 5;  // the switch pause beyond one step

// Mean fail-slow arrivals per decision interval, by family.
double arrival_rate(Family f) {
  switch (f) {
    case Family::straggler:
      return 1.0 / 12;
    case Family::comm:
      return 1.0 / 10;
    case Family::flap:
      return 1.0 / 20;
    case Family::mixed:
      return 1.0 / 12;
  }
  return 0;
}

FailSlow::Kind draw_kind(Family f, std::mt19937_64& rng) {
  switch (f) {
    case Family::straggler:
      return FailSlow::Kind::compute;
    case Family::comm:
      return FailSlow::Kind::comm;
    case Family::flap:
      return FailSlow::Kind::flap;
    case Family::mixed: {
      // Greyhound: communication in about 40% of fail-slows; most of the rest compute.
      const double u = uniform(rng);
      return u < 0.5   ? FailSlow::Kind::compute
             : u < 0.9 ? FailSlow::Kind::comm
                       : FailSlow::Kind::flap;
    }
  }
  return FailSlow::Kind::compute;
}

DataParallelJob draw_job(const DrawOptions& o, std::mt19937_64& rng) {
  DataParallelJob job;
  job.ranks = o.ranks > 0 ? o.ranks : uniform_int(rng, 4, 64);
  job.global_batch = job.ranks * uniform_int(rng, 4, 32);
  job.per_sample_ms = log_uniform(rng, 0.3, 5);
  job.fixed_ms = uniform(rng, 1, 15);
  const double grad_bytes = log_uniform(rng, 20e6, 1e9);
  const double bus_bytes_per_ms = log_uniform(rng, 10e9, 100e9) / 1e3;
  const double ring = 2.0 * (job.ranks - 1) / job.ranks * grad_bytes / bus_bytes_per_ms;
  job.allreduce_ms = ring * uniform(rng, 0.1, 0.6);
  job.fixed_apart = uniform(rng) < 0.3;
  job.other_collective_ms = job.fixed_apart ? uniform(rng, 0.2, 2) : 0;
  job.noise_sigma = uniform(rng, 0.02, 0.15);
  job.hiccup_probability = uniform(rng, 0.0005, 0.005);
  job.drop_probability = uniform(rng, 0, 0.01);
  job.interference_rate = uniform(rng, 0, 0.15);
  job.misreport_rate = uniform(rng, 0, 0.15);
  job.base_slowdown.assign(job.ranks, 1.0);
  if (o.family == Family::mixed && job.ranks >= 2) {
    // A second GPU type on a random 25-50% of the ranks (at least one, never all).
    const int slower = std::clamp(
        static_cast<int>(std::lround(uniform(rng, 0.25, 0.5) * job.ranks)), 1, job.ranks - 1);
    std::vector<int> order(job.ranks);
    std::iota(order.begin(), order.end(), 0);
    for (int i = job.ranks - 1; i > 0; --i) std::swap(order[i], order[uniform_int(rng, 0, i)]);
    const double factor = uniform(rng, 1.3, 2.5);
    for (int i = 0; i < slower; ++i) job.base_slowdown[order[i]] = factor;
  }
  return job;
}

std::vector<FailSlow> draw_events(const DrawOptions& o, int ranks, std::mt19937_64& rng) {
  std::vector<FailSlow> events;
  const double rate = arrival_rate(o.family);
  const double k = o.decision_steps;
  for (double t = -std::log(1.0 - uniform(rng)) / rate; t < o.horizon;
       t += -std::log(1.0 - uniform(rng)) / rate) {
    FailSlow e;
    e.kind = draw_kind(o.family, rng);
    const bool comm = e.kind == FailSlow::Kind::comm;
    e.rank = comm ? -1 : uniform_int(rng, 0, ranks - 1);
    e.factor = comm ? log_uniform(rng, 2, 10) : log_uniform(rng, 1.3, 4);
    const double median = comm ? kCommMedianDecisions : kComputeMedianDecisions;
    const double decisions = median * std::exp(kDurationSigma * normal(rng));
    uint64_t steps = std::max<uint64_t>(1, std::llround(decisions * k));
    if (e.kind == FailSlow::Kind::flap) {
      e.flap_steps = o.decision_steps * uniform_int(rng, 1, 4);
      steps = std::max<uint64_t>(steps, 4 * static_cast<uint64_t>(e.flap_steps));  // two turns
    }
    e.start_step = static_cast<uint64_t>(t * k);
    e.end_step = e.start_step + steps;
    events.push_back(e);
  }
  return events;
}

// The host's and the telemetry's events (job_sim.h): short interference, misreports.
void draw_host_events(const DrawOptions& o, const DataParallelJob& job, std::mt19937_64& rng,
                      std::vector<FailSlow>& events) {
  const int k = o.decision_steps;
  for (const FailSlow::Kind kind : {FailSlow::Kind::interference, FailSlow::Kind::misreport}) {
    const bool real = kind == FailSlow::Kind::interference;
    const double rate = real ? job.interference_rate : job.misreport_rate;
    if (rate <= 0) continue;
    for (double t = -std::log(1.0 - uniform(rng)) / rate; t < o.horizon;
         t += -std::log(1.0 - uniform(rng)) / rate) {
      FailSlow e;
      e.kind = kind;
      e.rank = uniform_int(rng, 0, job.ranks - 1);
      e.factor = real ? log_uniform(rng, 1.5, 3)
                      : (uniform(rng) < 0.5 ? uniform(rng, 0.4, 0.75) : uniform(rng, 1.35, 2.5));
      const int steps = real ? uniform_int(rng, 2, std::max(2, k))
                             : uniform_int(rng, std::max(1, k / 2), 2 * k);
      e.start_step = static_cast<uint64_t>(t * k);
      e.end_step = e.start_step + static_cast<uint64_t>(steps);
      events.push_back(e);
    }
  }
}

}  // namespace

const char* to_string(FailSlow::Kind kind) {
  switch (kind) {
    case FailSlow::Kind::compute:
      return "compute";
    case FailSlow::Kind::comm:
      return "comm";
    case FailSlow::Kind::flap:
      return "flap";
    case FailSlow::Kind::interference:
      return "interference";
    case FailSlow::Kind::misreport:
      return "misreport";
  }
  return "?";
}

const char* to_string(Family family) {
  switch (family) {
    case Family::straggler:
      return "straggler";
    case Family::comm:
      return "comm";
    case Family::flap:
      return "flap";
    case Family::mixed:
      return "mixed";
  }
  return "?";
}

Episode draw_episode(const DrawOptions& options, uint64_t seed) {
  assert(options.ranks >= 0 && options.decision_steps >= 1 && options.horizon >= 1);
  std::mt19937_64 rng(seed ^ 0x6470'6a6f'6273'696dULL);  // "dpjobsim"
  Episode e;
  e.job = draw_job(options, rng);
  e.events = draw_events(options, e.job.ranks, rng);
  draw_host_events(options, e.job, rng, e.events);
  return e;
}

DataParallelJobSim::DataParallelJobSim(Episode episode, uint64_t seed)
    : episode_(std::move(episode)), rng_(seed) {
  const DataParallelJob& j = episode_.job;
  assert(j.ranks >= 1 && j.global_batch >= j.ranks && j.per_sample_ms > 0 && j.fixed_ms >= 0);
  assert(static_cast<int>(j.base_slowdown.size()) == j.ranks);
  for ([[maybe_unused]] const FailSlow& e : episode_.events) {
    assert(e.kind == FailSlow::Kind::comm || (e.rank >= 0 && e.rank < j.ranks));
  }
  counts_ = even_counts(j.ranks, j.global_batch);
  factor_.resize(j.ranks);
  report_.resize(j.ranks);
  dropped_.resize(j.ranks);
  out_.samples.reserve(j.ranks);
}

void truth_at(const Episode& episode, uint64_t s, std::vector<double>* rank_slowdown,
              double* comm_slowdown) {
  *rank_slowdown = episode.job.base_slowdown;
  *comm_slowdown = 1;
  for (const FailSlow& e : episode.events) {
    if (s < e.start_step || s >= e.end_step) continue;
    switch (e.kind) {
      case FailSlow::Kind::comm:
        *comm_slowdown *= e.factor;
        break;
      case FailSlow::Kind::flap:
        if ((s - e.start_step) / e.flap_steps % 2 == 0) (*rank_slowdown)[e.rank] *= e.factor;
        break;
      case FailSlow::Kind::compute:
      case FailSlow::Kind::interference:
        (*rank_slowdown)[e.rank] *= e.factor;
        break;
      case FailSlow::Kind::misreport:
        break;  // not real: only the telemetry (step())
    }
  }
}

void DataParallelJobSim::truth_at(uint64_t s, std::vector<double>* rank_slowdown,
                                  double* comm_slowdown) const {
  dp::truth_at(episode_, s, rank_slowdown, comm_slowdown);
}

double DataParallelJobSim::switch_pause_ms_at(uint64_t s, const std::vector<int>& from,
                                              const std::vector<int>&) const {
  return true_step_ms_at(s, from);
}

std::unique_ptr<SplitModel> DataParallelJobSim::decider_model(const DataParallelOptions& o) const {
  return std::make_unique<SharesModel>(
      SharesModelOptions{o.ranks, o.global_batch, o.equal_band, o.noise_k, o.late_fraction});
}

void DataParallelJobSim::refresh_truth() {
  if (truth_step_ == step_) return;
  truth_step_ = step_;
  std::vector<double> slowdown;
  truth_at(step_, &slowdown, &comm_);
  if (slowdown == slowdown_) return;
  slowdown_ = std::move(slowdown);
  const DataParallelJob& j = episode_.job;
  true_per_sample_.resize(j.ranks);
  true_fixed_.resize(j.ranks);
  for (int r = 0; r < j.ranks; ++r) {
    true_per_sample_[r] = j.per_sample_ms * slowdown_[r];
    true_fixed_[r] = j.fixed_ms * slowdown_[r];
  }
  best_valid_ = false;
}

const std::vector<int>& DataParallelJobSim::best_counts() {
  refresh_truth();
  if (!best_valid_) {
    best_counts_ = balanced_counts(true_per_sample_, true_fixed_, episode_.job.global_batch,
                                   episode_.job.fixed_apart);
    best_valid_ = true;
  }
  return best_counts_;
}

DataParallelJobSim::Arrivals DataParallelJobSim::arrivals(const std::vector<int>& counts,
                                                          const std::vector<double>& factor) const {
  const DataParallelJob& j = episode_.job;
  Arrivals a;
  for (int r = 0; r < j.ranks; ++r) {
    const double work = j.per_sample_ms * counts[r] * factor[r];
    const double fixed = j.fixed_ms * factor[r];
    a.gradient = std::max(a.gradient, j.fixed_apart ? work : work + fixed);
    a.fixed = std::max(a.fixed, fixed);
  }
  return a;
}

double DataParallelJobSim::wall_of(const std::vector<int>& counts,
                                   const std::vector<double>& factor, double comm) const {
  const DataParallelJob& j = episode_.job;
  const Arrivals a = arrivals(counts, factor);
  const double allreduce = j.allreduce_ms * comm;
  return j.fixed_apart ? a.gradient + allreduce + a.fixed + j.other_collective_ms
                       : a.gradient + allreduce;
}

double DataParallelJobSim::true_step_ms(const std::vector<int>& counts) {
  assert(static_cast<int>(counts.size()) == episode_.job.ranks);
  refresh_truth();
  return wall_of(counts, slowdown_, comm_);
}

std::vector<int> DataParallelJobSim::best_counts_at(uint64_t s) const {
  const DataParallelJob& j = episode_.job;
  std::vector<double> slowdown, per_sample(j.ranks), fixed(j.ranks);
  double comm = 1;
  truth_at(s, &slowdown, &comm);
  for (int r = 0; r < j.ranks; ++r) {
    per_sample[r] = j.per_sample_ms * slowdown[r];
    fixed[r] = j.fixed_ms * slowdown[r];
  }
  return balanced_counts(per_sample, fixed, j.global_batch, j.fixed_apart);
}

double DataParallelJobSim::true_step_ms_at(uint64_t s, const std::vector<int>& counts) const {
  assert(static_cast<int>(counts.size()) == episode_.job.ranks);
  std::vector<double> slowdown;
  double comm = 1;
  truth_at(s, &slowdown, &comm);
  return wall_of(counts, slowdown, comm);
}

double DataParallelJobSim::nominal_step_ms() const {
  const DataParallelJob& j = episode_.job;
  return wall_of(even_counts(j.ranks, j.global_batch), j.base_slowdown, 1.0);
}

double DataParallelJobSim::best_step_ms() { return true_step_ms(best_counts()); }

void DataParallelJobSim::set_counts(const std::vector<int>& counts) {
  assert(static_cast<int>(counts.size()) == episode_.job.ranks);
  assert(std::accumulate(counts.begin(), counts.end(), 0) == episode_.job.global_batch);
  assert(*std::min_element(counts.begin(), counts.end()) >= 1);
  if (counts == counts_) return;
  counts_ = counts;
  switched_ = true;
}

DataParallelJobSim::Step& DataParallelJobSim::step() {
  const DataParallelJob& j = episode_.job;
  best_counts();  // refreshes the truth of this step
  // Every rank draws the same numbers whatever the shares: noise, hiccup, drop.
  out_.samples.clear();
  for (int r = 0; r < j.ranks; ++r) {
    double f = slowdown_[r] * std::exp(j.noise_sigma * normal(rng_));
    if (uniform(rng_) < j.hiccup_probability) f *= uniform(rng_, 2, 5);
    factor_[r] = f;
    dropped_[r] = uniform(rng_) < j.drop_probability;
  }
  const double wall = wall_of(counts_, factor_, comm_);
  out_.best_ms = wall_of(best_counts_, factor_, comm_);
  out_.paused_ms = switched_ ? last_wall_ms_ + kSwitchExtraMs : 0;
  out_.wall_ms = wall + out_.paused_ms;
  out_.step = step_;
  const Arrivals last = arrivals(counts_, factor_);
  std::fill(report_.begin(), report_.end(), 1.0);
  for (const FailSlow& e : episode_.events) {
    if (e.kind == FailSlow::Kind::misreport && step_ >= e.start_step && step_ < e.end_step) {
      report_[e.rank] *= e.factor;
    }
  }
  const uint64_t end_ns = clock_ns_ + static_cast<uint64_t>(std::llround(out_.wall_ms * 1e6));
  for (int r = 0; r < j.ranks; ++r) {
    if (dropped_[r]) continue;
    monitor::StepSample x;
    x.rank = r;
    x.step = step_;
    x.start_ns = clock_ns_;
    x.end_ns = end_ns;
    const double work = j.per_sample_ms * counts_[r] * factor_[r];
    const double fixed = j.fixed_ms * factor_[r];
    x.compute_ms = work * report_[r] + fixed;
    x.samples = counts_[r];
    x.fixed_ms = fixed;
    x.wait_ms = last.gradient - (j.fixed_apart ? work : work + fixed);
    x.other_wait_ms = j.fixed_apart ? last.fixed - fixed : 0;
    x.other_calls = j.fixed_apart ? 1 : 0;
    out_.samples.push_back(std::move(x));
  }
  clock_ns_ = end_ns;
  last_wall_ms_ = wall;
  switched_ = false;
  ++step_;
  return out_;
}

}  // namespace parapilot::env::dp
