// The worker's bus (libtorch side): the checks of a new plan against the running job, and the
// staging of a layout change beside training (layout_stager.h; worker_run.h).
#include <cstdio>
#include <limits>

#include "core/error.h"
#include "env/live/layout_switch.h"
#include "env/live/worker_run.h"

namespace parapilot::live {

namespace {

// The bus thread's check of a plan: what it asks is possible for this job (the layout it runs
// is read from `current`).
StatusOr<LiveAction> read_plan(const WorkerOptions& o, const BackendInfo& backend,
                               CurrentLayout& current, std::size_t n_layers,
                               const transport::PlanPrepare& p) {
  // The control reduction carries plan ids as int64.
  if (p.plan_id > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    return Status::rejected("plan id " + std::to_string(p.plan_id) + " exceeds 2^63 - 1");
  const LiveLayout now = current.get();
  StatusOr<LiveAction> read = action_from_plan(p, o.world_size, n_layers);
  if (!read.ok()) return read;
  LiveAction& a = *read;
  int replicas = now.dp;
  if (!a.layout.empty()) {
    const StatusOr<LiveLayout> to = parse_layout(a.layout, o.world_size, o.model);
    if (!to.ok()) return Status::rejected("layout '" + a.layout + "': " + to.status().message());
    if (*to == now) {
      a.layout.clear();  // the layout it runs: nothing to stage
    } else {
      if (!backend.switches_layouts)
        return Status::rejected("layout '" + a.layout +
                                "': the workers switch layouts on the Gloo backend only");
      a.layout = layout_text(*to);
      replicas = to->dp;
    }
  }
  if (!a.shares.empty() && a.shares.size() != static_cast<std::size_t>(replicas))
    return Status::rejected("shares for " + std::to_string(a.shares.size()) +
                            (now.pure_data_parallel() && a.layout.empty()
                                 ? " ranks; the job has "
                                 : " replicas; the layout has ") +
                            std::to_string(replicas));
  if (!a.compression.empty() && a.compression.size() != n_layers)
    return Status::rejected("compression for " + std::to_string(a.compression.size()) +
                            " layers; the model has " + std::to_string(n_layers));
  if (a.microbatch > 0 && o.global_batch % a.microbatch != 0)
    return Status::rejected("microbatch " + std::to_string(a.microbatch) +
                            " does not divide the global batch " + std::to_string(o.global_batch));
  return read;
}

// What the job tells the agent it is and can do.
transport::JobInfo job_info(const WorkerOptions& o, const BackendInfo& backend,
                            const std::vector<LayerShape>& layers) {
  transport::JobInfo job;
  job.rank = static_cast<std::uint32_t>(o.rank);
  job.world_size = static_cast<std::uint32_t>(o.world_size);
  job.global_batch = static_cast<std::uint32_t>(o.global_batch);
  job.capabilities =
      transport::kCapDpShares | transport::kCapCompression | transport::kCapMicroBatches;
  // Layouts switch on Gloo (layout_switch.h), for the transformer (the MLP is data parallel).
  if (backend.switches_layouts && o.model.kind == "transformer")
    job.capabilities |= transport::kCapTensor | transport::kCapPipeline;
  job.framework = "parapilot-worker";
  for (const LayerShape& l : layers) {
    const auto n = static_cast<std::uint64_t>(l.numel());
    job.layers.push_back({n, n * 4});
  }
  return job;
}

// A layout change is staged off the training path (layout_stager.h): PlanReady once the new
// layout is built and the peers' snapshots of the moving state are here. Runs on the bus
// thread; reaches the stager through a weak pointer: a plan arriving while the worker ends
// finds it gone and is refused.
void stage_async(WorkerRun& run, const std::weak_ptr<LayoutStager>& weak,
                 std::chrono::milliseconds stage_delay, std::uint64_t id, const LiveAction& a,
                 WorkerBus::Done done) {
  const WorkerOptions& o = run.o;
  const std::shared_ptr<LayoutStager> staging = weak.lock();
  if (!staging) {
    done(Status::unavailable("the worker is ending"));
    return;
  }
  const LiveLayout from = run.current.get();
  const StatusOr<LiveLayout> to = parse_layout(a.layout, o.world_size, o.model);
  if (!to.ok()) {
    done(to.status());
    return;
  }
  Collectives* world = run.coll.get();
  std::atomic<std::uint64_t>& training_step = run.training_step;
  StagingSteps& staging_steps = run.staging_steps;
  {
    std::lock_guard lock(staging_steps.mu);
    staging_steps.by_plan[id] = {static_cast<std::int64_t>(training_step.load()), -1};
  }
  std::printf("worker rank %d: plan %llu: staging layout %s beside training (from step %llu)\n",
              o.rank, static_cast<unsigned long long>(id), layout_text(*to).c_str(),
              static_cast<unsigned long long>(training_step.load()));
  std::fflush(stdout);
  staging->start(
      id,
      [id, from, to = *to, rank = o.rank, world, store = run.store, lo = run.lo,
       stage_delay](const std::function<bool()>& cancelled) {
        return stage_layout(id, from, to, rank, *world, store, lo, stage_delay, cancelled);
      },
      [id, rank = o.rank, done = std::move(done), &training_step,
       &staging_steps](const Status& st) {
        {
          std::lock_guard lock(staging_steps.mu);
          staging_steps.by_plan[id].second = static_cast<std::int64_t>(training_step.load());
        }
        std::printf("worker rank %d: plan %llu: %s at step %llu\n", rank,
                    static_cast<unsigned long long>(id),
                    st.ok() ? "staged (new layout built, moving state here)"
                            : ("not staged: " + st.message()).c_str(),
                    static_cast<unsigned long long>(training_step.load()));
        std::fflush(stdout);
        done(st);
      });
}

}  // namespace

void connect_to_agent(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  // The step training is at, read by the bus and the stager threads.
  run.training_step.store(run.first_step);
  run.stager = std::make_shared<LayoutStager>(o.rank, o.switch_transfer == "streamed");
  if (o.agent.empty()) return;
  const auto stage_delay = std::chrono::milliseconds(static_cast<std::int64_t>(o.stage_delay_ms));
  auto check_plan = [&o, &backend = run.backend, &current = run.current,
                     n_layers = run.layers.size()](const transport::PlanPrepare& p) {
    return read_plan(o, backend, current, n_layers, p);
  };
  auto stage = [&run, weak = std::weak_ptr<LayoutStager>(run.stager), stage_delay](
                   std::uint64_t id, const LiveAction& a, WorkerBus::Done done) {
    stage_async(run, weak, stage_delay, id, a, std::move(done));
  };
  run.bus = take(WorkerBus::connect(o.agent, o.secret_file, o.rank, check_plan,
                                    job_info(o, run.backend, run.layers), stage));
  run.bus->wait_connected(10000);
}

}  // namespace parapilot::live
