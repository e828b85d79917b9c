// Monitor: turns per-rank, per-step bus telemetry into the beliefs the planner and the policy
// consume — per-rank compute speed, per-node network bandwidth, queue occupancy, gradient
// statistics, lost ranks — and detects slow ranks and congested links, with evidence.
//
// The synchronous all-reduce trap: inside a collective the fast ranks wait for the slow one, so
// every rank's step (or backward) time looks the same. The monitor therefore only trusts
// compute-only time (Telemetry::compute_ms: everything a rank did in the step except waiting in
// collectives) for speed, measures arrival skew at the collective (arrival = step_start +
// compute), and subtracts each rank's wait for the last arrival from its collective time before
// turning it into bandwidth. A rank that measures its own wait in the gradient collectives
// (the "wait/dp" telemetry entry) is believed over the estimate: the rank that waits least is the
// straggler, wherever in its step the slowdown sits. All per-rank series go through RobustEwma
// (median/MAD outlier rejection; a level shift needs several samples in a row).
//
// Slow link (the gradient all-reduce's own network, not a GPU): per closed step, L = the least
// wait/dp over the ranks (the last rank to arrive waits for nobody: its wait is the transfer
// the ranks' compute does not explain) and B = the median over ranks of the bytes the gradient
// collectives reduced (all_reduce/dp + all_gather/dp, the client's count). Both go through
// RobustEwma; the effective all-reduce bandwidth is B / L of their levels. The reference is that
// bandwidth while the link is believed normal (frozen while it is slow). The link is slow when
// (a) the bandwidth is below congested_bw x the reference and (b) the wait exceeds what the
// bytes at the reference bandwidth explain, B / reference, by more than reject-level noise:
// dead_band_deviations robust deviations of L as measured while normal (at least dead_band x
// L). A slow rank raises the other ranks' waits, never its own, so L (and a slow_link) stays
// unaffected by it; compute is judged separately (slow_rank). Restored when the bandwidth is
// back above recovered_bw x the reference. Steps where a rank does not report wait/dp or its
// gradient bytes are not used.
//
// Rank r is assumed to run on GPU r of the job's ClusterSpec (node r / gpus_per_node); speed is
// relative to the median of the rank's peer group (by default all ranks of its GPU type), so a
// belief of 1 means "as fast as its peers".
//
// Thread-safety: every member function may be called from any thread (one internal mutex). The
// step callback runs on the thread whose sample completed the step, outside the lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/status.h"
#include "strategy/cluster.h"
#include "strategy/cost_model.h"
#include "strategy/strategy.h"
#include "transport/messages.h"

namespace parapilot::monitor {

using Clock = std::chrono::steady_clock;

struct MonitorOptions {
  int ranks = 0;                  ///< world size (required, >= 1).
  int gpus_per_node = 8;          ///< rank r sits on node r / gpus_per_node.
  std::vector<int> peer_group;    ///< per rank: speed reference group (empty: one group).
  double slow_speed = 1 / 1.1;    ///< believed speed below this (a >= 10% shift) = slow rank.
  double recovered_speed = 0.95;  ///< ...and above this again = recovered.
  int confirm_steps = 1;          ///< closed steps in a row past a threshold before an event.
  double congested_bw = 0.8;      ///< node bandwidth factor below this = congested link.
  double recovered_bw = 0.9;
  double max_compute_ms = 3.6e6;     ///< telemetry above this (an hour per step) is absurd.
  uint64_t max_step_jump = 1000000;  ///< steps this far beyond the newest seen are absurd.
  int close_lag_steps = 8;           ///< a step closes when a rank reports this many steps later.
  int min_samples = 3;
  /// Believed speeds and bandwidth factors within this relative distance of 1 are reported as 1:
  /// noise-level differences would otherwise reorder the planner's device mapping every re-plan.
  double dead_band = 0.05;
  /// ...and speeds within this many robust deviations of the peer group's speeds around 1 (the
  /// measurement noise the group shows: 1.4826 x the lower median of |speed - 1| over its
  /// ranks), so that on a wide job noise does not make some healthy ranks look slow or fast.
  /// 4, the deviations RobustEwma rejects an outlier at. 0: the fixed band only. The band never
  /// reaches 1 - slow_speed: a rank slow enough to be reported slow is always believed so.
  double dead_band_deviations = 4.0;
  /// Weight of a new compute sample in a rank's level (RobustEwma::Options::alpha).
  double compute_alpha = 0.3;
  /// Whether beliefs carry each rank's rank_compute_se_ms (a median of its recent samples per
  /// rank and refresh; the data-parallel decider reads it). Off: the field stays 0.
  bool compute_standard_errors = false;
};

/// Something the monitor noticed, with the numbers that made it say so.
struct MonitorEvent {
  enum class Kind {
    slow_rank,
    rank_recovered,
    congested_link,
    link_recovered,
    rank_lost,
    slow_link,     ///< the gradient all-reduce's link (every rank's), see the header comment
    link_restored  ///< ...back to its reference bandwidth
  };
  Kind kind = Kind::slow_rank;
  int rank = -1;     ///< slow_rank, rank_recovered, rank_lost
  int node = -1;     ///< congested_link, link_recovered
  double value = 0;  ///< believed speed or bandwidth factor (slow_link: of the reference)
  uint64_t step = 0;
  Clock::time_point time;
  std::string evidence;
};
const char* to_string(MonitorEvent::Kind kind);

/// What a pipeline stage reports of itself (docs/deploy.md, "Learned pipeline jobs"): the
/// contiguous blocks [first_block, first_block + blocks) of the job's block list, the
/// micro-batches of a step, each block's compute in the step (forward and backward over all
/// micro-batches, ms; block_ms[i] is block first_block + i; empty when the stage does not report
/// every block it holds) and the time and bytes of its pipeline sends and receives ("p2p/pp").
struct StageFacts {
  int first_block = -1;  ///< -1: the rank is no pipeline stage (or does not say).
  int blocks = 0;
  int microbatches = 0;  ///< 0: not reported.
  std::vector<double> block_ms;
  double p2p_ms = 0, p2p_bytes = 0;

  bool operator==(const StageFacts&) const = default;
};

/// The monitor's current view (a snapshot; copying it is cheap enough once per step).
struct Beliefs {
  Conditions conditions;  ///< gpu_speed per rank, node_inter_bw per node, gpu_failed = lost.
  /// Robust level of compute-only time per step, or, when ranks report their samples (the
  /// "info/samples" telemetry entry), per sample of the part that scales with samples: compute
  /// minus the optimizer step ("phase/optimizer"). 0: unknown.
  std::vector<double> rank_compute_ms;
  /// Standard error of rank_compute_ms (same units), from the spread of the rank's recent
  /// samples (RobustEwma::standard_error): how far apart two ranks' levels may be from noise
  /// alone. 0: unknown, or not asked for (MonitorOptions::compute_standard_errors).
  std::vector<double> rank_compute_se_ms;
  /// Robust level of the per-step part that does not scale with samples ("phase/optimizer");
  /// 0 when not reported.
  std::vector<double> rank_fixed_ms;
  std::vector<double> rank_steps_per_s;  ///< from the rank's own step wall time.
  std::vector<double> rank_lateness_ms;  ///< arrival at the collective minus the median arrival.
  /// Smoothed time the rank reports it was blocked in its step's collectives (wait/dp plus
  /// wait/other: the gradient reduction, a framework's buffer broadcast, the script's own
  /// collectives); -1 where the rank does not measure its waits. At each collective the rank
  /// that arrives last waits least, so the least wait names the slowest rank by arrival order.
  std::vector<double> rank_wait_ms;
  /// Whether most steps have a synchronising collective besides the gradient reduction on
  /// every rank (wait/other with calls >= 1 in more than half of a rank's recent steps, for the
  /// median rank): DDP's buffer broadcast, a logging all-reduce. Such a collective separates a
  /// rank's per-step fixed part (its optimizer step, after the gradient reduction) from its
  /// per-sample work (forward, backward): the step then lasts max over ranks of the per-sample
  /// work plus max over ranks of the fixed part, not the max of their sums.
  bool fixed_apart = false;
  std::vector<double> rank_queue_depth;
  std::vector<double> layer_grad_norm;  ///< per layer: median over ranks, latest step.
  std::vector<double> rank_samples;     ///< samples in the rank's last step; 0: not reported.
  bool compute_per_sample = false;      ///< rank_compute_ms is per sample.
  /// Per rank, its pipeline stage's facts from its latest closed step, block_ms and p2p smoothed
  /// (a moving average, restarted when the stage's blocks change); empty until a rank reports
  /// a stage (a job that is no pipeline never fills it).
  std::vector<StageFacts> rank_stage;
  double last_step_ms = 0;              ///< the last closed step's wall time (median over ranks).
  uint64_t nonfinite_gradients = 0;     ///< summed over all accepted telemetry.
  double missing_fraction = 0;          ///< of the last closed step's expected samples.
  uint64_t last_closed_step = 0;
  bool any_closed = false;
  int live_ranks = 0;
  std::vector<int> slow_ranks;
  std::vector<int> congested_nodes;
  /// The gradient all-reduce's link (header comment, "Slow link"); every figure 0 until
  /// min_samples steps reported wait/dp and gradient bytes on every rank.
  double dp_bytes = 0;         ///< level of the bytes a rank's gradient collectives reduce a step
  double dp_link_ms = 0;       ///< level of the least wait/dp of a step (the last arrival's)
  double dp_bandwidth = 0;     ///< dp_bytes / dp_link_ms, MB/s: the effective bandwidth
  double dp_reference = 0;     ///< the bandwidth while the link was believed normal, MB/s
  double dp_explained_ms = 0;  ///< dp_bytes / dp_reference: the wait the bytes explain
  double dp_noise_ms = 0;      ///< the noise bound on dp_link_ms (rule (b))
  bool slow_link = false;      ///< rules (a) and (b) held (a slow_link event said so)
};

/// One rank's training step as the monitor reads it: the fields of a bus Telemetry message it
/// uses, by meaning. Producers that are not on the bus (the simulator) hand these in directly;
/// bus telemetry is read into one by to_sample(), so both go through the same estimator.
struct StepSample {
  int rank = 0;
  uint64_t step = 0;
  uint64_t start_ns = 0;  ///< the rank's clock, ns.
  uint64_t end_ns = 0;    ///< >= start_ns.
  double compute_ms = 0;  ///< compute-only time: the step minus waiting in collectives.
  double samples = -1;    ///< samples the rank processed ("info/samples"); -1: not reported.
  double fixed_ms = -1;   ///< per-step part not scaling with samples ("phase/optimizer"); -1: none.
  double wait_ms = -1;    ///< measured wait in the gradient collectives ("wait/dp"); -1: none.
  /// measured wait in the step's other collectives, outside wait_ms ("wait/other"); -1: none.
  double other_wait_ms = -1;
  int other_calls = -1;  ///< ...and the number of those collectives ("wait/other" calls).
  double inter_bytes = 0;  ///< bytes sent in collectives crossing nodes (keys containing "inter").
  double inter_ms = 0;     ///< ...and the time spent in them, waiting included.
  /// bytes the gradient collectives reduced (all_reduce/dp + all_gather/dp); -1: not reported.
  double dp_bytes = -1;
  double longest_collective_ms = 0;  ///< the longest single collective (validation).
  double queue_depth = 0;
  std::vector<transport::LayerGradStat> layers;  ///< per-layer gradient statistics.
  StageFacts stage;  ///< a pipeline stage's facts ("info/first_block", ...); first_block -1: none.
};

/// The sample a bus Telemetry message carries (collective keys as documented in wire-format.md).
StepSample to_sample(const transport::Telemetry& t);
/// The bus message for a sample (the inverse of to_sample on the fields it reads).
transport::Telemetry to_telemetry(const StepSample& x);

struct MonitorCounters {
  uint64_t accepted = 0;
  uint64_t rejected = 0;
  std::map<std::string, uint64_t> rejected_by_reason;  ///< e.g. "nan", "negative", "absurd".
  uint64_t late = 0;  ///< accepted after their step closed (used for the rank's own levels).
  uint64_t steps_closed = 0;
  uint64_t outliers = 0;  ///< samples the robust estimators did not average in.
  uint64_t slow_rank_events = 0;
  uint64_t congestion_events = 0;
};

/// Options for a job on `topology` (rank r on GPU r): its world size, node size and, as peer
/// groups, the GPU types; the rest from `base`.
MonitorOptions options_for(const ClusterTopology& topology, MonitorOptions base = {});

/// Speed reference groups for `layout` on `topology`: ranks of one GPU type at one pipeline
/// stage are peers (stages own different layers, so their compute differs at equal speed).
/// GPUs the layout does not use form a group of their own per type.
std::vector<int> peer_groups(const ClusterTopology& topology, const Strategy& layout);

class Monitor {
 public:
  /// Precondition (asserted): ranks and gpus_per_node >= 1, compute_alpha in (0, 1], and
  /// peer_group empty or one entry per rank.
  explicit Monitor(MonitorOptions options);
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  /// Takes one sample. OK when accepted; otherwise kRejected with the reason as the message
  /// ("nan", "infinite", "negative", "absurd", "absurd_step", "unknown_rank", "duplicate", the
  /// keys of MonitorCounters::rejected_by_reason); rejected samples are counted, never used. A
  /// sample whose step already closed is accepted for its rank's own levels (counted as late).
  Status ingest(const transport::Telemetry& t, Clock::time_point arrival = Clock::now());
  /// The same for a sample already read (ingest(t) is ingest(to_sample(t))).
  Status ingest(const StepSample& x, Clock::time_point arrival = Clock::now());
  /// The same for many samples arriving together, in order, under one lock: the monitor ends
  /// as after ingest(x, arrival) for each in turn, except that the step callback runs for
  /// the steps they closed once all are taken. Moves from `samples` and leaves it empty;
  /// returns how many were accepted.
  size_t ingest(std::vector<StepSample>&& samples, Clock::time_point arrival = Clock::now());

  /// Liveness from the bus: a rank that connected (live) or went away (lost: believed failed).
  /// Ranks never seen are neither; a step closes when every live rank reported it.
  void rank_connected(int rank);
  void rank_lost(int rank);

  /// The layout changed: compute times of every rank change, so per-rank levels restart. A
  /// non-empty `peer_group` (one entry per rank) replaces the speed reference groups, e.g.
  /// peer_groups() of the new layout.
  void layout_changed(std::vector<int> peer_group = {});

  /// Called once per closed step with the arrival time of the sample that closed it (the step's
  /// last sample, or a later step's when the step closed with samples missing).
  using StepCallback = std::function<void(uint64_t step, Clock::time_point last_arrival)>;
  void set_step_callback(StepCallback callback);

  Beliefs beliefs() const;
  MonitorCounters counters() const;
  /// Events since the last call, oldest first.
  std::vector<MonitorEvent> take_events();
  /// The largest step any rank has reported.
  uint64_t newest_step() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
  mutable std::mutex mutex_;
  StepCallback callback_;
};

}  // namespace parapilot::monitor
