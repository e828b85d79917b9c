// The training loop (libtorch): one step's forward/backward passes, gradient reduction, global
// loss and update, and what the step records (worker_run.h).
#include <algorithm>
#include <thread>

#include "env/live/corpus.h"
#include "env/live/worker_run.h"

namespace parapilot::live {

namespace {

// Whether a fault's window holds: [at_step, at_step + for_steps) in training steps when at_step
// >= 0 (for_steps -1: no end), else [at_s, at_s + for_s) in seconds since the worker started.
bool fault_window(std::int64_t at_step, std::int64_t for_steps, double at_s, double for_s,
                  std::uint64_t step, double now_s) {
  if (at_step >= 0) {
    const auto s = static_cast<std::int64_t>(step);
    return s >= at_step && (for_steps < 0 || s < at_step + for_steps);
  }
  return now_s >= at_s && now_s < at_s + for_s;
}

// Per-layer gradient statistics (local, before the reduction; full-model indices) when
// `publish`, and the gradients' handles.
std::vector<at::Tensor> gradients(WorkerRun& run, bool publish,
                                  std::vector<transport::LayerGradStat>& layer_stats) {
  std::vector<at::Tensor> grads;
  for (std::size_t i = 0; i < run.params.size(); ++i) {
    grads.push_back(run.params[i].mutable_grad());
    if (publish) {
      const at::Tensor g = grads.back();
      const at::Tensor finite = g.isfinite();
      const auto nonfinite =
          static_cast<std::uint32_t>(g.numel() - finite.sum().item<std::int64_t>());
      const at::Tensor gf = nonfinite ? g.where(finite, at::zeros_like(g)) : g;
      layer_stats.push_back({static_cast<std::uint32_t>(run.model->shards()[i].layer),
                             gf.norm().item<float>(), gf.abs().max().item<float>(), nonfinite});
    }
  }
  return grads;
}

// Steps 2 to 5 of step run.step after its boundary (which took control_ms). False when
// training ends.
bool train_step(WorkerRun& run, double now_s, double control_ms) {
  const WorkerOptions& o = run.o;
  const std::uint64_t step = run.step;
  const int microbatch = run.microbatch;
  const RankCoords& me = run.me;
  StageModel* model = run.model;
  LayoutState& state = *run.state;

  // 2. Forward/backward over this replica's microbatches, through this rank's stage.
  const std::uint64_t step_start_ns = wall_ns();
  const double step_start_s = seconds_since(run.t_start);
  const int total_mb = o.global_batch / microbatch;
  const std::vector<int> counts = microbatch_counts(run.shares, total_mb);
  int first = 0;
  for (int r = 0; r < me.dp; ++r) first += counts[static_cast<std::size_t>(r)];
  const int mine = counts[static_cast<std::size_t>(me.dp)];
  const bool slowed = o.slow_factor > 1 && fault_window(o.slow_at_step, o.slow_for_steps,
                                                        o.slow_at_s, o.slow_for_s, step, now_s);
  run.opt->zero_grad();
  for (const auto& p : run.params) {
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
  }
  const at::Tensor& corpus_t = run.corpus_t;
  auto make_batch = [&](int i) {
    const int j = first + i;
    std::vector<at::Tensor> rows;
    for (int k = 0; k < microbatch; ++k) {
      const std::uint64_t g = static_cast<std::uint64_t>(j * microbatch + k);
      rows.push_back(corpus_t.narrow(
          0, sequence_start(o.seed, step, g, corpus_t.size(0), run.seq_bytes), run.seq_bytes));
    }
    return at::stack(rows);
  };
  PipelineStepOptions po;
  po.microbatches = mine;
  po.sequences = microbatch;
  po.loss_divisor = static_cast<double>(total_mb);
  po.slow_factor = slowed ? o.slow_factor : 1;
  TensorParallelGroup* tp = state.tp();
  const double tp_ms_before = tp ? tp->all_reduce_ms : 0;
  const std::uint64_t tp_bytes_before = tp ? tp->all_reduce_bytes : 0;
  const std::uint32_t tp_calls_before = tp ? tp->all_reduce_calls : 0;
  const StatusOr<PipelineStepStats> passes =
      run_pipeline_step(*model, state.pipeline(), tp, po, make_batch);
  if (!run.collective_ok(passes.status())) return false;
  const double compute_ms = passes->compute_ms;
  const double tp_ms = tp ? tp->all_reduce_ms - tp_ms_before : 0;
  const double local_loss = run.reports_loss ? passes->loss : 0;

  // 3. Per-layer gradient statistics (local, before the reduction; full-model indices).
  std::vector<transport::LayerGradStat> layer_stats;
  const bool publish = run.bus && step % static_cast<std::uint64_t>(o.telemetry_every) == 0;
  std::vector<at::Tensor> grads = gradients(run, publish, layer_stats);

  // 4. Gradient reduction over the DP group.
  const bool delayed =
      o.link_delay_ms > 0 && fault_window(o.link_delay_at_step, o.link_delay_for_steps,
                                          o.link_delay_at_s, o.link_delay_for_s, step, now_s);
  auto before_call = [&] {
    if (delayed)
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(o.link_delay_ms));
  };
  const StatusOr<SyncStats> synced = run.gsync->sync(grads, state.dp(), before_call);
  if (!run.collective_ok(synced.status())) return false;
  const SyncStats& sync = *synced;
  if (!run.collective_ok(run.stager->after_reduction(state, step).status())) return false;
  // 5. Global loss (for the log) and the update.
  at::Tensor loss_t = at::full({1}, local_loss, at::kDouble);
  std::vector<at::Tensor> lt{loss_t};
  const auto tl = WorkerClock::now();
  if (!run.collective_ok(run.coll->all_reduce_sum(lt))) return false;
  const double loss_ms = seconds_since(tl) * 1000;
  run.last_loss = loss_t.item<double>();
  run.stager->release(step);  // every rank has sent this step's streamed gradients
  run.opt->step();

  const std::uint64_t step_end_ns = wall_ns();
  const double step_end_s = seconds_since(run.t_start);
  run.step_end_times.push_back(step_end_s);
  if (run.first_step_end_ns == 0) run.first_step_end_ns = step_end_ns;
  run.last_step_end_ns = step_end_ns;
  const double step_tokens = static_cast<double>(o.global_batch) * o.model.seq_len;
  run.tokens += step_tokens;
  const std::uint64_t dp_bytes = sync.all_reduce_bytes + sync.all_gather_bytes;
  run.total_dp_bytes += dp_bytes;
  if (run.loss_log.is_open())
    run.loss_log << step << ',' << run.last_loss << ',' << run.tokens << ','
                 << run.total_dp_bytes << ',' << (step_end_s - step_start_s) << '\n';

  trace::TelemetrySample row;
  row.rank = o.rank;
  row.dp_rank = me.dp;
  row.stage = me.stage;
  row.step = static_cast<std::int64_t>(step);
  row.start_s = step_start_s;
  row.end_s = step_end_s;
  row.microbatches = mine;
  row.compute_ms = compute_ms;
  row.dp_comm = {sync.all_reduce_ms + sync.all_gather_ms, static_cast<double>(dp_bytes)};
  row.pp_comm = {passes->p2p_ms, static_cast<double>(passes->p2p_bytes)};
  if (tp) row.tp_comm = {tp_ms, static_cast<double>(tp->all_reduce_bytes - tp_bytes_before)};
  if (!o.record.empty()) run.recorded.push_back(row);

  if (publish) {
    StepTelemetry{.o = o,
                  .step = step,
                  .step_start_ns = step_start_ns,
                  .step_end_ns = step_end_ns,
                  .sync = sync,
                  .loss_ms = loss_ms,
                  .passes = passes,
                  .compute_ms = compute_ms,
                  .tp_ms = tp_ms,
                  .tp = tp,
                  .tp_bytes_before = tp_bytes_before,
                  .tp_calls_before = tp_calls_before,
                  .state = run.state,
                  .control_ms = control_ms,
                  .mine = mine,
                  .total_mb = total_mb,
                  .last_loss = run.last_loss,
                  .plan_id = run.plan_id,
                  .switched_this_step = run.switched_this_step,
                  .switches = run.switches,
                  .layout = run.layout,
                  .me = me,
                  .microbatch = microbatch,
                  .layer_stats = layer_stats,
                  .bus = run.bus}
        .send();
  }
  return true;
}

}  // namespace

void train(WorkerRun& run) {
  run.step = run.first_step;
  bool started = run.collective_ok(run.state->broadcast_parameters());
  run.train_start_s = seconds_since(run.t_start);
  while (started) {
    run.training_step.store(run.step);
    const double now_s = seconds_since(run.t_start);
    // 1. Boundary: stop, or apply the agreed plan (worker_switch.cc).
    const std::optional<double> control_ms = cross_boundary(run, now_s);
    if (!control_ms) break;
    if (!train_step(run, now_s, *control_ms)) break;
    run.switched_this_step = false;
    ++run.step;
  }
  if (run.releaser.joinable()) run.releaser.join();
}

}  // namespace parapilot::live
