// DataParallelDecider: the decision core for a job learned from its ranks (every PyTorch job
// deploy watches, and the dp: simulator). The one knob is a split of the job's units over its
// ranks, each rank at least one, and its model (env/dp/split_model.h) says what a split costs:
// a data-parallel job's batch shares (env/dp/shares_model.h, the default) or a pipeline job's
// stage split (env/pp/pipeline_model.h). Every figure is in the job's own units, from its own
// telemetry. Each decision is two calls: observe() builds the policy's observation
// (docs/observation.md) from the monitor's beliefs, and decide() turns the policy's action on it
// into a decision through the guardrail. Whatever the policy and the model, the guardrail is
// the same:
//
// * The candidates (at most env::kMaxCandidates, best predicted first): the model's proposals
//   (balanced, half-way from the current split to it, even) and the fastest split measured
//   since the job last changed, none equal to the split in force; each with its predicted gain
//   and the model's switch cost (a share change: one step; moving pipeline blocks: their bytes
//   over the measured bandwidth plus the pause). The observation's speeds are the model's; its
//   condition features count decisions in a row that predict a shortfall shedding work from the
//   same ranks (load that wanders from rank to rank starts the count afresh).
// * No candidates (the policy can only keep) while a switch is in flight, during the cool-down
//   after a switch, while the job's first steps are measured, while a rank has no measurement,
//   and while the last switch is being verified.
// * The model may veto a chosen candidate its measurements contradict (a data-parallel job's
//   arrival order, SharesModel).
// * Verification: after a committed switch the measured step time (median wall time of closed
//   steps, from `settle_steps` after the switch) is compared with the interval before it. Worse
//   beyond noise (max(revert_margin, 3 robust standard errors), at most max_revert_bound)
//   reverts to the previous split, and the cool-down doubles (up to max_backoff_intervals); a
//   switch that held resets it. The decider also remembers the fastest split measured since
//   the job last changed: a switch measured slower than that beyond noise reverts to it, so
//   switches that each stay within noise of the one before cannot add up to a slower job. The
//   record is forgotten when the split in force gets slower beyond noise without a switch.
//   A switch during whose measurement the monitor's belief in a slow gradient all-reduce link
//   changed (Beliefs::slow_link) is not judged: the link, not the switch, changed the step; the
//   record restarts from the step measured then.
// * Compression (DataParallelOptions::compression; deploy sets it for a job that announces it
//   can switch compression): while the monitor believes the gradient all-reduce's link slow
//   (Beliefs::slow_link), the method is a candidate beside the splits. Every candidate's step is
//   then the split's compute (the model's) plus the measured exposed all-reduce wait
//   (Beliefs::dp_link_ms) times the bytes the candidate sends over the bytes sent now, plus the
//   method's own cost (0 until measured: the compute its switch added); a method's step waits
//   at least the wait it was measured to add itself (its casts run inside the all-reduce's
//   wait, overlapping the transfer: measured when a switch back held, as the compressed wait
//   less the uncompressed wait's share of it). With compression in force, "no compression" is
//   a candidate whenever it predicts a shorter step (the link recovered: the wait saved no
//   longer pays for the method). A compressed wait that fell beyond the monitor's noise bound
//   (Beliefs::dp_noise_ms) below the one measured when the method's switch held says the link
//   got faster by an amount the method's own wait may hide: the uncompressed bytes are then
//   predicted at the bandwidth the link had while normal (Beliefs::dp_reference), and the
//   verification reverts the switch if that was wrong. A compression switch is verified
//   and reverted like any other; where no compression candidate applies (no method, the link
//   not slow and none in force) every figure is the split model's alone, as without it.
//
// Thread-safety: not thread-safe; one decider per job, called from one thread at a time.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "env/dp/split_model.h"
#include "env/env.h"
#include "env/monitor/monitor.h"
#include "env/observation.h"

namespace parapilot::env::dp {

/// The horizon the observation's time features are normalised by (the run's length is not
/// known to a deployed job: run_left reads kUnknownRemaining, and payback counts half of it).
inline constexpr int kHorizonDecisions = 64;

struct DataParallelOptions {
  int ranks = 0;               ///< world size (required, >= 1).
  /// samples per step (required, >= 1; with the default shares model, >= ranks).
  int global_batch = 0;
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
  /// The gradient compression the decider may propose (header comment): "" none, or "fp16"
  /// (the one method whose bytes are known up front, half, and that only rounds: top-k and
  /// PowerSGD change what the optimizer sees and are never proposed automatically).
  std::string compression;
};

struct DataParallelDecision {
  enum class Kind { keep, rebalance, revert, compress };
  Kind kind = Kind::keep;
  std::vector<int> counts;      ///< target split: units per rank (rebalance, revert, compress).
  Compression compression;      ///< target compression (the one in force unless compress/revert).
  std::string reason;           ///< why: the evidence, or why nothing is done.
  int action = 0;               ///< the policy's action this decision answers.
  double current_step_ms = 0;   ///< measured (median of the recent interval); 0: unknown.
  double predicted_now_ms = 0;  ///< the model's step for the current counts.
  double predicted_new_ms = 0;  ///< ... for the target counts (rebalance).
};
const char* to_string(DataParallelDecision::Kind kind);

class DataParallelDecider {
 public:
  /// A data-parallel job's batch shares (SharesModel). Precondition (asserted): ranks >= 1,
  /// global_batch >= ranks, decision_steps >= 1, verify_steps >= 1, settle_steps >= 0,
  /// equal_band >= 0, noise_k >= 0, max_revert_bound >= revert_margin, late_fraction >= 0.
  explicit DataParallelDecider(DataParallelOptions options);
  /// The split `model` describes (its equal_band, noise_k and late_fraction are the model's
  /// own). Precondition (asserted): as above with global_batch >= 1, a model, and
  /// model->total() >= ranks.
  DataParallelDecider(DataParallelOptions options, std::unique_ptr<SplitModel> model);

  /// One closed step's wall time (Beliefs::last_step_ms), in step order.
  void observe_step(uint64_t step, double step_ms);
  /// Starts a decision: the observation of the job under `beliefs` and its candidates.
  /// `staging`: a switch is in flight.
  Observation observe(const monitor::Beliefs& beliefs, bool staging);
  /// Ends the decision observe() started: `action` 0 keeps, k switches to candidate k-1 (a
  /// masked action keeps). A verdict of the guardrail (a revert) stands whatever the action.
  /// Precondition: observe() was called since the last decide().
  DataParallelDecision decide(int action);
  /// A switch to the split `counts` with `compression` took effect at `switch_at_step`;
  /// `revert` when it undid the last one.
  void committed(const std::vector<int>& counts, uint64_t switch_at_step, bool revert,
                 const Compression& compression = {});
  /// A switch was aborted (the cool-down still applies, so aborts cannot repeat every interval).
  void aborted();

  const std::vector<int>& counts() const { return counts_; }
  const Compression& compression() const { return compression_; }
  /// The layout the split `counts` is, as the model describes it (SplitModel::layout).
  Strategy layout_of(const std::vector<int>& counts) const { return model_->layout(counts); }
  int cooldown_intervals() const { return cooldown_; }

 private:
  struct Offer {
    std::vector<int> counts;
    double predicted_ms = 0;
    const char* what = "";
    Compression compression;
  };
  // The link's figures the last observe() read (Beliefs::slow_link, dp_link_ms, dp_bytes).
  struct LinkFacts {
    bool slow = false;
    double wait_ms = 0, bytes = 0;
    double noise_ms = 0, reference = 0;  // Beliefs::dp_noise_ms, dp_reference (MB/s)
  };
  std::vector<double> steps_since(uint64_t first) const;
  // Why the policy gets no candidates this decision ("" when it does); may set forced_.
  std::string guard(double now_ms, double now_se, bool staging);
  void judge_last_switch(double now_ms, double now_se);
  // The offers of the fitted model and the evidence (every rank measured).
  void make_offers();
  // The compression candidates (header comment), their predictions and the other offers' in
  // one unit (compute plus exposed wait); false (nothing changed) when none applies.
  bool offer_compression(double now_pred);
  // The observation: speeds from the model; candidates when `offers`.
  Observation build(const monitor::Beliefs& b, bool offers);
  double revert_bound(double reference_ms, double reference_se, double now_se) const;
  void remember_best(double ms, double se);
  void track_best(double now_ms, double now_se);

  DataParallelOptions o_;
  std::unique_ptr<SplitModel> model_;
  std::vector<int> counts_;                        // the split in force
  Compression compression_;                        // ... and the compression in force
  Compression previous_compression_;               // before the last switch
  Compression method_;                             // the method to propose (none: never)
  LinkFacts link_;
  bool link_slow_at_switch_ = false;  // link_.slow when the switch being verified committed
  double uncompressed_bytes_ = 0;    // dp bytes before compression was switched on
  double uncompressed_compute_ = 0;  // the model's compute then, ms
  double method_cost_ms_ = 0;        // measured compute the method adds (0: not measured)
  double reference_bw_ = 0;          // the link's bandwidth while normal, at the switch (MB/s)
  double compressed_wait_ms_ = 0;    // the wait measured when the method's switch held
  double off_from_wait_ms_ = 0;      // the compressed wait when the way back was decided
  double method_wait_ms_ = 0;        // measured wait the method adds itself (0: not measured)
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
  std::vector<int> best_counts_;          // the fastest split measured since the job changed
  Compression best_compression_;
  double best_ms_ = 0, best_se_ = 0;
  double judged_ms_ = 0, judged_se_ = 0;  // the split in force, when last measured
  double previous_min_speed_ = 1;

  // The decision in progress (observe() to decide()).
  bool observed_ = false;
  DataParallelDecision pending_;  // keep with its reason, or the guardrail's forced verdict
  bool forced_ = false;           // pending_ stands whatever the action
  std::vector<Offer> offers_;     // the candidates, in the observation's order
  bool staging_ = false;          // a switch is in flight
  std::string evidence_;          // the model's evidence, for reasons
  std::vector<int> shed_;         // the ranks the best offer takes work from
  std::vector<int> condition_shed_;  // ...at the decisions the condition features counted
  ObservationHistory history_;
};

}  // namespace parapilot::env::dp
