// SharesModel: the split model of a data-parallel job (env/dp/split_model.h): samples of the
// global batch per rank. A rank's step costs a fixed part (Beliefs::rank_fixed_ms: its optimizer
// step) plus its measured compute per sample (Beliefs::rank_compute_ms) times its samples; the
// job's step is the slowest rank's (with Beliefs::fixed_apart, the slowest per-sample work plus
// the slowest fixed part: shares cannot shorten the latter). A rank counts as equal to the median
// rank when its compute per sample is within `equal_band` of the median's, or within `noise_k`
// standard errors of the two levels (Beliefs::rank_compute_se_ms). Candidates: balanced shares
// (water-filling), half-way to them, even shares. A switch costs about one step (the boundary
// agreement), staged beside training at no cost. Arrival order: where the ranks measure their
// waits (Beliefs::rank_wait_ms), a switch must have one of the ranks the model says hold the
// step up among those that arrive last, and must move no work onto a rank that arrives last.
//
// Thread-safety: not thread-safe (SplitModel's contract).
#pragma once

#include <string>
#include <vector>

#include "env/dp/split_model.h"

namespace parapilot::env::dp {

struct SharesModelOptions {
  int ranks = 0;         ///< >= 1.
  int global_batch = 0;  ///< >= ranks.
  double equal_band = 0.2;
  double noise_k = 3.0;
  double late_fraction = 0.25;
};

class SharesModel final : public SplitModel {
 public:
  /// Precondition (asserted): ranks >= 1, global_batch >= ranks.
  explicit SharesModel(SharesModelOptions options);

  int total() const override { return o_.global_batch; }
  const char* noun() const override { return "shares"; }
  std::vector<int> reported(const monitor::Beliefs& b) const override;
  std::string fit(const monitor::Beliefs& b, const std::vector<int>& current) override;
  std::vector<double> speeds() const override;
  std::vector<Proposal> proposals(const std::vector<int>& current) const override;
  double predict_ms(const std::vector<int>& split) const override;
  double staged_s(const std::vector<int>& from, const std::vector<int>& to,
                  double step_s) const override;
  double staging_slowdown() const override { return 0; }
  std::string evidence(const std::vector<int>& current,
                       const std::vector<int>* best) const override;
  std::string disagrees(const std::vector<int>& current,
                        const std::vector<int>& target) const override;
  double exposed_wait_ms() const override;
  Strategy layout(const std::vector<int>& split) const override;

 private:
  struct RankLevels {
    std::vector<double> per_sample, fixed, se;  // per rank, ms
    std::string missing;                        // the ranks not measured, comma-separated
  };
  RankLevels rank_levels(const monitor::Beliefs& b, const std::vector<int>& current) const;
  // Noise-level differences removed: per-sample levels within the band or the noise of the
  // median's read as the median's, fixed parts within the band of a median rank's step too.
  void denoise(RankLevels& levels) const;

  SharesModelOptions o_;
  RankLevels raw_, model_;     // the levels measured, and with noise-level differences removed
  bool fixed_apart_ = false;
  std::vector<double> waits_;  // the ranks' waits in collectives (empty: not measured)
};

}  // namespace parapilot::env::dp
