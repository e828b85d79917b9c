// The worker's start (libtorch): its inputs, the rendezvous, this rank's part of the layout and
// the starting plan (worker_run.h).
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iomanip>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/error.h"
#include "env/live/checkpoint_state.h"
#include "env/live/corpus.h"
#include "env/live/worker_run.h"

namespace parapilot::live {

double seconds_since(WorkerClock::time_point t0) {
  return std::chrono::duration<double>(WorkerClock::now() - t0).count();
}

std::uint64_t wall_ns() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

bool WorkerRun::collective_ok(const Status& st) {
  if (st.ok()) return true;
  failure = st.message();
  exit_code = kWorkerCollectiveFailed;
  return false;
}

void load_inputs(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  run.backend = take(collective_backends().find_built(o.backend));
  run.corpus = load_corpus(o.corpus);
  run.seq_bytes = o.model.seq_len + 1;
  if (static_cast<std::int64_t>(run.corpus.size()) < run.seq_bytes + 1)
    throw InputError("--corpus: too short for --seq-len " + std::to_string(o.model.seq_len));
  run.corpus_t = at::from_blob(const_cast<char*>(run.corpus.data()),
                               {static_cast<std::int64_t>(run.corpus.size())}, at::kByte)
                     .to(at::kLong);
  run.layout = take(parse_layout(o.layout, o.world_size, o.model));
  run.layers = model_layers(o.model);
  // A checkpoint to resume from is read and checked before the rendezvous, so that a bad one
  // fails every rank alike (exit code 2) and none waits for the others.
  if (!o.load_state.empty())
    run.resumed = take(read_checkpoint(o.load_state, o.model, o.optimizer));
  run.first_step = run.resumed ? run.resumed->next_step : 0;
  if (o.rank == 0 && !o.save_state.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(o.save_state, ec);
    if (ec || !std::filesystem::is_directory(o.save_state))
      throw InputError("--save-state '" + o.save_state + "': cannot create the folder");
  }
}

namespace {

// Rendezvous and the world group (control, loss and the gathered dump). An exit code when it
// fails.
std::optional<int> make_world_group(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  const std::string& tag = run.tag;
  run.group_options.timeout_s = o.collective_timeout_s;
  run.group_options.master_addr = o.master_addr;
  if (o.world_size == 1 && run.backend.alone_in_process && std::getenv("MASTER_PORT") == nullptr) {
    run.coll = make_local_collectives();
    return std::nullopt;
  }
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(o.master_port);
  so.isServer = o.rank == 0;
  so.numWorkers = static_cast<std::size_t>(o.world_size);
  so.waitWorkers = true;
  so.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.rendezvous_timeout_s * 1000));
  try {
    run.store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: rendezvous at %s:%d failed: %s\n", tag.c_str(),
                 o.master_addr.c_str(), o.master_port, e.what_without_backtrace());
    return kWorkerCollectiveFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: rendezvous at %s:%d failed: %s\n", tag.c_str(),
                 o.master_addr.c_str(), o.master_port, e.what());
    return kWorkerCollectiveFailed;
  }
  // A backend that needs CUDA binds LOCAL_RANK modulo the visible devices.
  const StatusOr<int> device = backend_device(run.backend, o.local_rank);
  if (!device.ok()) throw InputError("--backend " + o.backend + ": " + device.status().message());
  run.device = *device;
  StatusOr<std::unique_ptr<Collectives>> made =
      make_collectives(run.backend, run.store, o.rank, o.world_size, run.group_options, run.device);
  if (!made.ok()) {
    std::fprintf(stderr, "%s: %s\n", tag.c_str(), made.status().message().c_str());
    return kWorkerCollectiveFailed;
  }
  run.coll = std::move(*made);
  return std::nullopt;
}

}  // namespace

std::optional<int> join_job(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  if (const std::optional<int> failed = make_world_group(run)) return failed;

  // This rank's part of the layout: groups, stage model, optimizer, gradient reduction.
  LayoutStateOptions& lo = run.lo;
  lo.model = o.model;
  lo.seed = o.seed;
  lo.optimizer = o.optimizer;
  lo.lr = o.lr;
  lo.backend = o.backend;
  lo.device = run.device;
  lo.groups = run.group_options;
  StatusOr<std::unique_ptr<LayoutState>> built =
      LayoutState::build(run.layout, o.rank, *run.coll, run.store, lo);
  if (!built.ok()) {
    std::fprintf(stderr, "%s: %s\n", run.tag.c_str(), built.status().message().c_str());
    (void)run.coll.release();
    return kWorkerCollectiveFailed;
  }
  run.state = std::move(*built);
  if (run.resumed) {
    install_checkpoint(*run.state, *run.resumed);
    run.resumed.reset();
  }
  run.me = run.state->coords();
  run.current.set(run.layout);
  return std::nullopt;
}

void configure_plan(WorkerRun& run) {
  const WorkerOptions& o = run.o;
  const LiveLayout& layout = run.layout;
  run.shares = o.shares.empty() ? std::vector<double>(static_cast<std::size_t>(layout.dp),
                                                      1.0 / layout.dp)
                                : take(parse_shares(o.shares));
  run.microbatch = o.microbatch;
  run.gsync = &run.state->gradient_sync();
  if (o.compression == "auto") {
    run.full_compression =
        select_compression(run.layers, {}, SelectorOptions{.powersgd_rank = o.powersgd_rank});
  } else {
    run.full_compression = take(parse_compression_list(o.compression));
    if (run.full_compression.size() == 1)
      run.full_compression.assign(run.layers.size(), run.full_compression[0]);
  }
  check(run.gsync->configure(run.state->local_entries(run.full_compression), o.topk_ratio,
                             o.powersgd_rank, o.bucket_bytes));
  run.topk_ratio = o.topk_ratio;
  run.powersgd_rank = o.powersgd_rank;
  run.bucket_bytes = o.bucket_bytes;
  run.model = &run.state->model();
  run.params = run.model->parameters();
  run.opt = &run.state->optimizer();
  run.reports_loss = run.model->last_stage() && run.me.tp == 0;

  if (o.rank == 0 && !o.loss_log.empty()) {
    run.loss_log.open(o.loss_log);
    if (!run.loss_log) throw InputError("--loss-log '" + o.loss_log + "': cannot write");
    run.loss_log << "step,loss,tokens,dp_bytes,step_s\n";
    run.loss_log << std::setprecision(9);
  }
}

}  // namespace parapilot::live
