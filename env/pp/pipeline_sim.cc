#include "env/pp/pipeline_sim.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <numeric>

#include "env/dp/draws.h"
#include "env/dp/shares.h"
#include "env/pp/pipeline_model.h"

namespace parapilot::env::pp {

namespace {

constexpr double kSwitchExtraMs = 5;    // the switch pause beyond one step and the transfer
constexpr double kOptimizerStates = 2;  // Adam: two states per parameter

}  // namespace

PipelineShape draw_pipeline(int stages, uint64_t seed) {
  assert(stages >= 1);
  std::mt19937_64 rng(seed ^ 0x7070'6a6f'6273'696dULL);  // "ppjobsim"
  using dp::log_uniform;
  using dp::uniform;
  PipelineShape p;
  const int blocks = stages * dp::uniform_int(rng, 2, 8);
  const double cost = log_uniform(rng, 2, 40);
  const double params = log_uniform(rng, 1e6, 1e8);
  p.block_ms.assign(blocks, cost);
  p.block_params.assign(blocks, static_cast<uint64_t>(params));
  p.block_ms.front() = cost * uniform(rng, 0.2, 1);
  p.block_params.front() = static_cast<uint64_t>(params * uniform(rng, 0.5, 4));
  p.block_ms.back() = cost * uniform(rng, 1, 3);
  p.block_params.back() = static_cast<uint64_t>(params * uniform(rng, 0.5, 4));
  for (uint64_t n : p.block_params) p.block_bytes.push_back(4 * n);
  p.microbatches = std::min(64, dp::uniform_int(rng, stages, 4 * stages));
  p.fixed_ms = uniform(rng, 1, 10);
  p.p2p_ms = uniform(rng, 0.5, 5);
  p.bytes_per_ms = log_uniform(rng, 1e6, 1e7);
  return p;
}

PipelineJobSim::PipelineJobSim(dp::Episode episode, PipelineShape shape, uint64_t seed)
    : episode_(std::move(episode)), shape_(std::move(shape)), rng_(seed) {
  const int stages = episode_.job.ranks;
  assert(stages >= 1 && shape_.block_ms.size() >= static_cast<size_t>(stages) &&
         shape_.block_params.size() == shape_.block_ms.size() &&
         shape_.block_bytes.size() == shape_.block_ms.size() && shape_.microbatches >= 1 &&
         shape_.bytes_per_ms > 0);
  counts_ = dp::even_counts(stages, static_cast<int>(shape_.block_ms.size()));
  factor_.resize(stages);
  report_.resize(stages);
  out_.samples.reserve(stages);
}

void PipelineJobSim::truth_at(uint64_t s, std::vector<double>* rank_slowdown,
                              double* comm_slowdown) const {
  dp::truth_at(episode_, s, rank_slowdown, comm_slowdown);
}

double PipelineJobSim::wall_of(const std::vector<int>& counts, const std::vector<double>& factor,
                               double comm) const {
  std::vector<double> speed(factor.size());
  double fixed = 0;
  for (size_t s = 0; s < factor.size(); ++s) {
    speed[s] = 1 / factor[s];
    fixed = std::max(fixed, shape_.fixed_ms * factor[s]);
  }
  return pipeline_step_ms(shape_.block_ms, speed, counts, shape_.microbatches, fixed) +
         shape_.p2p_ms * comm;
}

std::vector<int> PipelineJobSim::best_counts_at(uint64_t s) const {
  std::vector<double> slowdown;
  double comm = 1;
  truth_at(s, &slowdown, &comm);
  for (double& v : slowdown) v = 1 / v;
  return balanced_split(shape_.block_ms, slowdown);
}

double PipelineJobSim::true_step_ms_at(uint64_t s, const std::vector<int>& counts) const {
  std::vector<double> slowdown;
  double comm = 1;
  truth_at(s, &slowdown, &comm);
  return wall_of(counts, slowdown, comm);
}

double PipelineJobSim::transfer_ms(const std::vector<int>& from, const std::vector<int>& to) const {
  double bytes = 0;
  size_t i = 0;
  int s_from = 0, s_to = 0;
  int left_from = from[0], left_to = to[0];
  for (; i < shape_.block_bytes.size(); ++i) {
    while (left_from == 0) left_from = from[++s_from];
    while (left_to == 0) left_to = to[++s_to];
    if (s_from != s_to) {
      bytes += static_cast<double>(shape_.block_bytes[i]) * (1 + kOptimizerStates);
    }
    --left_from;
    --left_to;
  }
  return bytes / shape_.bytes_per_ms;
}

double PipelineJobSim::switch_pause_ms_at(uint64_t s, const std::vector<int>& from,
                                          const std::vector<int>& to) const {
  return true_step_ms_at(s, from) + transfer_ms(from, to);
}

double PipelineJobSim::nominal_step_ms() const {
  return wall_of(dp::even_counts(ranks(), static_cast<int>(shape_.block_ms.size())),
                 episode_.job.base_slowdown, 1.0);
}

std::unique_ptr<dp::SplitModel> PipelineJobSim::decider_model(
    const dp::DataParallelOptions& o) const {
  PipelineModelOptions m;
  m.stages = ranks();
  m.global_batch = global_batch();
  m.block_params = shape_.block_params;
  m.block_bytes = shape_.block_bytes;
  m.microbatches = shape_.microbatches;
  m.equal_band = o.equal_band;
  m.noise_k = o.noise_k;
  return std::make_unique<PipelineModel>(std::move(m));
}

void PipelineJobSim::set_counts(const std::vector<int>& counts) {
  assert(static_cast<int>(counts.size()) == ranks());
  assert(std::accumulate(counts.begin(), counts.end(), 0) ==
         static_cast<int>(shape_.block_ms.size()));
  assert(*std::min_element(counts.begin(), counts.end()) >= 1);
  if (counts == counts_) return;
  if (!switched_) previous_ = counts_;
  counts_ = counts;
  switched_ = true;
}

PipelineJobSim::Step& PipelineJobSim::step() {
  const dp::DataParallelJob& j = episode_.job;
  const int stages = ranks();
  std::vector<double> slowdown;
  double comm = 1;
  truth_at(step_, &slowdown, &comm);
  // Every stage draws the same numbers whatever the split: noise, hiccup, drop.
  std::vector<char> dropped(stages);
  for (int s = 0; s < stages; ++s) {
    double f = slowdown[s] * std::exp(j.noise_sigma * dp::normal(rng_));
    if (dp::uniform(rng_) < j.hiccup_probability) f *= dp::uniform(rng_, 2, 5);
    factor_[s] = f;
    dropped[s] = dp::uniform(rng_) < j.drop_probability;
  }
  std::fill(report_.begin(), report_.end(), 1.0);
  for (const dp::FailSlow& e : episode_.events) {
    if (e.kind == dp::FailSlow::Kind::misreport && step_ >= e.start_step && step_ < e.end_step) {
      report_[e.rank] *= e.factor;
    }
  }
  if (slowdown != truth_slowdown_) {
    std::vector<double> speed(stages);
    for (int s = 0; s < stages; ++s) speed[s] = 1 / slowdown[s];
    best_ = balanced_split(shape_.block_ms, speed);
    truth_slowdown_ = slowdown;
  }
  const double wall = wall_of(counts_, factor_, comm);
  out_.best_ms = wall_of(best_, factor_, comm);
  out_.paused_ms =
      switched_ ? last_wall_ms_ + transfer_ms(previous_, counts_) + kSwitchExtraMs : 0;
  out_.wall_ms = wall + out_.paused_ms;
  out_.step = step_;
  out_.samples.clear();
  const uint64_t end_ns = clock_ns_ + static_cast<uint64_t>(std::llround(out_.wall_ms * 1e6));
  int first = 0;
  for (int s = 0; s < stages; ++s) {
    const int n = counts_[s];
    if (!dropped[s]) {
      monitor::StepSample x;
      x.rank = s;
      x.step = step_;
      x.start_ns = clock_ns_;
      x.end_ns = end_ns;
      monitor::StageFacts& f = x.stage;
      f.first_block = first;
      f.blocks = n;
      f.microbatches = shape_.microbatches;
      double blocks_ms = 0;
      for (int k = 0; k < n; ++k) {
        f.block_ms.push_back(shape_.block_ms[first + k] * factor_[s] * report_[s]);
        blocks_ms += f.block_ms.back();
      }
      // A misreport cannot claim more compute than the step lasted.
      x.compute_ms = std::min(blocks_ms + shape_.fixed_ms * factor_[s], out_.wall_ms);
      f.p2p_ms = std::max(0.0, out_.wall_ms - x.compute_ms);
      f.p2p_bytes = shape_.p2p_ms * shape_.bytes_per_ms;
      out_.samples.push_back(std::move(x));
    }
    first += n;
  }
  clock_ns_ = end_ns;
  last_wall_ms_ = wall;
  switched_ = false;
  ++step_;
  return out_;
}

}  // namespace parapilot::env::pp
