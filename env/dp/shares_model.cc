#include "env/dp/shares_model.h"

#include <algorithm>
#include <cassert>
#include <cmath>

#include "env/dp/shares.h"
#include "env/monitor/robust_stats.h"

namespace parapilot::env::dp {

SharesModel::SharesModel(SharesModelOptions options) : o_(options) {
  assert(o_.ranks >= 1 && o_.global_batch >= o_.ranks);  // the decider's preconditions
}

std::vector<int> SharesModel::reported(const monitor::Beliefs& b) const {
  if (static_cast<int>(b.rank_samples.size()) != o_.ranks) return {};
  std::vector<int> seen(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) seen[r] = static_cast<int>(b.rank_samples[r]);
  return seen;
}

// Each rank's compute per sample (and its standard error), and its fixed part per step when the
// ranks report one; `missing` lists the ranks with no measurement yet or on a lost GPU.
SharesModel::RankLevels SharesModel::rank_levels(const monitor::Beliefs& b,
                                                 const std::vector<int>& current) const {
  RankLevels levels{std::vector<double>(o_.ranks, 0.0), std::vector<double>(o_.ranks, 0.0),
                    std::vector<double>(o_.ranks, 0.0), {}};
  for (int r = 0; r < o_.ranks; ++r) {
    const double level = r < static_cast<int>(b.rank_compute_ms.size()) ? b.rank_compute_ms[r] : 0;
    const bool lost = r < static_cast<int>(b.conditions.gpu_failed.size()) &&
                      b.conditions.gpu_failed[r];
    if (level <= 0 || lost) {
      if (!levels.missing.empty()) levels.missing += ',';
      levels.missing += std::to_string(r);
      continue;
    }
    const double level_se = r < static_cast<int>(b.rank_compute_se_ms.size())
                                ? std::max(0.0, b.rank_compute_se_ms[r])
                                : 0.0;
    if (b.compute_per_sample) {
      levels.per_sample[r] = level;
      levels.se[r] = level_se;
      levels.fixed[r] = r < static_cast<int>(b.rank_fixed_ms.size()) ? b.rank_fixed_ms[r] : 0.0;
    } else {
      levels.per_sample[r] = level / current[r];
      levels.se[r] = level_se / current[r];
    }
  }
  return levels;
}

void SharesModel::denoise(RankLevels& levels) const {
  std::vector<double> measured, fixed_measured, se_measured;
  for (int r = 0; r < o_.ranks; ++r) {
    if (levels.per_sample[r] <= 0) continue;
    measured.push_back(levels.per_sample[r]);
    fixed_measured.push_back(levels.fixed[r]);
    se_measured.push_back(levels.se[r]);
  }
  if (measured.empty()) return;
  const double median_ms = monitor::median(measured);
  const double median_fixed = monitor::median(fixed_measured);
  const double median_se = monitor::median(se_measured);
  const double typical_step = median_fixed + median_ms * o_.global_batch / o_.ranks;
  for (int r = 0; r < o_.ranks; ++r) {
    double& c = levels.per_sample[r];
    if (c <= 0) continue;
    const bool in_band = c < median_ms * (1 + o_.equal_band) && c * (1 + o_.equal_band) > median_ms;
    const bool in_noise = std::abs(c - median_ms) <= o_.noise_k * std::hypot(levels.se[r], median_se);
    if (in_band || in_noise) c = median_ms;
    double& f = levels.fixed[r];
    if (std::abs(f - median_fixed) < o_.equal_band * typical_step) f = median_fixed;
  }
}

std::string SharesModel::fit(const monitor::Beliefs& b, const std::vector<int>& current) {
  raw_ = rank_levels(b, current);
  model_ = raw_;
  denoise(model_);
  fixed_apart_ = b.fixed_apart;
  waits_.clear();
  if (static_cast<int>(b.rank_wait_ms.size()) == o_.ranks &&
      *std::min_element(b.rank_wait_ms.begin(), b.rank_wait_ms.end()) >= 0) {
    waits_ = b.rank_wait_ms;
  }
  return raw_.missing;
}

std::vector<double> SharesModel::speeds() const {
  std::vector<double> measured;
  for (double v : model_.per_sample) {
    if (v > 0) measured.push_back(v);
  }
  const double median_ms = measured.empty() ? 0.0 : monitor::median(measured);
  std::vector<double> speed(o_.ranks, 1.0);
  for (int r = 0; r < o_.ranks; ++r) {
    if (model_.per_sample[r] > 0 && median_ms > 0) {
      speed[r] = std::clamp(median_ms / model_.per_sample[r], 0.01, 1.5);
    }
  }
  return speed;
}

std::vector<SplitModel::Proposal> SharesModel::proposals(const std::vector<int>& current) const {
  const std::vector<int> target =
      balanced_counts(model_.per_sample, model_.fixed, o_.global_batch, fixed_apart_);
  std::vector<double> halfway(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) halfway[r] = 0.5 * (current[r] + target[r]);
  return {{target, "balanced"},
          {round_counts(halfway, o_.global_batch), "half-way to balanced"},
          {even_counts(o_.ranks, o_.global_batch), "even"}};
}

double SharesModel::predict_ms(const std::vector<int>& split) const {
  return predicted_step_ms(model_.per_sample, model_.fixed, split, fixed_apart_);
}

double SharesModel::staged_s(const std::vector<int>&, const std::vector<int>&,
                             double step_s) const {
  return step_s;  // a share change costs about one step: the boundary agreement
}

std::string SharesModel::evidence(const std::vector<int>& current,
                                  const std::vector<int>* best) const {
  // The rank the best offer takes the most work from, or the slowest rank.
  std::vector<double> step_of(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) step_of[r] = raw_.fixed[r] + raw_.per_sample[r] * current[r];
  int named = static_cast<int>(std::max_element(step_of.begin(), step_of.end()) - step_of.begin());
  if (best) {
    int most = -1;
    for (int r = 0; r < o_.ranks; ++r) {
      const int give = current[r] - (*best)[r];
      if (give <= 0) continue;
      if (most < 0 || give > current[most] - (*best)[most]) most = r;
    }
    if (most >= 0) named = most;
  }
  std::vector<double> ps = raw_.per_sample, fx = raw_.fixed;
  return reason_text(
      "rank %d computes %.3f ms per sample + %.1f ms per step vs the median %.3f + %.1f", named,
      raw_.per_sample[named], raw_.fixed[named], monitor::median(ps), monitor::median(fx));
}

std::string SharesModel::disagrees(const std::vector<int>& current,
                                   const std::vector<int>& target) const {
  if (waits_.empty()) return "";  // not measured everywhere
  const std::vector<double>& waits = waits_;
  const double least = *std::min_element(waits.begin(), waits.end());
  const double mid = monitor::median(waits);
  // Arriving last: waiting least, or within a quarter of the way from the least to the median.
  auto late = [&](int r) { return waits[r] <= least + o_.late_fraction * (mid - least); };
  std::vector<double> step_of(o_.ranks);
  for (int r = 0; r < o_.ranks; ++r) {
    step_of[r] = (fixed_apart_ ? 0.0 : model_.fixed[r]) + model_.per_sample[r] * current[r];
  }
  const double slowest = *std::max_element(step_of.begin(), step_of.end());
  bool confirmed = false;
  int model_slowest = 0, arrives_last = 0;
  for (int r = 0; r < o_.ranks; ++r) {
    if (step_of[r] > step_of[model_slowest]) model_slowest = r;
    if (waits[r] < waits[arrives_last]) arrives_last = r;
    confirmed |= late(r) && step_of[r] >= (1 - o_.equal_band / 2) * slowest;
  }
  if (!confirmed) {
    return reason_text(
        "not confirmed by arrival order: the model's slowest rank %d waits %.1f ms in the "
        "collectives a step, rank %d arrives last (waits %.1f ms; median %.1f)",
        model_slowest, waits[model_slowest], arrives_last, least, mid);
  }
  for (int r = 0; r < o_.ranks; ++r) {
    if (late(r) && target[r] > current[r]) {
      return reason_text(
          "would move work onto rank %d, which arrives last at the collectives (waits %.1f ms a "
          "step; median %.1f)",
          r, waits[r], mid);
    }
  }
  return "";
}

double SharesModel::exposed_wait_ms() const {
  return waits_.empty() ? 0.0 : monitor::median(waits_);
}

Strategy SharesModel::layout(const std::vector<int>& split) const {
  // Pure data parallel over all ranks with these shares.
  Strategy s;
  s.dp = static_cast<int>(split.size());
  s.dp_shares = split;
  return s;
}

}  // namespace parapilot::env::dp
