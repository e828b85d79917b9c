// DataParallelJobSim: the hidden truth of one simulated data-parallel job and the per-step
// telemetry its ranks would send, for training and judging the policy that picks each rank's
// share of the global batch (env/dp/dp_env.h).
//
// The job. Rank r's step costs fixed_ms (its optimizer step) + per_sample_ms x samples, times
// its current slowdown; the gradient all-reduce follows the last arrival. Without `fixed_apart`
// a rank's optimizer step runs before its next forward pass, so the step lasts
//   max_r (fixed_r + per_sample_r x n_r) + all-reduce;
// with `fixed_apart` a second collective (DDP's buffer broadcast, a logging all-reduce) sits
// between the optimizer step and the next step, so it lasts
//   max_r per_sample_r x n_r + all-reduce + max_r fixed_r + the second collective.
// The all-reduce is a ring over the job's gradients: 2 (n-1)/n x gradient bytes / bus bandwidth,
// of which a drawn fraction is exposed (DDP overlaps buckets with the backward pass).
//
// What draw_episode() draws (uniform unless said; assumptions where no source is named):
// ranks 4-64 (or as given), global batch = ranks x 4..32, per-sample compute 0.3-5 ms (log-
// uniform), fixed part 1-15 ms, gradients 20 MB-1 GB and bus bandwidth 10-100 GB/s (log-uniform),
// exposed fraction 0.1-0.6, fixed_apart with probability 0.3 (second collective 0.2-2 ms): from
// compute-bound jobs, where shares matter, to all-reduce-bound ones, where they matter little.
//
// Dynamics (docs/scenarios.md, "The data-parallel job simulator"):
// * fail-slow events arrive as a Poisson process (one per 12 decisions on average; comm: 10,
//   flap: 20); kinds: one rank's compute slowed 1.3-4x (log-uniform), the all-reduce slowed 2-10x
//   (shares cannot help), a flapping rank (1.3-4x, slow and normal in turns of 1-4 decisions),
//   and, in the mixed family, ranks of a second GPU type permanently 1.3-2.5x slower.
// * Durations are log-normal with the published shape (Greyhound/FALCON, ATC'25: compute
//   fail-slows average ~10 min, communication ~24 min, from under a minute to ~10 h: a log-
//   normal with sigma 1.5 puts its 1st-99th percentiles across that range, so the medians are
//   mean / e^(sigma^2/2): 3.1 and 7.5 min). Episodes are minutes of simulated time, so one
//   decision interval stands for one published minute: medians 3.1 (compute, flap) and 7.5
//   (communication) decisions, sigma 1.5. Many events end within a decision or two, some last
//   most of the episode; every event ends on its own.
// * telemetry noise: compute_ms times a log-normal factor per rank and step (sigma drawn per
//   episode, 2-15%: an assumption; the repository holds no per-step recording of PyTorch ranks
//   to fit it to); hiccups (one rank's step 2-5x for one step: GC, a checkpoint write; 0.05-0.5%
//   of rank-steps); dropped samples (0-1% of rank-steps). Noise and hiccups are real time: the
//   step's wall time includes them.
// * the host and the telemetry (every family; rates drawn per episode, assumptions fitted to
//   what live runs on a shared machine show, docs/pytorch.md's example among them: a healthy
//   rank measured beyond the noise band for a decision, a 1.3x slow-rank event that recovers
//   within a dozen steps): interference, another process taking a rank's core, a real 1.5-3x
//   slowdown of one rank for 2 steps to a decision (0-0.15 per decision); and misreports,
//   a rank's reported compute per sample off by 0.4-0.75x or 1.35-2.5x for half a decision to
//   two decisions while its real speed and arrival are unchanged (a wait counted as compute,
//   a clock hiccup; 0-0.15 per decision). Both make the model offer a switch that does not pay:
//   deciding on noisy evidence is part of the problem.
// * a share switch takes effect at the next step boundary and pauses that step by the last
//   step's wall time plus 5 ms (the PyTorch client's switch costs about one step); nothing else.
//
// Random draws do not depend on the shares in force: the same seed gives the same noise, hiccups,
// drops and events whatever a policy does, so policies (and the oracle) are compared on one
// realisation. Deterministic: same job, events and seed, same steps bit for bit.
//
// Thread-safety: none; one episode is driven by one thread.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "env/dp/split_sim.h"
#include "env/monitor/monitor.h"

namespace parapilot::env::dp {

// The job's nominal figures (the truth before fail-slows).
struct DataParallelJob {
  int ranks = 0;             ///< >= 1
  int global_batch = 0;      ///< samples per step, >= ranks
  double per_sample_ms = 0;  ///< compute per sample on a nominal rank, > 0
  double fixed_ms = 0;       ///< optimizer step on a nominal rank, >= 0
  /// Per rank, >= 1: a permanent slowdown of all its compute (mixed GPU speeds); 1 nominal.
  std::vector<double> base_slowdown;
  double allreduce_ms = 0;         ///< exposed gradient all-reduce, >= 0
  bool fixed_apart = false;        ///< a second collective after the optimizer step
  double other_collective_ms = 0;  ///< ...and its time (fixed_apart only)
  double noise_sigma = 0;          ///< log-normal sigma of compute_ms per rank and step
  double hiccup_probability = 0;   ///< per rank and step
  double drop_probability = 0;     ///< per rank and step: the sample is not sent
  double interference_rate = 0;    ///< interference events per decision interval
  double misreport_rate = 0;       ///< misreport events per decision interval
};

// One fail-slow, in steps [start_step, end_step).
struct FailSlow {
  /// interference: a short real slowdown of one rank; misreport: its reported compute per
  /// sample scaled by `factor`, nothing real.
  enum class Kind { compute, comm, flap, interference, misreport };
  Kind kind = Kind::compute;
  int rank = -1;      ///< compute, flap
  /// > 1: compute time (compute, flap, interference) or all-reduce time (comm) multiplier;
  /// misreport: the reported per-sample compute's multiplier (> 0, != 1).
  double factor = 1;
  uint64_t start_step = 0;
  uint64_t end_step = 0;
  int flap_steps = 0;  ///< flap: slow for flap_steps, normal for flap_steps, in turns
};
const char* to_string(FailSlow::Kind kind);

// Scenario families (dp_env.h).
enum class Family { straggler, comm, flap, mixed };
const char* to_string(Family family);

// What draw() needs besides the seed.
struct DrawOptions {
  Family family = Family::straggler;
  int ranks = 0;            ///< 0: drawn in 4-64
  int decision_steps = 10;  ///< steps per decision interval (durations are in decisions)
  int horizon = 60;         ///< decision intervals per episode
};

// The drawn job and its events.
struct Episode {
  DataParallelJob job;
  std::vector<FailSlow> events;
};
// Draws an episode. Precondition (asserted): ranks 0 or >= 1, decision_steps and horizon >= 1.
Episode draw_episode(const DrawOptions& options, uint64_t seed);

/// The true per-rank slowdowns (base_slowdown included) and all-reduce slowdown of `episode`'s
/// job at step `s`: its events in force then (misreports are not real: none).
void truth_at(const Episode& episode, uint64_t s, std::vector<double>* rank_slowdown,
              double* comm_slowdown);

class DataParallelJobSim final : public SplitJobSim {
 public:
  /// Precondition (asserted): job.ranks >= 1, global_batch >= ranks, per_sample_ms > 0,
  /// base_slowdown one entry per rank, events name ranks of the job. `seed` drives the noise.
  /// Starts at step 0 on even shares.
  DataParallelJobSim(Episode episode, uint64_t seed);

  int ranks() const override { return episode_.job.ranks; }
  int global_batch() const override { return episode_.job.global_batch; }
  /// Step::best_ms: the same step on best_counts().
  Step& step() override;

  /// New shares (one >= 1 entry per rank, summing to the global batch; asserted).
  void set_counts(const std::vector<int>& counts) override;
  const std::vector<int>& counts() const override { return counts_; }

  /// The best shares under the true speeds of the next step (balanced_counts on them).
  const std::vector<int>& best_counts();
  /// The noiseless step time of the next step on the best shares.
  double best_step_ms();
  /// The noiseless step time of the next step on `counts`.
  double true_step_ms(const std::vector<int>& counts);

  uint64_t next_step() const override { return step_; }
  const DataParallelJob& job() const { return episode_.job; }
  const std::vector<FailSlow>& events() const override { return episode_.events; }
  void truth_at(uint64_t s, std::vector<double>* rank_slowdown,
                double* comm_slowdown) const override;
  std::vector<int> best_counts_at(uint64_t s) const override;
  double true_step_ms_at(uint64_t s, const std::vector<int>& counts) const override;
  /// A share change pauses its step by about one step: the step of `from` at `s`.
  double switch_pause_ms_at(uint64_t s, const std::vector<int>& from,
                            const std::vector<int>& to) const override;
  /// On even shares, base_slowdown only.
  double nominal_step_ms() const override;
  /// SharesModel, as deploy makes it for a data-parallel job.
  std::unique_ptr<SplitModel> decider_model(const DataParallelOptions& o) const override;

 private:
  void refresh_truth();
  // Arrival at the collectives: the gradient all-reduce waits for the slowest per-sample work
  // (with the fixed part, unless fixed_apart), the second collective for the slowest fixed part.
  struct Arrivals {
    double gradient = 0, fixed = 0;
  };
  Arrivals arrivals(const std::vector<int>& counts, const std::vector<double>& factor) const;
  // The step time on `counts` where rank r's compute is scaled by factor[r] (slowdown, noise)
  // and the all-reduce by `comm`.
  double wall_of(const std::vector<int>& counts, const std::vector<double>& factor,
                 double comm) const;

  Episode episode_;
  std::mt19937_64 rng_;
  std::vector<int> counts_;
  bool switched_ = false;  // counts changed since the last step
  uint64_t step_ = 0;
  double last_wall_ms_ = 0;
  uint64_t clock_ns_ = 0;
  // Truth of the next step, cached.
  uint64_t truth_step_ = ~uint64_t{0};
  std::vector<double> slowdown_;
  double comm_ = 1;
  std::vector<double> true_per_sample_, true_fixed_;
  std::vector<int> best_counts_;
  bool best_valid_ = false;
  std::vector<double> factor_;  // per rank this step: slowdown x noise x hiccup
  std::vector<char> dropped_;   // per rank this step: the sample is not sent
  std::vector<double> report_;  // per rank this step: misreport multiplier of its per-sample compute
  Step out_;
};

}  // namespace parapilot::env::dp
