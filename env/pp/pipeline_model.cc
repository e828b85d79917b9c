#include "env/pp/pipeline_model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <map>
#include <numeric>

#include "env/dp/shares.h"
#include "env/monitor/robust_stats.h"

namespace parapilot::env::pp {

namespace {

// Alternations of the speed/cost separation: exact measurements settle after two; noisy ones
// move little after a few.
constexpr int kSeparationRounds = 8;

// Which block boundaries a stage can start at when no stage's cost over its speed exceeds
// `limit` and every stage holds a block: starts[s][j] for stage s starting at block j (the
// stages before it cover [0, j); not kept when `starts` is null). True when the last stage can
// end at the last block. `prefix`: the blocks' prefix sums. O(stages x blocks): for a boundary
// j' the starts that fit are j >= lo(j'), and lo only grows with j'.
bool reachable(const std::vector<double>& prefix, const std::vector<double>& speed, double limit,
               std::vector<std::vector<char>>* starts) {
  const size_t stages = speed.size(), blocks = prefix.size() - 1;
  std::vector<char> cur(blocks + 1, 0), next(blocks + 1, 0);
  cur[0] = 1;
  for (size_t s = 0; s < stages; ++s) {
    if (starts) (*starts)[s] = cur;
    std::fill(next.begin(), next.end(), 0);
    const double room = limit * speed[s];
    size_t lo = 0;
    long latest = -1;  // the last reachable start before the boundary
    for (size_t end = 1; end <= blocks; ++end) {
      if (cur[end - 1]) latest = static_cast<long>(end - 1);
      while (prefix[end] - prefix[lo] > room) ++lo;
      next[end] = latest >= 0 && static_cast<size_t>(latest) >= lo ? 1 : 0;
    }
    std::swap(cur, next);
  }
  return cur[blocks] != 0;
}

}  // namespace

double pipeline_step_ms(const std::vector<double>& block_cost,
                        const std::vector<double>& stage_speed, const std::vector<int>& split,
                        int microbatches, double fixed_ms) {
  assert(microbatches >= 1 && split.size() == stage_speed.size());
  double slowest = 0;
  size_t i = 0;
  for (size_t s = 0; s < split.size(); ++s) {
    double load = 0;
    for (int k = 0; k < split[s]; ++k) load += block_cost[i++];
    slowest = std::max(slowest, load / stage_speed[s]);
  }
  assert(i == block_cost.size());
  const double m = microbatches;
  return (m + static_cast<double>(split.size()) - 1) / m * slowest + fixed_ms;
}

std::vector<int> balanced_split(const std::vector<double>& block_cost,
                                const std::vector<double>& stage_speed) {
  assert(!stage_speed.empty() && block_cost.size() >= stage_speed.size());
  const size_t stages = stage_speed.size(), blocks = block_cost.size();
  std::vector<double> prefix(blocks + 1, 0.0);
  for (size_t i = 0; i < blocks; ++i) prefix[i + 1] = prefix[i] + block_cost[i];
  // The split at bottleneck `limit` (reachable), each stage starting as late as it can (so
  // earlier stages fill up), and the bottleneck it reaches.
  std::vector<std::vector<char>> starts(stages);
  std::vector<int> split(stages);
  auto trace = [&](double limit) {
    size_t end = blocks;
    double worst = 0;
    for (size_t s = stages; s-- > 0;) {
      size_t start = end - 1;
      while (!(starts[s][start] && prefix[end] - prefix[start] <= limit * stage_speed[s])) --start;
      split[s] = static_cast<int>(end - start);
      worst = std::max(worst, (prefix[end] - prefix[start]) / stage_speed[s]);
      end = start;
    }
    assert(end == 0);
    return worst;
  };
  // The bracket: no split beats the blocks spread as a fluid in proportion to speed; the split
  // in proportion to speed (whole blocks) reaches its own bottleneck.
  const double speeds = std::accumulate(stage_speed.begin(), stage_speed.end(), 0.0);
  std::vector<double> share(stages);
  for (size_t s = 0; s < stages; ++s) {
    share[s] = static_cast<double>(blocks) * stage_speed[s] / speeds;
  }
  const std::vector<int> proportional = dp::round_counts(share, static_cast<int>(blocks));
  double hi = 0;  // a bottleneck some split reaches
  for (size_t s = 0, i = 0; s < stages; ++s) {
    const size_t end = i + static_cast<size_t>(proportional[s]);
    hi = std::max(hi, (prefix[end] - prefix[i]) / stage_speed[s]);
    i = end;
  }
  double lo = prefix[blocks] / speeds * (1 - 1e-12);  // below every split's
  // Bisection, with hi lowered to the bottleneck the split found actually reaches; it stops when
  // nothing below hi is reachable (hi is the optimum, to a relative 1e-12: the bottlenecks that
  // whole blocks give are few, so this is usually a handful of rounds) or the bracket closes.
  constexpr double kSlack = 1e-12;  // the check multiplies where the bottleneck divides
  bool probe = true;
  for (int round = 0; round < 200; ++round) {
    if (probe && !reachable(prefix, stage_speed, hi * (1 - kSlack), nullptr)) break;
    const double mid = lo + (hi - lo) / 2;
    if (mid <= lo || mid >= hi || hi - lo <= 1e-10 * hi) break;
    probe = reachable(prefix, stage_speed, mid, &starts);
    if (probe) hi = trace(mid);
    else lo = mid;
  }
  [[maybe_unused]] const bool covered = reachable(prefix, stage_speed, hi * (1 + kSlack), &starts);
  assert(covered);
  trace(hi * (1 + kSlack));
  return split;
}

Strategy pipeline_layout(const std::vector<int>& split, int global_batch, int microbatches) {
  Strategy s;
  s.dp = 1;
  s.pp = static_cast<int>(split.size());
  s.global_batch = global_batch;
  s.microbatch_size = std::max(1, global_batch / std::max(1, microbatches));
  s.stage_layers = split;
  return s;
}

PipelineModel::PipelineModel(PipelineModelOptions options) : o_(std::move(options)) {
  // Preconditions: deploy checks the JobInfo (world size, blocks, batch) before a model is made.
  assert(o_.stages >= 1 && o_.global_batch >= 1 && o_.microbatches >= 1 &&
         o_.block_params.size() == o_.block_bytes.size() &&
         o_.block_params.size() >= static_cast<size_t>(o_.stages) && o_.default_bytes_per_ms > 0);
  std::map<uint64_t, int> classes;
  for (uint64_t p : o_.block_params) {
    const auto [it, added] = classes.emplace(p, static_cast<int>(classes.size()));
    class_of_.push_back(it->second);
  }
  classes_ = static_cast<int>(classes.size());
  cost_.assign(o_.block_params.size(), 0.0);
  speed_.assign(o_.stages, 1.0);
  stage_ms_.assign(o_.stages, 0.0);
  microbatches_ = o_.microbatches;
  bytes_per_ms_ = o_.default_bytes_per_ms;
}

std::vector<int> PipelineModel::reported(const monitor::Beliefs& b) const {
  if (static_cast<int>(b.rank_stage.size()) != o_.stages) return {};
  std::vector<int> split(o_.stages);
  int next = 0;
  for (int s = 0; s < o_.stages; ++s) {
    const monitor::StageFacts& f = b.rank_stage[s];
    if (f.first_block != next) return {};  // not (yet) one contiguous cover in stage order
    split[s] = f.blocks;
    next += f.blocks;
  }
  return split;
}

std::string PipelineModel::fit(const monitor::Beliefs& b, const std::vector<int>& current) {
  const int stages = o_.stages;
  std::string missing;
  std::vector<std::vector<double>> measured(stages);
  std::vector<int> first(stages, 0);
  std::vector<double> relative_se(stages, 0.0);
  double fixed = 0;
  int microbatches = 0;
  std::vector<double> bandwidths;
  int next = 0;
  for (int s = 0; s < stages; ++s) {
    first[s] = next;
    next += current[s];
    const double level = s < static_cast<int>(b.rank_compute_ms.size()) ? b.rank_compute_ms[s] : 0;
    const bool lost = s < static_cast<int>(b.conditions.gpu_failed.size()) &&
                      b.conditions.gpu_failed[s];
    const monitor::StageFacts* f =
        s < static_cast<int>(b.rank_stage.size()) ? &b.rank_stage[s] : nullptr;
    // Measured under the split in force, or not at all (a stage still reporting old blocks).
    if (level <= 0 || lost || !f || f->first_block != first[s] || f->blocks != current[s]) {
      if (!missing.empty()) missing += ',';
      missing += std::to_string(s);
      continue;
    }
    const double samples = s < static_cast<int>(b.rank_samples.size()) ? b.rank_samples[s] : 0;
    const double stage_fixed =
        s < static_cast<int>(b.rank_fixed_ms.size()) ? b.rank_fixed_ms[s] : 0;
    const double per_step = b.compute_per_sample ? level * samples + stage_fixed : level;
    stage_ms_[s] = per_step;
    const double se = s < static_cast<int>(b.rank_compute_se_ms.size())
                          ? std::max(0.0, b.rank_compute_se_ms[s])
                          : 0.0;
    relative_se[s] = se / level;
    if (static_cast<int>(f->block_ms.size()) == f->blocks) {
      measured[s] = f->block_ms;
      double blocks_ms = 0;
      for (double ms : f->block_ms) blocks_ms += ms;
      fixed = std::max(fixed, per_step - blocks_ms);
    } else {
      measured[s].assign(f->blocks, per_step / f->blocks);  // equal cost per block assumed
    }
    microbatches = std::max(microbatches, f->microbatches);
    if (f->p2p_ms > 0 && f->p2p_bytes > 0) bandwidths.push_back(f->p2p_bytes / f->p2p_ms);
  }
  if (!missing.empty()) {
    speed_.assign(stages, 1.0);
    return missing;
  }
  fixed_ = std::max(0.0, fixed);
  microbatches_ = microbatches > 0 ? microbatches : o_.microbatches;
  bytes_per_ms_ = bandwidths.empty() ? o_.default_bytes_per_ms : monitor::median(bandwidths);
  separate(measured, first, relative_se);
  return "";
}

void PipelineModel::separate(const std::vector<std::vector<double>>& measured,
                             const std::vector<int>& first,
                             const std::vector<double>& relative_se) {
  const int stages = o_.stages;
  std::vector<double> speed(stages, 1.0), class_cost(classes_, 0.0);
  std::vector<std::vector<double>> scratch(classes_);
  for (int round = 0; round < kSeparationRounds; ++round) {
    // A class's cost at speed 1: the median over its blocks of measured cost x stage speed.
    for (auto& v : scratch) v.clear();
    for (int s = 0; s < stages; ++s) {
      for (size_t k = 0; k < measured[s].size(); ++k) {
        scratch[class_of_[first[s] + k]].push_back(measured[s][k] * speed[s]);
      }
    }
    for (int c = 0; c < classes_; ++c) {
      class_cost[c] = scratch[c].empty() ? 0.0 : monitor::median(scratch[c]);
    }
    // A stage's speed: the median over its blocks of their class cost over their measured cost.
    for (int s = 0; s < stages; ++s) {
      std::vector<double> ratios;
      for (size_t k = 0; k < measured[s].size(); ++k) {
        if (measured[s][k] > 0) {
          ratios.push_back(class_cost[class_of_[first[s] + k]] / measured[s][k]);
        }
      }
      speed[s] = ratios.empty() ? 1.0 : monitor::median(ratios);
    }
    const double mid = monitor::median(speed);
    if (mid > 0) {
      for (double& v : speed) v /= mid;
    }
  }
  // Noise-level differences removed: a speed within the band of 1, or within noise of it,
  // reads as 1.
  const double median_se = monitor::median(relative_se);
  for (int s = 0; s < stages; ++s) {
    double& v = speed[s];
    const bool in_band = v < 1 + o_.equal_band && v * (1 + o_.equal_band) > 1;
    const bool in_noise = std::abs(v - 1) <= o_.noise_k * std::hypot(relative_se[s], median_se);
    if (in_band || in_noise || v <= 0) v = 1;
    speed_[s] = std::clamp(v, 0.01, 1.5);
  }
  for (size_t i = 0; i < cost_.size(); ++i) cost_[i] = class_cost[class_of_[i]];
}

std::vector<dp::SplitModel::Proposal> PipelineModel::proposals(
    const std::vector<int>& current) const {
  const std::vector<int> target = balanced_split(cost_, speed_);
  std::vector<double> halfway(o_.stages);
  for (int s = 0; s < o_.stages; ++s) halfway[s] = 0.5 * (current[s] + target[s]);
  return {{target, "balanced"},
          {dp::round_counts(halfway, total()), "half-way to balanced"},
          {dp::even_counts(o_.stages, total()), "even"}};
}

double PipelineModel::predict_ms(const std::vector<int>& split) const {
  return pipeline_step_ms(cost_, speed_, split, microbatches_, fixed_);
}

double PipelineModel::staged_s(const std::vector<int>& from, const std::vector<int>& to,
                               double) const {
  // Block i's stage before and after; the blocks that change stage stream their state.
  double bytes = 0;
  size_t i = 0;
  int s_from = 0, left_from = from[0], s_to = 0, left_to = to[0];
  for (; i < o_.block_bytes.size(); ++i) {
    while (left_from == 0) left_from = from[++s_from];
    while (left_to == 0) left_to = to[++s_to];
    if (s_from != s_to) {
      bytes += static_cast<double>(o_.block_bytes[i]) * (1 + o_.optimizer_states);
    }
    --left_from;
    --left_to;
  }
  return bytes / bytes_per_ms_ / 1000;
}

std::string PipelineModel::evidence(const std::vector<int>& current,
                                    const std::vector<int>* best) const {
  // The stage the best candidate takes the most blocks from, or the slowest stage.
  std::vector<double> per_microbatch(o_.stages, 0.0);
  std::vector<int> first(o_.stages, 0);
  int next = 0;
  for (int s = 0; s < o_.stages; ++s) {
    first[s] = next;
    for (int k = 0; k < current[s]; ++k) per_microbatch[s] += cost_[next + k];
    per_microbatch[s] /= speed_[s] * microbatches_;
    next += current[s];
  }
  int named = static_cast<int>(std::max_element(per_microbatch.begin(), per_microbatch.end()) -
                               per_microbatch.begin());
  if (best) {
    int most = -1;
    for (int s = 0; s < o_.stages; ++s) {
      const int give = current[s] - (*best)[s];
      if (give > 0 && (most < 0 || give > current[most] - (*best)[most])) most = s;
    }
    if (most >= 0) named = most;
  }
  std::vector<double> stage_ms = stage_ms_;
  return dp::reason_text(
      "stage %d (blocks %d-%d) runs at speed %.2f: %.1f ms of compute per step vs the median "
      "stage's %.1f, %.2f ms per micro-batch",
      named, first[named], first[named] + current[named] - 1, speed_[named], stage_ms_[named],
      monitor::median(stage_ms), per_microbatch[named]);
}

Strategy PipelineModel::layout(const std::vector<int>& split) const {
  return pipeline_layout(split, o_.global_batch, microbatches_);
}

}  // namespace parapilot::env::pp
