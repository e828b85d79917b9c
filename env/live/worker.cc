// The training worker (libtorch): rendezvous and the training loop. The data is corpus.h, the model
// hybrid_model.h, the process groups collectives.h, everything that depends on the layout
// layout_state.h, one step's passes through the pipeline pipeline.h.
#include "env/live/worker.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "env/live/checkpoint.h"
#include "env/live/checkpoint_state.h"
#include "env/live/collectives.h"
#include "env/live/corpus.h"
#include "env/live/feedback_state.h"
#include "env/live/grad_sync.h"
#include "env/live/layout.h"
#include "env/live/layout_state.h"
#include "env/live/layout_stager.h"
#include "env/live/pipeline.h"
#include "env/live/run_summary.h"
#include "env/live/worker_bus.h"
#include "env/trace/telemetry.h"
#include "transport/telemetry_keys.h"
#include "core/error.h"
#ifdef PARAPILOT_HAVE_NCCL
#include "env/live/nccl_comm.h"
#endif

namespace parapilot::live {

namespace {

using Clock = std::chrono::steady_clock;

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

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::uint64_t wall_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

std::string expand_rank(std::string path, int rank) {
  const std::size_t at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(rank));
  return path;
}

}  // namespace

namespace {
int run_or_throw(const WorkerOptions& o);
}  // namespace

StatusOr<int> run_worker(const WorkerOptions& o) {
  return catch_input_error([&] { return run_or_throw(o); });
}

namespace {

int run_or_throw(const WorkerOptions& o) {
  check(validate(o));
  at::set_num_threads(o.threads);
  const auto t_start = Clock::now();
  const std::uint64_t started_ns = wall_ns();
  const std::string tag = "worker rank " + std::to_string(o.rank);
  const std::string corpus = load_corpus(o.corpus);
  const std::int64_t seq_bytes = o.model.seq_len + 1;
  if (static_cast<std::int64_t>(corpus.size()) < seq_bytes + 1)
    throw InputError("--corpus: too short for --seq-len " + std::to_string(o.model.seq_len));
  const at::Tensor corpus_t = at::from_blob(const_cast<char*>(corpus.data()),
                                            {static_cast<std::int64_t>(corpus.size())}, at::kByte)
                                  .to(at::kLong);
  LiveLayout layout = take(parse_layout(o.layout, o.world_size, o.model));
  const std::vector<LayerShape> layers = model_layers(o.model);
  // A checkpoint to resume from is read and checked before the rendezvous, so that a bad one
  // fails every rank alike (exit code 2) and none waits for the others.
  std::optional<Checkpoint> resumed;
  if (!o.load_state.empty()) resumed = take(read_checkpoint(o.load_state, o.model, o.optimizer));
  const std::uint64_t first_step = resumed ? resumed->next_step : 0;
  if (o.rank == 0 && !o.save_state.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.save_state, ec);
    if (ec || !std::filesystem::is_directory(o.save_state))
      throw InputError("--save-state '" + o.save_state + "': cannot create the folder");
  }

  // Rendezvous and the world group (control, loss and the gathered dump).
  std::unique_ptr<Collectives> coll;
  c10::intrusive_ptr<c10d::Store> store;
  GroupOptions group_options;
  group_options.timeout_s = o.collective_timeout_s;
  group_options.master_addr = o.master_addr;
  int device = 0;
  if (o.world_size == 1 && o.backend == "gloo" && std::getenv("MASTER_PORT") == nullptr) {
    coll = make_local_collectives();
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(o.master_port);
    so.isServer = o.rank == 0;
    so.numWorkers = static_cast<std::size_t>(o.world_size);
    so.waitWorkers = true;
    so.timeout =
        std::chrono::milliseconds(static_cast<std::int64_t>(o.rendezvous_timeout_s * 1000));
    try {
      store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "%s: rendezvous at %s:%d failed: %s\n", tag.c_str(),
                   o.master_addr.c_str(), o.master_port, e.what_without_backtrace());
      return kWorkerCollectiveFailed;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: rendezvous at %s:%d failed: %s\n", tag.c_str(),
                   o.master_addr.c_str(), o.master_port, e.what());
      return kWorkerCollectiveFailed;
    }
    StatusOr<std::unique_ptr<Collectives>> made = Status::internal("no backend");
    if (o.backend == "nccl") {
#ifdef PARAPILOT_HAVE_NCCL
      std::string why;
      const int gpus = cuda_device_count(&why);
      if (gpus == 0) throw InputError("--backend nccl: " + why);
      device = o.local_rank % gpus;
      made = make_nccl_collectives(store, o.rank, o.world_size, device, o.collective_timeout_s);
#else
      throw InputError("--backend nccl: this build has no NCCL (CMake found no CUDA/NCCL)");
#endif
    } else {
      made = make_gloo_collectives(store, o.rank, o.world_size, group_options);
    }
    if (!made.ok()) {
      std::fprintf(stderr, "%s: %s\n", tag.c_str(), made.status().message().c_str());
      return kWorkerCollectiveFailed;
    }
    coll = std::move(*made);
  }

  // This rank's part of the layout: groups, stage model, optimizer, gradient reduction.
  LayoutStateOptions lo;
  lo.model = o.model;
  lo.seed = o.seed;
  lo.optimizer = o.optimizer;
  lo.lr = o.lr;
  lo.backend = o.backend;
  lo.device = device;
  lo.groups = group_options;
  StatusOr<std::unique_ptr<LayoutState>> built =
      LayoutState::build(layout, o.rank, *coll, store, lo);
  if (!built.ok()) {
    std::fprintf(stderr, "%s: %s\n", tag.c_str(), built.status().message().c_str());
    (void)coll.release();
    return kWorkerCollectiveFailed;
  }
  std::unique_ptr<LayoutState> state = std::move(*built);
  if (resumed) {
    install_checkpoint(*state, *resumed);
    resumed.reset();
  }
  RankCoords me = state->coords();

  // The layout the job runs, for the bus thread's checks of new plans (the training thread
  // changes it at a switch).
  struct CurrentLayout {
    std::mutex mu;
    LiveLayout layout;
    LiveLayout get() {
      std::lock_guard lock(mu);
      return layout;
    }
    void set(const LiveLayout& l) {
      std::lock_guard lock(mu);
      layout = l;
    }
  } current;
  current.set(layout);

  // The step training is at, and the steps at which each plan's staging began and ended (for
  // --summary-json). Declared before the bus and the stager, whose threads write them.
  std::atomic<std::uint64_t> training_step{first_step};
  struct StagingSteps {
    std::mutex mu;
    std::map<std::uint64_t, std::pair<std::int64_t, std::int64_t>> by_plan;  // prepared, ready
  } staging_steps;

  std::unique_ptr<WorkerBus> bus;
  // Declared after the bus: its threads report to the bus, so it goes first (its destructor
  // joins them). The bus thread reaches it through a weak pointer: a plan arriving while the
  // worker ends finds it gone and is refused.
  auto stager = std::make_shared<LayoutStager>(o.rank, o.switch_transfer == "streamed");
  // Releases a replaced layout's state and groups off the training path (joined before the
  // next switch and when training ends).
  std::thread releaser;
  const auto stage_delay = std::chrono::milliseconds(static_cast<std::int64_t>(o.stage_delay_ms));
  if (!o.agent.empty()) {
    auto read_plan = [&o, &current, n_layers = layers.size()](
                         const transport::PlanPrepare& p) -> StatusOr<LiveAction> {
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
        if (!to.ok())
          return Status::rejected("layout '" + a.layout + "': " + to.status().message());
        if (*to == now) {
          a.layout.clear();  // the layout it runs: nothing to stage
        } else {
          if (o.backend != "gloo")
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
                                " does not divide the global batch " +
                                std::to_string(o.global_batch));
      return read;
    };
    transport::JobInfo job;
    job.rank = static_cast<std::uint32_t>(o.rank);
    job.world_size = static_cast<std::uint32_t>(o.world_size);
    job.global_batch = static_cast<std::uint32_t>(o.global_batch);
    job.capabilities =
        transport::kCapDpShares | transport::kCapCompression | transport::kCapMicroBatches;
    // Layouts switch on Gloo (layout_switch.h), for the transformer (the MLP is data parallel).
    if (o.backend == "gloo" && o.model.kind == "transformer")
      job.capabilities |= transport::kCapTensor | transport::kCapPipeline;
    job.framework = "parapilot-worker";
    for (const LayerShape& l : layers) {
      const auto n = static_cast<std::uint64_t>(l.numel());
      job.layers.push_back({n, n * 4});
    }
    // A layout change is staged off the training path (layout_stager.h): PlanReady once the
    // new layout is built and the peers' snapshots of the moving state are here.
    auto stage_async = [&o, &current, weak = std::weak_ptr<LayoutStager>(stager), &coll, store, lo,
                        stage_delay, &training_step, &staging_steps](
                           std::uint64_t id, const LiveAction& a, WorkerBus::Done done) {
      const std::shared_ptr<LayoutStager> staging = weak.lock();
      if (!staging) {
        done(Status::unavailable("the worker is ending"));
        return;
      }
      const LiveLayout from = current.get();
      const StatusOr<LiveLayout> to = parse_layout(a.layout, o.world_size, o.model);
      if (!to.ok()) {
        done(to.status());
        return;
      }
      Collectives* world = coll.get();
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
          [id, from, to = *to, rank = o.rank, world, store, lo,
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
    };
    bus = take(
        WorkerBus::connect(o.agent, o.secret_file, o.rank, read_plan, std::move(job), stage_async));
    bus->wait_connected(10000);
  }

  // Current plan. Shares and per-layer compression are per replica and per full-model tensor.
  std::vector<double> shares =
      o.shares.empty() ? std::vector<double>(static_cast<std::size_t>(layout.dp), 1.0 / layout.dp)
                       : take(parse_shares(o.shares));
  int microbatch = o.microbatch;
  GradientSync* gsync = &state->gradient_sync();
  // Per-layer compression of the whole model (model_layers order).
  std::vector<Compression> full_compression;
  if (o.compression == "auto") {
    full_compression =
        select_compression(layers, {}, SelectorOptions{.powersgd_rank = o.powersgd_rank});
  } else {
    full_compression = take(parse_compression_list(o.compression));
    if (full_compression.size() == 1) full_compression.assign(layers.size(), full_compression[0]);
  }
  gsync->configure(state->local_entries(full_compression), o.topk_ratio, o.powersgd_rank,
                   o.bucket_bytes);
  double topk_ratio = o.topk_ratio;
  int powersgd_rank = o.powersgd_rank;
  std::int64_t bucket_bytes = o.bucket_bytes;
  StageModel* model = &state->model();
  std::vector<at::Tensor> params = model->parameters();  // handles of the tensors
  torch::optim::Optimizer* opt = &state->optimizer();
  // The last stage's first TP rank reports its replica's loss into the world's sum.
  bool reports_loss = model->last_stage() && me.tp == 0;
  struct SwitchRecord {
    std::uint64_t plan_id = 0, at_step = 0;
    std::string layout;
    double pause_ms = 0, staged_ms = 0;
    std::uint64_t bytes_sent = 0;
  };
  std::vector<SwitchRecord> switches;
  bool switched_this_step = false;

  std::vector<trace::TelemetrySample> recorded;
  std::ofstream loss_log;
  if (o.rank == 0 && !o.loss_log.empty()) {
    loss_log.open(o.loss_log);
    if (!loss_log) throw InputError("--loss-log '" + o.loss_log + "': cannot write");
    loss_log << "step,loss,tokens,dp_bytes,step_s\n";
    loss_log << std::setprecision(9);
  }

  int exit_code = kWorkerOk;
  std::uint64_t plan_id = 0;
  std::uint64_t commit_said = 0;  // the newest committed plan the log has named
  std::uint64_t step = first_step;
  // Rank 0's step ends (seconds since the worker started, and the wall clock of the first and
  // the last), for --summary-json.
  std::vector<double> step_end_times;
  std::uint64_t first_step_end_ns = 0, last_step_end_ns = 0;
  double train_start_s = 0;
  double tokens = 0;
  std::uint64_t total_dp_bytes = 0;
  double last_loss = 0;
  std::string failure;
  // A collective that failed ends the training loop: the others notice through their own.
  auto collective_ok = [&](const Status& st) {
    if (st.ok()) return true;
    failure = st.message();
    exit_code = kWorkerCollectiveFailed;
    return false;
  };
  // --dump-feedback: what `s`'s compressors owe, summed over its replicas (every rank takes
  // part; rank 0 writes it).
  auto dump_feedback = [&](LayoutState& s, const char* when, std::uint64_t at) -> Status {
    const StatusOr<FeedbackState> owed = gather_feedback(s, *coll, 1);
    if (!owed.ok()) return owed.status();
    if (o.rank != 0) return {};
    std::filesystem::create_directories(o.dump_feedback);
    const std::string path = (std::filesystem::path(o.dump_feedback) /
                              ("feedback-" + std::string(when) + "-" + std::to_string(at) + ".bin"))
                                 .string();
    std::ofstream out(path, std::ios::binary);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const at::Tensor t = owed->residual[l].defined() ? owed->residual[l][0].contiguous()
                                                       : at::zeros(layers[l].shape, at::kFloat);
      out.write(static_cast<const char*>(t.data_ptr()),
                static_cast<std::streamsize>(t.numel() * 4));
    }
    if (!out) throw InputError("--dump-feedback '" + o.dump_feedback + "': cannot write " + path);
    return {};
  };
  try {
    bool started = collective_ok(state->broadcast_parameters());
    train_start_s = seconds_since(t_start);
    while (started) {
      training_step.store(step);
      const double now_s = seconds_since(t_start);
      // 1. Boundary: agree on stopping and on the plan to switch to (transport/plan_book.h):
      // the newest plan committed on some rank (MAX over the world, int64 so that plan ids
      // survive exactly), then whether every rank holds it.
      const bool stop = (o.steps > 0 && static_cast<std::int64_t>(step) >= o.steps) ||
                        (o.max_seconds > 0 && o.rank == 0 && now_s >= o.max_seconds) ||
                        (bus && bus->stop_requested());
      const auto tc = Clock::now();
      const StatusOr<BoundaryDecision> agreed =
          agree_at_boundary(*coll, bus ? bus->committed_at(step, plan_id) : 0, stop);
      if (!collective_ok(agreed.status())) break;
      if (agreed->stop) break;
      // Staged layouts of plans the book dropped (aborted, refused, missed, the agent lost)
      // are torn down.
      for (std::uint64_t dropped :
           stager->keep_only([&](std::uint64_t id) { return bus && bus->knows(id); }))
        std::printf(
            "%s: plan %llu dropped while staging or staged (aborted, refused or the "
            "agent lost); its groups are torn down and the job stays on %s\n",
            tag.c_str(), static_cast<unsigned long long>(dropped), layout_text(layout).c_str());
      // A commit this rank holds, named once: it stands for its switch step even if the agent
      // goes before then.
      if (const std::uint64_t held =
              bus ? bus->committed_at(std::numeric_limits<std::uint64_t>::max(),
                                      std::max(plan_id, commit_said))
                  : 0;
          held > 0) {
        commit_said = held;
        std::printf("%s: plan %llu: commit received by step %llu\n", tag.c_str(),
                    static_cast<unsigned long long>(held), static_cast<unsigned long long>(step));
        std::fflush(stdout);
      }
      const std::uint64_t next_plan = agreed->plan_id;
      if (next_plan > plan_id) {
        at::Tensor held = at::full({1}, bus && bus->holds(next_plan) ? 1 : 0, at::kLong);
        std::vector<at::Tensor> ht{held};
        if (!collective_ok(coll->all_reduce_sum(ht))) break;
        const std::optional<LiveAction> a =
            held.item<std::int64_t>() == o.world_size ? bus->applied(next_plan) : std::nullopt;
        if (!a) {
          if (bus)
            bus->missed(next_plan, "rank " + std::to_string(o.rank) + ": plan " +
                                       std::to_string(next_plan) +
                                       " not staged on every rank at the boundary; nobody "
                                       "switched");
        } else {
          if (!a->shares.empty()) shares = a->shares;
          if (a->microbatch > 0) microbatch = a->microbatch;
          if (a->topk_ratio > 0) topk_ratio = a->topk_ratio;
          if (a->powersgd_rank > 0) powersgd_rank = a->powersgd_rank;
          if (a->bucket_bytes >= 0) bucket_bytes = a->bucket_bytes;
          if (!a->compression.empty()) full_compression = a->compression;
          if (!a->layout.empty()) {
            // The switch: move the state into the staged layout and train on it from this
            // step (layout_switch.h). Its wall time is the pause this step pays.
            const auto ts = Clock::now();
            StatusOr<std::unique_ptr<StagedLayout>> took = stager->take(next_plan, step);
            const double take_ms = seconds_since(ts) * 1000;
            if (!collective_ok(took.status())) break;
            std::unique_ptr<StagedLayout> staged = std::move(*took);
            if (!staged) {  // every rank said it holds the plan: a broken invariant
              failure = "plan " + std::to_string(next_plan) + " is held but not staged here";
              exit_code = kWorkerCollectiveFailed;
              break;
            }
            const double staged_ms = staged->staged_ms;
            const std::uint64_t streamed_sent = staged->streamed_sent;
            if (!o.dump_feedback.empty() && !collective_ok(dump_feedback(*state, "before", step)))
              break;
            const StatusOr<SwitchStats> moved = move_state(*state, *staged, o.rank, o.model, *coll);
            if (!collective_ok(moved.status())) break;
            if (!o.dump_feedback.empty() &&
                !collective_ok(dump_feedback(*staged->state, "after", step)))
              break;
            std::unique_ptr<LayoutState> old = std::move(state);
            state = std::move(staged->state);
            layout = state->layout();
            me = state->coords();
            current.set(layout);
            model = &state->model();
            params = model->parameters();
            opt = &state->optimizer();
            gsync = &state->gradient_sync();
            reports_loss = model->last_stage() && me.tp == 0;
            shares = a->shares.empty()
                         ? std::vector<double>(static_cast<std::size_t>(layout.dp), 1.0 / layout.dp)
                         : a->shares;
            const auto tr = Clock::now();
            if (releaser.joinable()) releaser.join();
            releaser = std::thread([gone = std::move(old), transfer = std::move(staged)]() mutable {
              gone.reset();
              transfer.reset();
            });
            const double release_ms = seconds_since(tr) * 1000;
            gsync->configure(state->local_entries(full_compression), topk_ratio, powersgd_rank,
                             bucket_bytes);
            SwitchRecord rec;
            rec.plan_id = next_plan;
            rec.at_step = step;
            rec.layout = layout_text(layout);
            rec.pause_ms = seconds_since(ts) * 1000;
            rec.staged_ms = staged_ms;
            rec.bytes_sent = moved->bytes_sent + streamed_sent;
            switches.push_back(rec);
            switched_this_step = true;
            std::printf(
                "%s: switched to layout %s at step %llu (plan %llu): pause %.1f ms (staged state "
                "taken in %.1f ms, old layout handed to its releaser in %.1f ms, state installed "
                "in %.1f ms: %s, %llu bytes sent at the boundary, %llu received, %llu copied "
                "locally, %llu bytes of error feedback all-reduced), built in %.1f ms beside "
                "training\n",
                tag.c_str(), rec.layout.c_str(), static_cast<unsigned long long>(step),
                static_cast<unsigned long long>(next_plan), rec.pause_ms, take_ms, release_ms,
                moved->move_ms,
                moved->streamed ? ("streamed ahead (" + std::to_string(streamed_sent) +
                                   " bytes sent before the boundary)")
                                      .c_str()
                                : "not streamed",
                static_cast<unsigned long long>(moved->bytes_sent),
                static_cast<unsigned long long>(moved->bytes_received),
                static_cast<unsigned long long>(moved->bytes_local),
                static_cast<unsigned long long>(moved->feedback_bytes), rec.staged_ms);
            std::fflush(stdout);
          } else {
            gsync->configure(state->local_entries(full_compression), topk_ratio, powersgd_rank,
                             bucket_bytes);
          }
          plan_id = next_plan;
        }
      }
      // Plans built since the last boundary start streaming from this one (layout_stager.h).
      if (!collective_ok(stager->at_boundary(*state, step).status())) break;
      const double control_ms = seconds_since(tc) * 1000;

      // 2. Forward/backward over this replica's microbatches, through this rank's stage.
      const std::uint64_t step_start_ns = wall_ns();
      const double step_start_s = seconds_since(t_start);
      const int total_mb = o.global_batch / microbatch;
      const std::vector<int> counts = microbatch_counts(shares, total_mb);
      int first = 0;
      for (int r = 0; r < me.dp; ++r) first += counts[static_cast<std::size_t>(r)];
      const int mine = counts[static_cast<std::size_t>(me.dp)];
      const bool slowed =
          o.slow_factor > 1 && fault_window(o.slow_at_step, o.slow_for_steps, o.slow_at_s,
                                            o.slow_for_s, step, now_s);
      opt->zero_grad();
      for (const auto& p : params) {
        if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
      }
      auto make_batch = [&](int i) {
        const int j = first + i;
        std::vector<at::Tensor> rows;
        for (int k = 0; k < microbatch; ++k) {
          const std::uint64_t g = static_cast<std::uint64_t>(j * microbatch + k);
          rows.push_back(corpus_t.narrow(
              0, sequence_start(o.seed, step, g, corpus_t.size(0), seq_bytes), seq_bytes));
        }
        return at::stack(rows);
      };
      PipelineStepOptions po;
      po.microbatches = mine;
      po.sequences = microbatch;
      po.loss_divisor = static_cast<double>(total_mb);
      po.slow_factor = slowed ? o.slow_factor : 1;
      TensorParallelGroup* tp = state->tp();
      const double tp_ms_before = tp ? tp->all_reduce_ms : 0;
      const std::uint64_t tp_bytes_before = tp ? tp->all_reduce_bytes : 0;
      const std::uint32_t tp_calls_before = tp ? tp->all_reduce_calls : 0;
      const StatusOr<PipelineStepStats> passes =
          run_pipeline_step(*model, state->pipeline(), tp, po, make_batch);
      if (!collective_ok(passes.status())) break;
      const double compute_ms = passes->compute_ms;
      const double tp_ms = tp ? tp->all_reduce_ms - tp_ms_before : 0;
      const double local_loss = reports_loss ? passes->loss : 0;

      // 3. Per-layer gradient statistics (local, before the reduction; full-model indices).
      std::vector<transport::LayerGradStat> layer_stats;
      const bool publish = bus && step % static_cast<std::uint64_t>(o.telemetry_every) == 0;
      std::vector<at::Tensor> grads;
      for (std::size_t i = 0; i < params.size(); ++i) {
        grads.push_back(params[i].mutable_grad());
        if (publish) {
          const at::Tensor g = grads.back();
          const at::Tensor finite = g.isfinite();
          const auto nonfinite =
              static_cast<std::uint32_t>(g.numel() - finite.sum().item<std::int64_t>());
          const at::Tensor gf = nonfinite ? g.where(finite, at::zeros_like(g)) : g;
          layer_stats.push_back({static_cast<std::uint32_t>(model->shards()[i].layer),
                                 gf.norm().item<float>(), gf.abs().max().item<float>(), nonfinite});
        }
      }

      // 4. Gradient reduction over the DP group.
      const bool delayed =
          o.link_delay_ms > 0 && fault_window(o.link_delay_at_step, o.link_delay_for_steps,
                                              o.link_delay_at_s, o.link_delay_for_s, step, now_s);
      auto before_call = [&] {
        if (delayed)
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(o.link_delay_ms));
      };
      const StatusOr<SyncStats> synced = gsync->sync(grads, state->dp(), before_call);
      if (!collective_ok(synced.status())) break;
      const SyncStats& sync = *synced;
      if (!collective_ok(stager->after_reduction(*state, step).status())) break;
      // 5. Global loss (for the log) and the update.
      at::Tensor loss_t = at::full({1}, local_loss, at::kDouble);
      std::vector<at::Tensor> lt{loss_t};
      const auto tl = Clock::now();
      if (!collective_ok(coll->all_reduce_sum(lt))) break;
      const double loss_ms = seconds_since(tl) * 1000;
      last_loss = loss_t.item<double>();
      stager->release(step);  // every rank has sent this step's streamed gradients
      opt->step();

      const std::uint64_t step_end_ns = wall_ns();
      const double step_end_s = seconds_since(t_start);
      step_end_times.push_back(step_end_s);
      if (first_step_end_ns == 0) first_step_end_ns = step_end_ns;
      last_step_end_ns = step_end_ns;
      const double step_tokens = static_cast<double>(o.global_batch) * o.model.seq_len;
      tokens += step_tokens;
      const std::uint64_t dp_bytes = sync.all_reduce_bytes + sync.all_gather_bytes;
      total_dp_bytes += dp_bytes;
      if (loss_log.is_open())
        loss_log << step << ',' << last_loss << ',' << tokens << ',' << total_dp_bytes << ','
                 << (step_end_s - step_start_s) << '\n';

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
      if (!o.record.empty()) recorded.push_back(row);

      if (publish) {
        transport::Telemetry t;
        t.rank = static_cast<std::uint32_t>(o.rank);
        t.step = step;
        t.step_start_ns = step_start_ns;
        t.step_end_ns = step_end_ns;
        // Everything this rank did in the step except waiting in its collectives and for its
        // pipeline neighbours: a slowdown anywhere in the step (batch building, the optimizer)
        // counts, a wait for a peer not.
        const double wall_ms = static_cast<double>(step_end_ns - step_start_ns) / 1e6;
        const double wait_ms =
            sync.all_reduce_ms + sync.all_gather_ms + loss_ms + passes->p2p_ms + tp_ms;
        t.compute_ms = std::clamp(wall_ms - wait_ms, compute_ms, std::max(compute_ms, wall_ms));
        t.queue_depth = sync.buckets;
        namespace keys = transport::telemetry_keys;
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
          t.collectives[keys::kSwitchLayout] = {switches.back().pause_ms,
                                                switches.back().bytes_sent, 1};
        // Where the rank sits in a hybrid layout.
        if (!layout.pure_data_parallel())
          keys::set_replica_and_stage(t, static_cast<std::uint64_t>(me.dp),
                                      static_cast<std::uint64_t>(me.stage));
        // Samples this rank processed: the monitor compares ranks' compute per sample, so a
        // rank given a smaller share does not look faster than it is.
        keys::set_info(t, keys::kSamples, static_cast<std::uint64_t>(mine) * microbatch);
        t.layers = std::move(layer_stats);
        t.send_time_ns = wall_ns();
        bus->send(t);
      }
      switched_this_step = false;
      ++step;
    }
    if (releaser.joinable()) releaser.join();
    // The whole model, gathered from stages and TP shards (every rank takes part).
    if (exit_code == kWorkerOk && !o.dump_params.empty()) {
      if (layout.tp > 1) {
        const StatusOr<double> spread = state->tp_replica_spread();
        if (collective_ok(spread.status())) {
          at::Tensor worst = at::full({1}, *spread, at::kDouble);
          if (collective_ok(coll->all_reduce_max(worst)) && o.rank == 0)
            std::printf("%s: tensor-parallel replicas differ by at most %.3g\n", tag.c_str(),
                        worst.item<double>());
        }
      }
      const StatusOr<std::vector<at::Tensor>> full =
          exit_code == kWorkerOk ? state->gather_full_model(*coll)
                                 : StatusOr<std::vector<at::Tensor>>(Status::internal(failure));
      if (exit_code == kWorkerOk && collective_ok(full.status()) && o.rank == 0) {
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
    if (exit_code == kWorkerOk && !o.save_state.empty()) {
      const StatusOr<Checkpoint> saved =
          gather_checkpoint(*state, *coll, o.model, o.optimizer, step);
      if (collective_ok(saved.status()) && o.rank == 0) {
        check(write_checkpoint(o.save_state, *saved));
        std::printf("%s: saved the state after step %llu to %s\n", tag.c_str(),
                    static_cast<unsigned long long>(step), checkpoint_path(o.save_state).c_str());
      }
    }
    // The run summary: the switches' pauses and staging times are the largest over the ranks,
    // their bytes the sum (every rank takes part).
    if (exit_code == kWorkerOk && !o.summary_json.empty()) {
      const auto n = static_cast<std::int64_t>(switches.size());
      at::Tensor worst = at::zeros({2 * n + 1}, at::kDouble);
      at::Tensor bytes = at::zeros({n + 1}, at::kDouble);
      for (std::int64_t i = 0; i < n; ++i) {
        worst[i].fill_(switches[static_cast<std::size_t>(i)].pause_ms);
        worst[n + i].fill_(switches[static_cast<std::size_t>(i)].staged_ms);
        bytes[i].fill_(static_cast<double>(switches[static_cast<std::size_t>(i)].bytes_sent));
      }
      std::vector<at::Tensor> bt{bytes};
      if (collective_ok(coll->all_reduce_max(worst)) && collective_ok(coll->all_reduce_sum(bt)) &&
          o.rank == 0) {
        RunSummary sum;
        sum.first_step = first_step;
        sum.steps = step - first_step;
        sum.samples = sum.steps * static_cast<std::uint64_t>(o.global_batch);
        sum.train_s = step_end_times.empty() ? 0 : step_end_times.back() - train_start_s;
        sum.layout = layout_text(layout);
        sum.started_unix_s = static_cast<double>(started_ns) / 1e9;
        sum.first_step_end_unix_s = static_cast<double>(first_step_end_ns) / 1e9;
        sum.last_step_end_unix_s = static_cast<double>(last_step_end_ns) / 1e9;
        double previous = train_start_s;
        for (double end : step_end_times) {
          sum.step_ms.push_back((end - previous) * 1000);
          sum.step_end_s.push_back(end);
          previous = end;
        }
        std::lock_guard lock(staging_steps.mu);
        for (std::int64_t i = 0; i < n; ++i) {
          const SwitchRecord& r = switches[static_cast<std::size_t>(i)];
          SwitchSummary w;
          w.plan_id = r.plan_id;
          w.layout = r.layout;
          w.at_step = r.at_step;
          w.pause_ms = worst[i].item<double>();
          w.staged_ms = worst[n + i].item<double>();
          w.bytes_moved = static_cast<std::uint64_t>(bytes[i].item<double>());
          if (const auto at = staging_steps.by_plan.find(r.plan_id);
              at != staging_steps.by_plan.end()) {
            w.prepared_at_step = at->second.first;
            w.ready_at_step = at->second.second;
          }
          sum.switches.push_back(w);
        }
        check(write_run_summary(o.summary_json, sum));
      }
    }
  } catch (const c10::Error& e) {
    failure = e.what_without_backtrace();
    exit_code = kWorkerCollectiveFailed;
  } catch (const std::exception& e) {
    failure = e.what();
    exit_code = 1;
  }
  if (releaser.joinable()) releaser.join();
  if (exit_code == kWorkerCollectiveFailed && store) {
    // Name the rank that is gone: a pipeline or tensor-parallel job cannot go on without it.
    const std::string lost = unanswered_ranks(
        *store, o.rank, o.world_size,
        std::chrono::milliseconds(static_cast<std::int64_t>(
            std::min(5.0, o.collective_timeout_s) * 1000)));
    if (!lost.empty()) failure += " (lost: " + lost + ", no answer in the job's store)";
  }
  if (exit_code != kWorkerOk)
    std::fprintf(stderr, "%s: stopping at step %llu: %s\n", tag.c_str(),
                 static_cast<unsigned long long>(step), failure.c_str());
  if (o.rank == 0 && exit_code == kWorkerOk && (!layout.pure_data_parallel() || !switches.empty()))
    std::printf("%s: layout %s, %llu steps, final loss %.6f\n", tag.c_str(),
                layout_text(layout).c_str(), static_cast<unsigned long long>(step), last_loss);

  if (!o.record.empty()) {
    std::ofstream out(expand_rank(o.record, o.rank));
    if (!out) throw InputError("--record '" + o.record + "': cannot write");
    trace::write_telemetry(recorded, out);
  }
  if (bus) {
    transport::Shutdown bye;
    bye.reason = exit_code == kWorkerOk ? "rank " + std::to_string(o.rank) + " finished at step " +
                                              std::to_string(step)
                                        : ("rank " + std::to_string(o.rank) + " failed at step " +
                                           std::to_string(step) + ": " + failure)
                                              .substr(0, transport::kMaxTextBytes);
    bus->send(bye);
    bus->flush(2000);
  }
  std::fflush(stdout);
  // After a failed collective the process groups may still wait on a dead peer in their
  // destructors; leave them to the process exit instead.
  if (exit_code != kWorkerOk) {
    (void)state.release();
    (void)coll.release();
  }
  return exit_code;
}

}  // namespace

}  // namespace parapilot::live
