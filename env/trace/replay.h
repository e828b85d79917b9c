// Dependency-graph replay of a recorded per-op trace (the what-if method of the OSDI'25
// straggler study, written for this project).
//
// ReplayGraph::build() reconstructs, for every step, the dependencies between ops: each worker
// runs its forward/backward computes in recorded order; a pipeline receive gates the compute
// that consumes it and a send follows the compute that produced it; sends and receives of
// adjacent stages pair up; collectives synchronise their group (parameter all-gather and
// gradient reduce-scatter: all workers of a stage; embedding all-reduce: first and last stage
// of a replica; gradient-norm clip: everybody); after the last compute each worker runs gc,
// layernorm all-reduce, embedding all-reduce, gradient reduce-scatter, clip and optimizer in
// that order. replay() then recomputes every op's start and end from a duration per op: a
// local op starts when its dependencies end; all members of a collective start together when
// the last of them is ready, and each ends after its own transfer time. The measured transfer
// time of a collective member is its recorded end minus the latest recorded start in its group
// (the part of its duration that is not waiting for peers).
//
// A built graph is immutable; replay() is const and may run concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/status.h"
#include "env/trace/op_trace.h"

namespace parapilot::trace {

class ReplayGraph {
 public:
  // kInvalidArgument naming the step when its ops cannot be ordered (a dependency cycle, which
  // a complete trace of a supported schedule never produces).
  static StatusOr<ReplayGraph> build(const OpTrace& trace);

  int num_nodes() const { return static_cast<int>(record_.size()); }
  int num_steps() const { return static_cast<int>(steps_.size()); }
  const std::vector<std::int64_t>& steps() const { return steps_; }

  // Per node: the trace record it stands for, its step index, whether it is a collective
  // member (its duration is a transfer time), and the measured duration or transfer time.
  int record(int node) const { return record_[node]; }
  int step_index(int node) const { return step_index_[node]; }
  bool is_collective_member(int node) const { return group_size_[node] > 0; }
  const std::vector<double>& measured() const { return measured_; }

  // Per step: end of the last op minus start of the first, as recorded.
  const std::vector<double>& recorded_step_s() const { return recorded_step_s_; }

  // Per step: the replayed step time (latest end; every step starts at 0) with the given
  // per-node durations (size num_nodes()).
  std::vector<double> replay(const std::vector<double>& duration_s) const;
  // The same, also returning every node's start and end relative to its step's start.
  std::vector<double> replay(const std::vector<double>& duration_s, std::vector<double>& start_s,
                             std::vector<double>& end_s) const;

 private:
  struct Builder;  // build_or_throw's phases (replay.cc)
  static ReplayGraph build_or_throw(const OpTrace& trace);
  std::vector<int> record_;
  std::vector<int> step_index_;
  std::vector<int> group_size_;  // 0: local op; otherwise size of its collective group
  std::vector<double> measured_;
  std::vector<int> dep_offset_, deps_;           // CSR: node -> nodes it waits for
  std::vector<int> order_offset_, order_nodes_;  // super nodes in topological order
  std::vector<std::int64_t> steps_;
  std::vector<double> recorded_step_s_;
};

// A synthetic 1F1B job for tests and for turning coarse telemetry into op traces: every
// duration comes from the callbacks, the timestamps from replaying the schedule.
struct SyntheticJob {
  JobMeta meta;  // dp_size and pp_size are used; ranks are stage * dp_size + dp_rank
  int microbatches = 4;
  int steps = 4;
  std::int64_t first_step = 0;
  double step_gap_s = 0.05;  // idle time between steps
  // Seconds per op; arguments are (step index from 0, dp_rank, stage, microbatch).
  std::function<double(int, int, int, int)> forward_s;
  std::function<double(int, int, int, int)> backward_s;
  double p2p_s = 0.002;
  double params_all_gather_s = 0.02;
  double grads_reduce_scatter_s = 0.04;
  double embedding_all_reduce_s = 0.01;
  double clip_s = 0.005;
  double optimizer_s = 0.03;
};

OpTrace synthesize_op_trace(const SyntheticJob& job);

}  // namespace parapilot::trace
