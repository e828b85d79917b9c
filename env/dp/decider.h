// DataParallelDecider: the decision core for a data-parallel job learned from its ranks (every
// PyTorch job deploy watches, and the dp: simulator). The one knob is each rank's share of the
// global batch; every figure is in the job's own units, from its own telemetry. Each decision is
// two calls: observe() builds the policy's observation (docs/observation.md) from the monitor's
// beliefs, and decide() turns the policy's action on it into a decision through the guardrail.
// Whatever the policy, the guardrail is the same:
//
// * The model. A rank's step costs a fixed part (Beliefs::rank_fixed_ms: its optimizer step)
//   plus its measured compute per sample (Beliefs::rank_compute_ms) times its samples; the
//   job's step is the slowest rank's (with Beliefs::fixed_apart, the slowest per-sample work
//   plus the slowest fixed part: shares cannot shorten the latter). A rank counts as equal to
//   the median rank when its compute per sample is within `equal_band` of the median's, or
//   within `noise_k` standard errors of the two levels (Beliefs::rank_compute_se_ms): on a
//   loaded machine the band widens with the noise.
// * The candidates (at most env::kMaxCandidates, best predicted first): the balanced shares
//   (equal predicted steps, water-filling), half-way from the current shares to them, even
//   shares, and the fastest shares measured since the job last changed; each with its
//   predicted gain, and a switch cost of one step (the boundary agreement) as the pause. The
//   observation's speeds are the median rank's compute per sample over each rank's; its
//   condition features count decisions in a row that predict a shortfall shedding work from the
//   same ranks (load that wanders from rank to rank starts the count afresh).
// * No candidates (the policy can only keep) while a switch is in flight, during the cool-down
//   after a switch, while the job's first steps are measured, while a rank has no measurement,
//   and while the last switch is being verified.
// * Arrival order: where the ranks measure their waits in collectives (Beliefs::rank_wait_ms), a
//   switch happens only when one of the ranks the model says hold the step up is among those
//   that wait least (arrive last), and no work moves onto a rank that arrives last.
// * Verification: after a committed switch the measured step time (median wall time of closed
//   steps, from `settle_steps` after the switch) is compared with the interval before it. Worse
//   beyond noise (max(revert_margin, 3 robust standard errors), at most max_revert_bound)
//   reverts to the previous shares, and the cool-down doubles (up to max_backoff_intervals); a
//   switch that held resets it. The decider also remembers the fastest shares measured since
//   the job last changed: a switch measured slower than those beyond noise reverts to them, so
//   switches that each stay within noise of the one before cannot add up to a slower job. The
//   record is forgotten when the shares in force get slower beyond noise without a switch.
//
// Thread-safety: not thread-safe; one decider per job, called from one thread at a time.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "env/env.h"
#include "env/monitor/monitor.h"
#include "env/observation.h"

namespace parapilot::env::dp {

/// The horizon the observation's time features are normalised by (the run's length is not
/// known to a deployed job: run_left reads kUnknownRemaining, and payback counts half of it).
inline constexpr int kHorizonDecisions = 64;

struct DataParallelOptions {
  int ranks = 0;               ///< world size (required, >= 1).
  int global_batch = 0;        ///< samples per step (required, >= ranks).
  int decision_steps = 10;     ///< training steps per decision (the interval's length).
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
  /// Where ranks measure their waits in collectives, a rank arrives last when its wait is within
  /// this fraction of the way from the least wait to the median.
  double late_fraction = 0.25;
};

struct DataParallelDecision {
  enum class Kind { keep, rebalance, revert };
  Kind kind = Kind::keep;
  std::vector<int> counts;      ///< target samples per rank (rebalance, revert).
  std::string reason;           ///< why: the evidence, or why nothing is done.
  int action = 0;               ///< the policy's action this decision answers.
  double current_step_ms = 0;   ///< measured (median of the recent interval); 0: unknown.
  double predicted_now_ms = 0;  ///< the model's step for the current counts.
  double predicted_new_ms = 0;  ///< ... for the target counts (rebalance).
};
const char* to_string(DataParallelDecision::Kind kind);

class DataParallelDecider {
 public:
  /// Precondition (asserted): ranks >= 1, global_batch >= ranks, decision_steps >= 1,
  /// verify_steps >= 1, settle_steps >= 0, equal_band >= 0, noise_k >= 0, max_revert_bound >=
  /// revert_margin, late_fraction >= 0.
  explicit DataParallelDecider(DataParallelOptions options);

  /// One closed step's wall time (Beliefs::last_step_ms), in step order.
  void observe_step(uint64_t step, double step_ms);
  /// Starts a decision: the observation of the job under `beliefs` and its candidates.
  /// `staging`: a switch is in flight.
  Observation observe(const monitor::Beliefs& beliefs, bool staging);
  /// Ends the decision observe() started: `action` 0 keeps, k switches to candidate k-1 (a
  /// masked action keeps). A verdict of the guardrail (a revert) stands whatever the action.
  /// Precondition: observe() was called since the last decide().
  DataParallelDecision decide(int action);
  /// A switch to `counts` took effect at `switch_at_step`; `revert` when it undid the last one.
  void committed(const std::vector<int>& counts, uint64_t switch_at_step, bool revert);
  /// A switch was aborted (the cool-down still applies, so aborts cannot repeat every interval).
  void aborted();

  const std::vector<int>& counts() const { return counts_; }
  int cooldown_intervals() const { return cooldown_; }

 private:
  struct RankLevels {
    std::vector<double> per_sample, fixed, se;  // per rank, ms
    std::string missing;                        // the ranks not measured, comma-separated
  };
  struct Offer {
    std::vector<int> counts;
    double predicted_ms = 0;
    const char* what = "";
  };
  std::vector<double> steps_since(uint64_t first) const;
  RankLevels rank_levels(const monitor::Beliefs& b) const;
  // Noise-level differences removed: per-sample levels within the band or the noise of the
  // median's read as the median's, fixed parts within the band of a median rank's step too.
  void denoise(RankLevels& levels) const;
  // Why the policy gets no candidates this decision ("" when it does); may set forced_.
  std::string guard(double now_ms, double now_se, bool staging);
  void judge_last_switch(double now_ms, double now_se);
  // The model's levels with noise-level differences removed, the offers, and the evidence.
  void make_offers(const monitor::Beliefs& b, const RankLevels& raw, const RankLevels& model);
  // The observation: speeds from the model's levels; candidates when `offers`.
  Observation build(const monitor::Beliefs& b, const RankLevels& model, bool offers);
  double revert_bound(double reference_ms, double reference_se, double now_se) const;
  void remember_best(double ms, double se);
  void track_best(double now_ms, double now_se);
  std::string arrival_disagrees(const std::vector<int>& target) const;

  DataParallelOptions o_;
  std::vector<int> counts_;                        // the shares in force
  std::vector<int> previous_counts_;               // before the last switch (revert target)
  std::deque<std::pair<uint64_t, double>> steps_;  // recent (step, wall ms)
  int cooldown_;
  int since_switch_ = 1 << 20;            // decisions since the last switch was prepared
  int decisions_ = 0;                     // observe() calls so far
  int last_switch_decision_ = -1;         // the decision of the last committed switch
  bool verifying_ = false;                // the last switch is being judged
  uint64_t verify_from_ = 0;              // first step that counts for the judgement
  double before_ms_ = 0, before_se_ = 0;  // the interval before the switch
  double pending_before_ms_ = 0, pending_before_se_ = 0;
  double now_ms_ = 0, now_se_ = 0;        // the recent interval, as the decision measured it
  std::vector<int> best_counts_;          // the fastest shares measured since the job changed
  double best_ms_ = 0, best_se_ = 0;
  double judged_ms_ = 0, judged_se_ = 0;  // the shares in force, when last measured
  double previous_min_speed_ = 1;

  // The decision in progress (observe() to decide()).
  bool observed_ = false;
  DataParallelDecision pending_;  // keep with its reason, or the guardrail's forced verdict
  bool forced_ = false;           // pending_ stands whatever the action
  std::vector<Offer> offers_;     // the candidates, in the observation's order
  std::vector<double> model_ps_, model_fixed_;  // the model's levels (noise removed)
  bool fixed_apart_ = false;
  bool staging_ = false;          // a switch is in flight
  std::vector<double> waits_;     // the ranks' waits in collectives (empty: not measured)
  std::string evidence_;          // the model's evidence, for reasons
  std::vector<int> shed_;         // the ranks the best offer takes work from
  std::vector<int> condition_shed_;  // ...at the decisions the condition features counted
  ObservationHistory history_;
};

}  // namespace parapilot::env::dp
