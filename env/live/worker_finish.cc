// The worker's end (libtorch): the gathered dump, the checkpoint and the run summary after
// training, then the failure report, the recording and the bus's goodbye (worker_run.h).
#include <cstdio>
#include <fstream>

#include "core/error.h"
#include "env/live/checkpoint_state.h"
#include "env/live/run_summary.h"
#include "env/live/link_cut.h"
#include "env/live/worker_run.h"

namespace parapilot::live {

namespace {

std::string expand_rank(std::string path, int rank) {
  const std::size_t at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(rank));
  return path;
}

// The whole model, gathered from stages and TP shards (every rank takes part).
void dump_params(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  if (run.layout.tp > 1) {
    const StatusOr<double> spread = run.state->tp_replica_spread();
    if (run.collective_ok(spread.status())) {
      at::Tensor worst = at::full({1}, *spread, at::kDouble);
      if (run.collective_ok(run.coll->all_reduce_max(worst)) && o.rank == 0)
        std::printf("%s: tensor-parallel replicas differ by at most %.3g\n", run.tag.c_str(),
                    worst.item<double>());
    }
  }
  const StatusOr<std::vector<at::Tensor>> full =
      run.exit_code == kWorkerOk ? run.state->gather_full_model(*run.coll)
                                 : StatusOr<std::vector<at::Tensor>>(Status::internal(run.failure));
  if (run.exit_code == kWorkerOk && run.collective_ok(full.status()) && o.rank == 0) {
    std::ofstream out(o.dump_params, std::ios::binary);
    for (const auto& p : *full) {
      const at::Tensor c = p.contiguous();
      out.write(static_cast<const char*>(c.data_ptr()),
                static_cast<std::streamsize>(c.numel() * 4));
    }
    if (!out) throw std::runtime_error("--dump-params '" + o.dump_params + "': cannot write");
  }
}

// The checkpoint: the whole model and optimizer state, gathered (every rank takes part).
void save_state(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  const StatusOr<TrainingState> saved =
      gather_checkpoint(*run.state, *run.coll, o.model, o.optimizer, run.step);
  if (run.collective_ok(saved.status()) && o.rank == 0) {
    check(write_checkpoint(o.save_state, *saved));
    std::printf("%s: saved the state after step %llu to %s\n", run.tag.c_str(),
                static_cast<unsigned long long>(run.step), checkpoint_path(o.save_state).c_str());
  }
}

// Rank 0's summary of the run, with the switches' figures reduced over the ranks (`worst`:
// pauses then staging times, `bytes`: bytes moved).
RunSummary run_summary(WorkerRun& run, const at::Tensor& worst, const at::Tensor& bytes) {
  const auto n = static_cast<std::int64_t>(run.switches.size());
  RunSummary sum;
  sum.first_step = run.first_step;
  sum.steps = run.step - run.first_step;
  sum.samples = sum.steps * static_cast<std::uint64_t>(run.o.global_batch);
  sum.train_s = run.step_end_times.empty() ? 0 : run.step_end_times.back() - run.train_start_s;
  sum.layout = layout_text(run.layout);
  sum.started_unix_s = static_cast<double>(run.started_ns) / 1e9;
  sum.first_step_end_unix_s = static_cast<double>(run.first_step_end_ns) / 1e9;
  sum.last_step_end_unix_s = static_cast<double>(run.last_step_end_ns) / 1e9;
  double previous = run.train_start_s;
  for (double end : run.step_end_times) {
    sum.step_ms.push_back((end - previous) * 1000);
    sum.step_end_s.push_back(end);
    previous = end;
  }
  std::lock_guard lock(run.staging_steps.mu);
  for (std::int64_t i = 0; i < n; ++i) {
    const SwitchRecord& r = run.switches[static_cast<std::size_t>(i)];
    SwitchSummary w;
    w.plan_id = r.plan_id;
    w.layout = r.layout;
    w.at_step = r.at_step;
    w.pause_ms = worst[i].item<double>();
    w.staged_ms = worst[n + i].item<double>();
    w.bytes_moved = static_cast<std::uint64_t>(bytes[i].item<double>());
    if (const auto at = run.staging_steps.by_plan.find(r.plan_id);
        at != run.staging_steps.by_plan.end()) {
      w.prepared_at_step = at->second.first;
      w.ready_at_step = at->second.second;
    }
    sum.switches.push_back(w);
  }
  return sum;
}

// The run summary: the switches' pauses and staging times are the largest over the ranks,
// their bytes the sum (every rank takes part).
void write_summary(WorkerRun& run) {
  const std::vector<SwitchRecord>& switches = run.switches;
  const auto n = static_cast<std::int64_t>(switches.size());
  at::Tensor worst = at::zeros({2 * n + 1}, at::kDouble);
  at::Tensor bytes = at::zeros({n + 1}, at::kDouble);
  for (std::int64_t i = 0; i < n; ++i) {
    worst[i].fill_(switches[static_cast<std::size_t>(i)].pause_ms);
    worst[n + i].fill_(switches[static_cast<std::size_t>(i)].staged_ms);
    bytes[i].fill_(static_cast<double>(switches[static_cast<std::size_t>(i)].bytes_sent));
  }
  std::vector<at::Tensor> bt{bytes};
  if (run.collective_ok(run.coll->all_reduce_max(worst)) &&
      run.collective_ok(run.coll->all_reduce_sum(bt)) && run.o.rank == 0)
    check(write_run_summary(run.o.summary_json, run_summary(run, worst, bytes)));
}

}  // namespace

void finish_training(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  if (run.exit_code == kWorkerOk && !o.dump_params.empty()) dump_params(run);
  if (run.exit_code == kWorkerOk && !o.save_state.empty()) save_state(run);
  if (run.exit_code == kWorkerOk && !o.summary_json.empty()) write_summary(run);
}

int shut_down(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  const std::string& tag = run.tag;
  if (run.releaser.joinable()) run.releaser.join();
  if (run.exit_code == kWorkerCollectiveFailed && run.store) {
    // Name the rank that is gone (a pipeline or tensor-parallel job cannot go on without it),
    // or, when every rank answered, the link that broke as the ranks report it.
    if (!run.links_cut.empty()) run.failure += " (this rank: " + run.links_cut + ")";
    // A peer blocked on this rank in a collective fails now, not at its timeout.
    (void)cut_peer_links(store_and_bus_ports(o));
    const FailureCensus census = take_failure_census(
        *run.store, o.rank, o.world_size, run.links_cut,
        std::chrono::milliseconds(
            static_cast<std::int64_t>(std::min(5.0, o.collective_timeout_s) * 1000)));
    if (!census.lost.empty())
      run.failure += " (lost: " + census.lost + ", no answer in the job's store)";
    else
      run.failure +=
          " (no rank lost: every rank answered in the job's store, so a link between "
          "ranks broke or a collective timed out" +
          (census.notes.empty() ? "" : "; " + census.notes) + ")";
  }
  if (run.exit_code != kWorkerOk)
    std::fprintf(stderr, "%s: stopping at step %llu: %s\n", tag.c_str(),
                 static_cast<unsigned long long>(run.step), run.failure.c_str());
  if (o.rank == 0 && run.exit_code == kWorkerOk &&
      (!run.layout.pure_data_parallel() || !run.switches.empty()))
    std::printf("%s: layout %s, %llu steps, final loss %.6f\n", tag.c_str(),
                layout_text(run.layout).c_str(), static_cast<unsigned long long>(run.step),
                run.last_loss);

  if (!o.record.empty()) {
    std::ofstream out(expand_rank(o.record, o.rank));
    if (!out) throw InputError("--record '" + o.record + "': cannot write");
    trace::write_telemetry(run.recorded, out);
  }
  if (run.bus) {
    transport::Shutdown bye;
    bye.reason = run.exit_code == kWorkerOk
                     ? "rank " + std::to_string(o.rank) + " finished at step " +
                           std::to_string(run.step)
                     : ("rank " + std::to_string(o.rank) + " failed at step " +
                        std::to_string(run.step) + ": " + run.failure)
                           .substr(0, transport::kMaxTextBytes);
    run.bus->send(bye);
    run.bus->flush(2000);
  }
  std::fflush(stdout);
  // After a failed collective the process groups may still wait on a dead peer in their
  // destructors; leave them to the process exit instead.
  if (run.exit_code != kWorkerOk) {
    (void)run.state.release();
    (void)run.coll.release();
  }
  return run.exit_code;
}

}  // namespace parapilot::live
