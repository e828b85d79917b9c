// One step's telemetry for the agent (transport::Telemetry; worker_run.h): its collectives'
// times, bytes and calls, and the step's figures the agent's monitor and reward read, under the
// keys of transport/telemetry_keys.h.
#include <algorithm>

#include "env/live/worker_run.h"
#include "transport/telemetry_keys.h"

namespace parapilot::live {

void StepTelemetry::send() {
  namespace keys = transport::telemetry_keys;
  transport::Telemetry t;
  t.rank = static_cast<std::uint32_t>(o.rank);
  t.step = step;
  t.step_start_ns = step_start_ns;
  t.step_end_ns = step_end_ns;
  // Everything this rank did in the step except waiting in its collectives and for its
  // pipeline neighbours: a slowdown anywhere in the step (batch building, the optimizer)
  // counts, a wait for a peer not.
  const double wall_ms = static_cast<double>(step_end_ns - step_start_ns) / 1e6;
  const double wait_ms = sync.all_reduce_ms + sync.all_gather_ms + loss_ms + passes->p2p_ms + tp_ms;
  t.compute_ms = std::clamp(wall_ms - wait_ms, compute_ms, std::max(compute_ms, wall_ms));
  t.queue_depth = sync.buckets;
  t.collectives[keys::kWaitDp] = {sync.all_reduce_ms + sync.all_gather_ms, 0, 1};
  t.collectives[keys::kAllReduceDp] = {sync.all_reduce_ms, sync.all_reduce_bytes,
                                       sync.all_reduce_calls};
  if (sync.all_gather_calls)
    t.collectives[keys::kAllGatherDp] = {sync.all_gather_ms, sync.all_gather_bytes,
                                         sync.all_gather_calls};
  if (state->pipeline())
    t.collectives[keys::kP2pPp] = {passes->p2p_ms, passes->p2p_bytes, passes->p2p_calls};
  if (tp)
    t.collectives[keys::kAllReduceTp] = {tp_ms, tp->all_reduce_bytes - tp_bytes_before,
                                         tp->all_reduce_calls - tp_calls_before};
  t.collectives[keys::kAllReduceControl] = {control_ms + loss_ms, 0, 2};
  // Microbatches processed and the global loss, for the agent's throughput and reward.
  keys::set_info(t, keys::kMicrobatches, static_cast<std::uint64_t>(mine));
  keys::set_info(t, keys::kMicrobatchesTotal, static_cast<std::uint64_t>(total_mb));
  keys::set_loss(t, last_loss);
  keys::set_info(t, keys::kPlan, plan_id);
  // The step that switched layouts: its pause and the bytes this rank sent for it.
  if (switched_this_step)
    t.collectives[keys::kSwitchLayout] = {switches.back().pause_ms, switches.back().bytes_sent, 1};
  // Where the rank sits in a hybrid layout.
  if (!layout.pure_data_parallel())
    keys::set_replica_and_stage(t, static_cast<std::uint64_t>(me.dp),
                                static_cast<std::uint64_t>(me.stage));
  // Samples this rank processed: the monitor compares ranks' compute per sample, so a rank
  // given a smaller share does not look faster than it is.
  keys::set_info(t, keys::kSamples, static_cast<std::uint64_t>(mine) * microbatch);
  t.layers = std::move(layer_stats);
  t.send_time_ns = wall_ns();
  bus->send(t);
}

}  // namespace parapilot::live
