// The iteration boundary (libtorch): every rank agrees on stopping and on the plan to apply,
// and a committed layout change is switched to (layout_switch.h; worker_run.h).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "env/live/feedback_state.h"
#include "env/live/layout_switch.h"
#include "env/live/link_cut.h"
#include "env/live/worker_run.h"

namespace parapilot::live {

std::vector<int> store_and_bus_ports(const WorkerOptions& o) {
  std::vector<int> keep{o.master_port};
  if (const std::size_t colon = o.agent.rfind(':'); colon != std::string::npos)
    keep.push_back(std::atoi(o.agent.c_str() + colon + 1));
  return keep;
}

namespace {

// --dump-feedback: what `s`'s compressors owe, summed over its replicas (every rank takes part;
// rank 0 writes it).
Status dump_feedback(WorkerRun& run, LayoutState& s, const char* when, std::uint64_t at) {
  const WorkerOptions& o = run.o;
  const StatusOr<FeedbackState> owed = gather_feedback(s, *run.coll, 1);
  if (!owed.ok()) return owed.status();
  if (o.rank != 0) return {};
  std::filesystem::create_directories(o.dump_feedback);
  const std::string path = (std::filesystem::path(o.dump_feedback) /
                            ("feedback-" + std::string(when) + "-" + std::to_string(at) + ".bin"))
                               .string();
  std::ofstream out(path, std::ios::binary);
  for (std::size_t l = 0; l < run.layers.size(); ++l) {
    const at::Tensor t = owed->residual[l].defined() ? owed->residual[l][0].contiguous()
                                                     : at::zeros(run.layers[l].shape, at::kFloat);
    out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.numel() * 4));
  }
  if (!out) throw InputError("--dump-feedback '" + o.dump_feedback + "': cannot write " + path);
  return {};
}

// --link-cut-at-step: cuts this rank's connections to its peers when due at this boundary
// (once). The job's store and the agent's bus stay connected.
void cut_links_if_due(WorkerRun& run) {
  if (!run.link_cut_due) return;
  run.link_cut_due = false;
  const StatusOr<int> cut = cut_peer_links(store_and_bus_ports(run.o));
  run.links_cut = "links to its peers cut at step " + std::to_string(run.step) +
                  " (injected fault, --link-cut-at-step)";
  std::printf("%s: fault: %s: %s\n", run.tag.c_str(), run.links_cut.c_str(),
              cut.ok() ? (std::to_string(*cut) + " connections shut down; the process, its bus "
                                                 "and its store connection live on")
                             .c_str()
                       : cut.status().message().c_str());
  std::fflush(stdout);
}

// The switch: move the state into the staged layout of `next_plan` and train on it from this
// step (layout_switch.h). Its wall time is the pause this step pays. False when training ends.
bool switch_layout(WorkerRun& run, const LiveAction& a, std::uint64_t next_plan) {
  const WorkerOptions& o = run.o;
  const std::uint64_t step = run.step;
  const auto ts = WorkerClock::now();
  StatusOr<std::unique_ptr<StagedLayout>> took = run.stager->take(next_plan, step);
  const double take_ms = seconds_since(ts) * 1000;
  if (!run.collective_ok(took.status())) return false;
  std::unique_ptr<StagedLayout> staged = std::move(*took);
  if (!staged) {  // every rank said it holds the plan: a broken invariant
    run.failure = "plan " + std::to_string(next_plan) + " is held but not staged here";
    run.exit_code = kWorkerCollectiveFailed;
    return false;
  }
  const double staged_ms = staged->staged_ms;
  const std::uint64_t streamed_sent = staged->streamed_sent;
  if (!o.dump_feedback.empty() &&
      !run.collective_ok(dump_feedback(run, *run.state, "before", step)))
    return false;
  cut_links_if_due(run);  // a fault injected as the state starts to move
  const StatusOr<SwitchStats> moved = move_state(*run.state, *staged, o.rank, o.model, *run.coll);
  if (!run.collective_ok(moved.status())) return false;
  if (!o.dump_feedback.empty() &&
      !run.collective_ok(dump_feedback(run, *staged->state, "after", step)))
    return false;
  std::unique_ptr<LayoutState> old = std::move(run.state);
  run.state = std::move(staged->state);
  run.layout = run.state->layout();
  run.me = run.state->coords();
  run.current.set(run.layout);
  run.model = &run.state->model();
  run.params = run.model->parameters();
  run.opt = &run.state->optimizer();
  run.gsync = &run.state->gradient_sync();
  run.reports_loss = run.model->last_stage() && run.me.tp == 0;
  run.shares = a.shares.empty() ? std::vector<double>(static_cast<std::size_t>(run.layout.dp),
                                                      1.0 / run.layout.dp)
                                : a.shares;
  const auto tr = WorkerClock::now();
  if (run.releaser.joinable()) run.releaser.join();
  run.releaser = std::thread([gone = std::move(old), transfer = std::move(staged)]() mutable {
    gone.reset();
    transfer.reset();
  });
  const double release_ms = seconds_since(tr) * 1000;
  check(run.gsync->configure(run.state->local_entries(run.full_compression), run.topk_ratio,
                             run.powersgd_rank, run.bucket_bytes));
  SwitchRecord rec;
  rec.plan_id = next_plan;
  rec.at_step = step;
  rec.layout = layout_text(run.layout);
  rec.pause_ms = seconds_since(ts) * 1000;
  rec.staged_ms = staged_ms;
  rec.bytes_sent = moved->bytes_sent + streamed_sent;
  run.switches.push_back(rec);
  run.switched_this_step = true;
  std::printf(
      "%s: switched to layout %s at step %llu (plan %llu): pause %.1f ms (staged state "
      "taken in %.1f ms, old layout handed to its releaser in %.1f ms, state installed "
      "in %.1f ms: %s, %llu bytes sent at the boundary, %llu received, %llu copied "
      "locally, %llu bytes of error feedback all-reduced), built in %.1f ms beside "
      "training\n",
      run.tag.c_str(), rec.layout.c_str(), static_cast<unsigned long long>(step),
      static_cast<unsigned long long>(next_plan), rec.pause_ms, take_ms, release_ms,
      moved->move_ms,
      moved->streamed
          ? ("streamed ahead (" + std::to_string(streamed_sent) + " bytes sent before the boundary)")
                .c_str()
          : "not streamed",
      static_cast<unsigned long long>(moved->bytes_sent),
      static_cast<unsigned long long>(moved->bytes_received),
      static_cast<unsigned long long>(moved->bytes_local),
      static_cast<unsigned long long>(moved->feedback_bytes), rec.staged_ms);
  std::fflush(stdout);
  return true;
}

// Applies `next_plan` when every rank holds it (else tells the agent nobody switched). False
// when training ends.
bool apply_plan(WorkerRun& run, std::uint64_t next_plan) {
  const WorkerOptions& o = run.o;
  WorkerBus* bus = run.bus.get();
  at::Tensor held = at::full({1}, bus && bus->holds(next_plan) ? 1 : 0, at::kLong);
  std::vector<at::Tensor> ht{held};
  if (!run.collective_ok(run.coll->all_reduce_sum(ht))) return false;
  const std::optional<LiveAction> a =
      held.item<std::int64_t>() == o.world_size ? bus->applied(next_plan) : std::nullopt;
  if (!a) {
    if (bus)
      bus->missed(next_plan, "rank " + std::to_string(o.rank) + ": plan " +
                                 std::to_string(next_plan) +
                                 " not staged on every rank at the boundary; nobody "
                                 "switched");
    return true;
  }
  if (!a->shares.empty()) run.shares = a->shares;
  if (a->microbatch > 0) run.microbatch = a->microbatch;
  if (a->topk_ratio > 0) run.topk_ratio = a->topk_ratio;
  if (a->powersgd_rank > 0) run.powersgd_rank = a->powersgd_rank;
  if (a->bucket_bytes >= 0) run.bucket_bytes = a->bucket_bytes;
  if (!a->compression.empty()) run.full_compression = a->compression;
  if (!a->layout.empty()) {
    if (!switch_layout(run, *a, next_plan)) return false;
  } else {
    check(run.gsync->configure(run.state->local_entries(run.full_compression), run.topk_ratio,
                               run.powersgd_rank, run.bucket_bytes));
  }
  run.plan_id = next_plan;
  return true;
}

}  // namespace

std::optional<double> cross_boundary(WorkerRun& run, double now_s) {
  const WorkerOptions& o = run.o;
  const std::uint64_t step = run.step;
  WorkerBus* bus = run.bus.get();
  // Agree on stopping and on the plan to switch to (transport/plan_book.h): the newest plan
  // committed on some rank (MAX over the world, int64 so that plan ids survive exactly), then
  // whether every rank holds it.
  const bool stop = (o.steps > 0 && static_cast<std::int64_t>(step) >= o.steps) ||
                    (o.max_seconds > 0 && o.rank == 0 && now_s >= o.max_seconds) ||
                    (bus && bus->stop_requested());
  const auto tc = WorkerClock::now();
  const StatusOr<BoundaryDecision> agreed =
      agree_at_boundary(*run.coll, bus ? bus->committed_at(step, run.plan_id) : 0, stop);
  if (!run.collective_ok(agreed.status())) return std::nullopt;
  if (agreed->stop) return std::nullopt;
  run.link_cut_due =
      o.link_cut_at_step >= 0 && step == static_cast<std::uint64_t>(o.link_cut_at_step);
  // Staged layouts of plans the book dropped (aborted, refused, missed, the agent lost) are
  // torn down.
  for (std::uint64_t dropped :
       run.stager->keep_only([&](std::uint64_t id) { return bus && bus->knows(id); }))
    std::printf(
        "%s: plan %llu dropped while staging or staged (aborted, refused or the "
        "agent lost); its groups are torn down and the job stays on %s\n",
        run.tag.c_str(), static_cast<unsigned long long>(dropped), layout_text(run.layout).c_str());
  // A commit this rank holds, named once: it stands for its switch step even if the agent goes
  // before then.
  if (const std::uint64_t held =
          bus ? bus->committed_at(std::numeric_limits<std::uint64_t>::max(),
                                  std::max(run.plan_id, run.commit_said))
              : 0;
      held > 0) {
    run.commit_said = held;
    std::printf("%s: plan %llu: commit received by step %llu\n", run.tag.c_str(),
                static_cast<unsigned long long>(held), static_cast<unsigned long long>(step));
    std::fflush(stdout);
  }
  const std::uint64_t next_plan = agreed->plan_id;
  if (next_plan > run.plan_id && !apply_plan(run, next_plan)) return std::nullopt;
  cut_links_if_due(run);  // due here when no switch moved the state
  // Plans built since the last boundary start streaming from this one (layout_stager.h).
  if (!run.collective_ok(run.stager->at_boundary(*run.state, step).status())) return std::nullopt;
  return seconds_since(tc) * 1000;
}

}  // namespace parapilot::live
