// parapilot worker: one rank of a real training job (libtorch) of a small byte-level language
// model under a hybrid layout dp x tp x pp (layout.h; pure data parallel by default), with
// c10d's ProcessGroupGloo on CPU (or our thin NCCL layer on GPUs), rendezvous through c10d's
// TCPStore, telemetry on the bus and repartition actions applied at iteration boundaries.
// Configured like torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
//
// Determinism: for a seed, the global batch of every step (which sequences, in which
// microbatches) does not depend on the layout, the number of ranks or their shares; each
// replica's gradient is its microbatches' loss gradients divided by the step's microbatch count,
// so the summed gradient equals the single-process full-batch gradient.
#pragma once

#include <cstdint>
#include <limits>
#include <string>

#include <CLI/CLI.hpp>

#include "core/status.h"

#include "env/live/action.h"

namespace parapilot::live {

struct WorkerOptions {
  // torchrun environment (worker_options_from_env fills these).
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;

  std::string backend = "gloo";  ///< "gloo" (CPU) or "nccl" (GPU; needs a CUDA/NCCL build).
  ModelConfig model;
  /// Start layout, "dp=2,tp=1,pp=2,stages=[1,3]" (parse_layout); empty = dp = world size.
  std::string layout;
  /// How a layout switch moves the state other ranks need: "streamed" (ahead of the boundary,
  /// kept current step by step; layout_switch.h) or "at-boundary" (all of it at the switch).
  std::string switch_transfer = "streamed";
  int global_batch = 16;    ///< sequences per step, over all ranks.
  int microbatch = 2;       ///< sequences per microbatch; must divide global_batch.
  std::int64_t steps = 50;  ///< steps to train; 0 = until the agent sends Shutdown.
  double max_seconds = 0;   ///< stop after this much wall time (rank 0 decides); 0 = no limit.
  double lr = 3e-3;
  std::string optimizer = "adam";  ///< "adam" or "sgd".
  std::uint64_t seed = 1;
  std::string corpus;                ///< file or folder of text; empty = a generated corpus.
  std::string shares;  ///< initial per-replica shares "0.5,0.25,0.25"; empty = uniform.
  std::string compression = "none";  ///< "none", "fp16", "topk", "powersgd", "auto" or a list.
  double topk_ratio = 0.01;
  int powersgd_rank = 4;
  std::int64_t bucket_bytes = 1 << 20;
  int threads = 1;  ///< intra-op threads.

  std::string agent;        ///< HOST:PORT of the agent's bus server; empty = no bus.
  std::string secret_file;  ///< bus shared secret.
  int telemetry_every = 1;  ///< publish telemetry every N steps.
  std::string record;    ///< telemetry CSV (env/trace/telemetry.h) of this rank; "{rank}" expands.
  std::string loss_log;  ///< CSV: step,loss,tokens,dp_bytes,step_s (rank 0 writes it).
  /// Raw float32 parameters of the whole model after training, model order, whatever the
  /// layout (rank 0 writes it; every rank must be given it: all take part in the gather).
  std::string dump_params;
  /// Folder: at each layout switch rank 0 writes what the compressors owe, summed over the
  /// replicas, in the old layout (feedback-before-STEP.bin) and in the new one just after the
  /// move (feedback-after-STEP.bin): raw float32, model order, zeros where nothing is owed.
  /// Every rank must be given it (all take part in the gathers). A test and debugging aid.
  std::string dump_feedback;
  /// JSON run summary (env/live/run_summary.h; rank 0 writes it; every rank must be given it:
  /// all take part in the reduction of the switches' figures).
  std::string summary_json;
  /// Checkpoint folder (env/live/checkpoint.h, a TrainingState): at the end every rank takes part in gathering
  /// the whole model's parameters, optimizer state and error feedback (feedback_state.h),
  /// which rank 0 writes with the next step.
  std::string save_state;
  /// Checkpoint folder to resume from: every rank reads it before the rendezvous and takes its
  /// own shards under its layout; training resumes at the saved next step (--steps counts from
  /// step 0, so a resumed run trains steps next_step .. steps - 1).
  std::string load_state;
  double collective_timeout_s = 30;  ///< a collective taking longer fails the worker.
  double rendezvous_timeout_s = 60;

  // Fault injection (parapilot launch --inject passes these to one rank).
  double slow_factor = 1;  ///< compute takes this many times as long (sleep (f-1) x compute).
  double slow_at_s = 0;
  double slow_for_s = std::numeric_limits<double>::infinity();
  double link_delay_ms = 0;  ///< added before each gradient collective call.
  double link_delay_at_s = 0;
  double link_delay_for_s = std::numeric_limits<double>::infinity();
  /// In training steps instead of seconds when at_step >= 0 (for_steps -1: to the end).
  std::int64_t slow_at_step = -1, slow_for_steps = -1;
  std::int64_t link_delay_at_step = -1, link_delay_for_steps = -1;
  /// At this step's boundary (-1: never) the rank shuts down every connection of its process
  /// groups (link_cut.h; its process, its bus and its store connection live on): as the state
  /// starts to move when a layout switch happens at that boundary, else once the boundary's
  /// agreement is done. Its peers' collectives with it fail, and so do its own.
  std::int64_t link_cut_at_step = -1;
  /// Test hook: staging a layout change waits this long before building the new layout (so
  /// that a test can abort a plan while it is staging). 0 = none.
  double stage_delay_ms = 0;
};

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT into `o` (missing: defaults for
/// a single process). kInvalidArgument naming the variable on a bad value.
Status read_torchrun_env(WorkerOptions& o);
/// Checks option ranges: kInvalidArgument naming the flag.
Status validate(const WorkerOptions& o);

/// Adds the worker's flags to `cmd`.
void add_worker_flags(CLI::App& cmd, WorkerOptions& o);

/// Exit codes of run_worker.
inline constexpr int kWorkerOk = 0;
/// A peer died, a link to a peer broke or a collective timed out: the rank stops at the step it
/// was in, naming what its peers reported (lost ranks, cut links), and no layout is half
/// installed (the switch installs the new layout only once its state has moved).
inline constexpr int kWorkerCollectiveFailed = 3;

/// Trains until the step budget, the time budget or a Shutdown from the agent. Returns an exit
/// code (kWorkerOk, kWorkerCollectiveFailed), or kInvalidArgument for bad options, a missing
/// corpus or an unwritable log, and the bus's Status when the agent cannot be reached.
StatusOr<int> run_worker(const WorkerOptions& o);

/// `argv` = {prog, flags...}: parses the worker flags plus the torchrun environment and runs.
/// Used by the test and benchmark programs, which exec themselves as workers.
int worker_main(int argc, char** argv);

}  // namespace parapilot::live
