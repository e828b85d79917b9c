// DataParallelDecider: decisions for a data-parallel job that the agent learned from the job
// itself (the ranks' JobInfo announcements; no scenario file). The one knob is each rank's share
// of the global batch, and every figure is in the job's own units, from its own telemetry:
//
// * A rank's step costs a fixed part (Beliefs::rank_fixed_ms: its optimizer step) plus its
//   measured compute per sample (Beliefs::rank_compute_ms: everything else it does in a step
//   except waiting in collectives, per sample) times its samples; the job's step is the slowest
//   rank's. Where another collective synchronises the ranks between the optimizer step and the
//   next gradient reduction (Beliefs::fixed_apart: DDP's buffer broadcast, a logging
//   all-reduce), the step is the slowest per-sample work plus the slowest fixed part, and
//   shares cannot shorten the latter. Balanced shares equalise the ranks' predicted steps (water-filling; every rank keeps
//   at least one sample). A rank counts as equal to the median rank when its compute per sample
//   is within `equal_band` of the median's, or within `noise_k` standard errors of the two
//   levels (Beliefs::rank_compute_se_ms, from the spread the monitor measures): on a loaded
//   machine the band widens with the noise.
// * A switch is proposed only when the predicted step-time ratio, after charging the switch's
//   cost (one step at the current time, amortised over the cool-down), reaches `min_gain` in
//   `confirm_decisions` decisions in a row that move work away from the same ranks (load that
//   wanders from rank to rank is not a slow rank), and only when arrival order agrees: where the
//   ranks measure their waits in collectives (Beliefs::rank_wait_ms), one of the ranks the model
//   says hold the step up must be among those that wait least (arrive last), and no work moves
//   onto a rank that arrives last.
// * Guardrail: after a committed switch the measured step time (median wall time of closed steps,
//   from `settle_steps` after the switch) is compared with the interval before it. Worse beyond
//   noise (max(revert_margin, 3 robust standard errors), at most max_revert_bound) reverts to
//   the previous shares, and the cool-down doubles (up to max_backoff_intervals); a switch that
//   held resets it. The decider also remembers the fastest shares measured since the job last
//   changed: a switch measured slower than those beyond noise reverts to them, so switches that
//   each stay within noise of the one before cannot add up to a slower job. The record is
//   forgotten when the shares in force get slower beyond noise without a switch (the job
//   changed: what other shares measured before no longer applies).
//
// Thread-safety: not thread-safe; the deploy agent calls it under its decision lock.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "env/monitor/monitor.h"

namespace parapilot::agent::deploy {

struct DataParallelOptions {
  int ranks = 0;               ///< world size (required, >= 1).
  int global_batch = 0;        ///< samples per step (required, >= ranks).
  double min_gain = 1.10;      ///< predicted step-time ratio a switch must reach.
  int cooldown_intervals = 2;  ///< decisions to wait after a switch (doubles after a revert).
  int max_backoff_intervals = 32;
  int settle_steps = 3;         ///< steps after a switch not used to judge it.
  int verify_steps = 10;        ///< steps measured after a switch before judging it.
  double revert_margin = 0.05;  ///< smallest relative slowdown that reverts a switch.
  /// Largest noise bound: a switch measured this much slower is reverted however noisy the
  /// job's steps (>= revert_margin).
  double max_revert_bound = 0.10;
  /// Ranks whose compute per sample is within this relative distance of the median count as
  /// equal to it: step-to-step noise on a shared machine must not move work between healthy
  /// ranks.
  double equal_band = 0.2;
  /// ... or within this many standard errors of the two levels (the rank's and the median's).
  double noise_k = 3.0;
  int warmup_steps = 10;  ///< the job's first steps (start-up transients) are not measured.
  /// Decisions in a row that must predict the gain, shedding work from the same ranks, before
  /// a switch (a passing asymmetry, e.g. another process taking a core for a while, is not
  /// acted on).
  int confirm_decisions = 2;
  /// Where ranks measure their waits in collectives (Beliefs::rank_wait_ms), a rank arrives last
  /// when its wait is within this fraction of the way from the least wait to the median.
  double late_fraction = 0.25;
};

/// Samples per rank that equalise fixed_ms[r] + per_sample_ms[r] * n[r] (each >= 1, summing to
/// global_batch; water-filling, then largest remainder). per_sample_ms must be > 0 for every
/// rank; fixed_ms may be empty (all 0). `fixed_apart` (Beliefs::fixed_apart): the fixed parts
/// run between other synchronisation points than the per-sample work, so only per_sample_ms[r]
/// * n[r] is equalised.
std::vector<int> balanced_counts(const std::vector<double>& per_sample_ms,
                                 const std::vector<double>& fixed_ms, int global_batch,
                                 bool fixed_apart = false);
/// The step's compute for these counts: max_r fixed_ms[r] + per_sample_ms[r] * counts[r]; with
/// `fixed_apart`, max_r per_sample_ms[r] * counts[r] + max_r fixed_ms[r].
double predicted_step_ms(const std::vector<double>& per_sample_ms,
                         const std::vector<double>& fixed_ms, const std::vector<int>& counts,
                         bool fixed_apart = false);
/// "a,b,c": samples per rank as deploy's log and reasons print them.
std::string counts_text(const std::vector<int>& counts);
/// Even split of global_batch (largest remainder, lower ranks first), as the clients do.
std::vector<int> even_counts(int ranks, int global_batch);

struct DataParallelDecision {
  enum class Kind { keep, rebalance, revert };
  Kind kind = Kind::keep;
  std::vector<int> counts;      ///< target samples per rank (rebalance, revert).
  std::string reason;           ///< why: the evidence, or why nothing is done.
  double current_step_ms = 0;   ///< measured (median of the recent interval); 0: unknown.
  double predicted_now_ms = 0;  ///< the model's step for the current counts.
  double predicted_new_ms = 0;  ///< ... for the target counts.
  double predicted_gain = 1;    ///< predicted_now / (predicted_new + amortised cost).
};
const char* to_string(DataParallelDecision::Kind kind);

class DataParallelDecider {
 public:
  /// Precondition (asserted): ranks >= 1, global_batch >= ranks, verify_steps >= 1,
  /// settle_steps >= 0, min_gain >= 1, equal_band >= 0, noise_k >= 0, max_revert_bound >=
  /// revert_margin, late_fraction >= 0.
  explicit DataParallelDecider(DataParallelOptions options);

  /// One closed step's wall time (Beliefs::last_step_ms), in step order.
  void observe_step(uint64_t step, double step_ms);
  /// Decides at the end of a decision interval. `staging`: a switch is in flight.
  DataParallelDecision decide(const monitor::Beliefs& beliefs, bool staging);
  /// A switch to `counts` took effect at `switch_at_step`; `revert` when it undid the last one.
  void committed(const std::vector<int>& counts, uint64_t switch_at_step, bool revert);
  /// A switch was aborted (the cool-down still applies, so aborts cannot repeat every interval).
  void aborted();

  const std::vector<int>& counts() const { return counts_; }
  int cooldown_intervals() const { return cooldown_; }

 private:
  std::vector<double> steps_since(uint64_t first) const;
  // decide()'s phases: judging the switch being verified; each rank's measured levels; planning
  // a rebalance from them.
  DataParallelDecision judge_last_switch(DataParallelDecision d, double now_ms, double now_se);
  struct RankLevels {
    std::vector<double> per_sample, fixed, se;  // per rank, ms
    std::string missing;                        // the ranks not measured, comma-separated
  };
  RankLevels rank_levels(const monitor::Beliefs& b) const;
  DataParallelDecision plan_rebalance(DataParallelDecision d, const monitor::Beliefs& b,
                                      RankLevels levels, double now_ms, double now_se);
  // The relative slowdown beyond which a step time is worse than `reference_ms`.
  double revert_bound(double reference_ms, double reference_se, double now_se) const;
  void remember_best(double ms, double se);
  // Re-measures the fastest shares while they run; forgets them when the job changed.
  void track_best(double now_ms, double now_se);
  // Why arrival order contradicts moving to `target` ("" when it agrees or is not measured).
  std::string arrival_disagrees(const monitor::Beliefs& b, const std::vector<double>& per_sample,
                                const std::vector<double>& fixed,
                                const std::vector<int>& target) const;

  DataParallelOptions o_;
  std::vector<int> counts_;                        // the shares in force
  std::vector<int> previous_counts_;               // before the last switch (revert target)
  std::deque<std::pair<uint64_t, double>> steps_;  // recent (step, wall ms)
  int cooldown_;
  int since_switch_ = 1 << 20;            // decisions since the last switch was prepared
  int wanted_ = 0;                        // decisions in a row that predicted the gain...
  std::vector<int> wanted_from_;          // ...shedding work from these ranks
  bool verifying_ = false;                // the last switch is being judged
  uint64_t verify_from_ = 0;              // first step that counts for the judgement
  double before_ms_ = 0, before_se_ = 0;  // the interval before the switch
  double pending_before_ms_ = 0, pending_before_se_ = 0;
  std::vector<int> best_counts_;          // the fastest shares measured since the job changed
  double best_ms_ = 0, best_se_ = 0;
  double judged_ms_ = 0, judged_se_ = 0;  // the shares in force, when last measured
};

}  // namespace parapilot::agent::deploy
