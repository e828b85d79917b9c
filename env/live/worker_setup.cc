// The worker's flags, torchrun environment and corpus (no libtorch here).
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "env/live/checkpoint.h"
#include "env/live/collective_backends.h"
#include "env/live/layout.h"
#include "env/live/worker.h"
#include "core/error.h"
#include "transport/auth.h"

namespace parapilot::live {

namespace {

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi)
    throw InputError(std::string("environment variable ") + name + "='" + v +
                     "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "]");
  return static_cast<int>(x);
}

}  // namespace

namespace {

void read_env_or_throw(WorkerOptions& o) {
  o.world_size = env_int("WORLD_SIZE", o.world_size, 1, 1 << 20);
  o.rank = env_int("RANK", o.rank, 0, o.world_size - 1);
  o.local_rank = env_int("LOCAL_RANK", o.local_rank, 0, 1 << 20);
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') o.master_addr = a;
  o.master_port = env_int("MASTER_PORT", o.master_port, 1, 65535);
}

}  // namespace

namespace {

void validate_or_throw(const WorkerOptions& o) {
  check(validate(o.model));
  if (const Status st = collective_backends().find_selectable(o.backend).status(); !st.ok())
    throw InputError("--backend: " + st.message());
  if (const Status st = collective_backends().find_built(o.backend).status(); !st.ok())
    throw InputError("--backend: " + st.message());
  if (o.global_batch < 1) throw InputError("--global-batch: must be >= 1");
  if (o.microbatch < 1 || o.global_batch % o.microbatch != 0)
    throw InputError("--microbatch: must be >= 1 and divide --global-batch");
  if (o.steps < 0) throw InputError("--steps: must be >= 0");
  if (o.max_seconds < 0) throw InputError("--max-seconds: must be >= 0");
  if (!(o.lr > 0)) throw InputError("--lr: must be > 0");
  if (o.optimizer != "adam" && o.optimizer != "sgd") throw InputError("--optimizer: adam or sgd");
  if (o.switch_transfer != "streamed" && o.switch_transfer != "at-boundary")
    throw InputError("--switch-transfer: streamed or at-boundary, not '" + o.switch_transfer + "'");
  if (!(o.topk_ratio > 0 && o.topk_ratio <= 1)) throw InputError("--topk-ratio: must be in (0, 1]");
  if (o.powersgd_rank < 1) throw InputError("--powersgd-rank: must be >= 1");
  if (o.bucket_bytes < 0) throw InputError("--bucket-bytes: must be >= 0");
  if (o.threads < 1) throw InputError("--threads: must be >= 1");
  if (o.telemetry_every < 1) throw InputError("--telemetry-every: must be >= 1");
  if (!(o.collective_timeout_s > 0)) throw InputError("--collective-timeout: must be > 0");
  if (o.slow_factor < 1) throw InputError("--slow: must be >= 1");
  if (o.link_delay_ms < 0) throw InputError("--link-delay-ms: must be >= 0");
  if (o.slow_at_step < -1 || o.link_delay_at_step < -1)
    throw InputError("--slow-at-step and --link-delay-at-step: a step >= 0");
  if (o.slow_for_steps == 0 || o.slow_for_steps < -1 || o.link_delay_for_steps == 0 ||
      o.link_delay_for_steps < -1)
    throw InputError("--slow-for-steps and --link-delay-for-steps: a number of steps >= 1");
  if (o.link_cut_at_step < -1) throw InputError("--link-cut-at-step: a step >= 0");
  if (o.stage_delay_ms < 0 || o.stage_delay_ms > 600000)
    throw InputError("--stage-delay-ms: must be in [0, 600000]");
  const LiveLayout layout = take(parse_layout(o.layout, o.world_size, o.model));
  if (!o.secret_file.empty()) {  // read again at connection time; refused here before any start
    const auto secret = transport::load_secret_from_file(o.secret_file);
    if (!secret.ok()) throw InputError("--secret-file: " + secret.status().message());
  }
  // The checkpoint's header and size (the payload's checksum is checked when it is loaded).
  if (!o.load_state.empty()) (void)take(read_checkpoint(o.load_state, o.model, o.optimizer, true));
  if (!o.shares.empty() &&
      take(parse_shares(o.shares)).size() != static_cast<std::size_t>(layout.dp))
    throw InputError(layout.pure_data_parallel()
                         ? "--shares: needs one share per rank (" + std::to_string(o.world_size) + ")"
                         : "--shares: needs one share per data-parallel replica (" +
                               std::to_string(layout.dp) + ")");
  if (o.compression != "auto") {
    const auto list = take(parse_compression_list(o.compression));
    const std::size_t layers = model_layers(o.model).size();
    if (list.size() != 1 && list.size() != layers)
      throw InputError("--compression: give one kind or one per layer (" + std::to_string(layers) +
                       ")");
  }
}

}  // namespace

void add_worker_flags(CLI::App& cmd, WorkerOptions& o) {
  // A flag given twice takes the last value (launchers append to a common set of flags).
  cmd.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd.add_option("--backend", o.backend, "Collective backend: gloo (CPU) or nccl (GPU)")
      ->capture_default_str();
  cmd.add_option("--model", o.model.kind, "transformer or mlp (byte-level language models)")
      ->capture_default_str();
  cmd.add_option("--layers", o.model.layers, "Transformer blocks / MLP hidden layers")
      ->capture_default_str();
  cmd.add_option("--d-model", o.model.d_model, "Embedding width")->capture_default_str();
  cmd.add_option("--heads", o.model.heads, "Attention heads")->capture_default_str();
  cmd.add_option("--seq-len", o.model.seq_len, "Bytes per sequence")->capture_default_str();
  cmd.add_option("--context", o.model.context, "Bytes the MLP sees per prediction")
      ->capture_default_str();
  cmd.add_option("--global-batch", o.global_batch, "Sequences per step over all ranks")
      ->capture_default_str();
  cmd.add_option("--microbatch", o.microbatch, "Sequences per microbatch")->capture_default_str();
  cmd.add_option("--steps", o.steps, "Steps to train (0 = until the agent says stop)")
      ->capture_default_str();
  cmd.add_option("--max-seconds", o.max_seconds, "Stop after this wall time (0 = no limit)")
      ->capture_default_str();
  cmd.add_option("--lr", o.lr, "Learning rate")->capture_default_str();
  cmd.add_option("--optimizer", o.optimizer, "adam or sgd")->capture_default_str();
  cmd.add_option("--seed", o.seed, "Seed of the model and the data order (same on all ranks)")
      ->capture_default_str();
  cmd.add_option("--corpus", o.corpus, "Text file or folder to train on (default: generated text)");
  cmd.add_option("--layout", o.layout,
                 "Start layout, e.g. dp=2,tp=1,pp=2,stages=[1,3] (default: dp = world size)");
  cmd.add_option("--shares", o.shares,
                 "Initial per-replica batch shares, e.g. 0.75,0.25 (default uniform)");
  cmd.add_option("--compression", o.compression,
                 "Gradient compression: none, fp16, topk, powersgd, auto, or one per layer")
      ->capture_default_str();
  cmd.add_option("--topk-ratio", o.topk_ratio, "Fraction of elements top-k sends")
      ->capture_default_str();
  cmd.add_option("--powersgd-rank", o.powersgd_rank, "PowerSGD rank")->capture_default_str();
  cmd.add_option("--bucket-bytes", o.bucket_bytes, "All-reduce bucket size (0 = per layer)")
      ->capture_default_str();
  cmd.add_option("--threads", o.threads, "Intra-op threads")->capture_default_str();
  cmd.add_option("--agent", o.agent, "HOST:PORT of the agent's bus server (telemetry, actions)");
  cmd.add_option("--secret-file", o.secret_file, "File holding the bus shared secret");
  cmd.add_option("--telemetry-every", o.telemetry_every, "Publish telemetry every N steps")
      ->capture_default_str();
  cmd.add_option("--record", o.record, "Write this rank's telemetry CSV ({rank} expands)");
  cmd.add_option("--loss-log", o.loss_log, "Rank 0 writes step,loss,tokens,dp_bytes,step_s CSV");
  cmd.add_option("--dump-params", o.dump_params,
                 "Rank 0 writes the whole model's final parameters (raw float32, model order; "
                 "give it to every rank)");
  cmd.add_option("--summary-json", o.summary_json,
                 "Rank 0 writes a JSON run summary: steps, samples, throughput, final layout, "
                 "switches (give it to every rank)");
  cmd.add_option("--dump-feedback", o.dump_feedback,
                 "At each layout switch rank 0 writes the compressors' residuals summed over the "
                 "replicas, before and after the move, into this folder (raw float32, model "
                 "order; give it to every rank)");
  cmd.add_option("--save-state", o.save_state,
                 "At the end, save the whole model's parameters, Adam state, compressors' "
                 "residuals and PowerSGD bases, and next step to this folder, "
                 "layout-independently (give it to every rank)");
  cmd.add_option("--load-state", o.load_state,
                 "Resume from a --save-state folder under this run's layout (the step counter "
                 "and the data order continue)");
  cmd.add_option("--collective-timeout", o.collective_timeout_s,
                 "Seconds before a collective fails")
      ->capture_default_str();
  cmd.add_option("--rendezvous-timeout", o.rendezvous_timeout_s, "Seconds to wait for all ranks")
      ->capture_default_str();
  cmd.add_option("--slow", o.slow_factor, "Fault: compute takes this many times as long");
  cmd.add_option("--slow-at", o.slow_at_s, "Fault: slowdown starts this many seconds in");
  cmd.add_option("--slow-for", o.slow_for_s, "Fault: slowdown lasts this many seconds");
  cmd.add_option("--slow-at-step", o.slow_at_step,
                 "Fault: slowdown starts at this training step (instead of --slow-at)");
  cmd.add_option("--slow-for-steps", o.slow_for_steps,
                 "Fault: with --slow-at-step, slowdown lasts this many steps");
  cmd.add_option("--switch-transfer", o.switch_transfer,
                 "Layout switches move the state streamed (ahead of the boundary, kept current) "
                 "or at-boundary")
      ->capture_default_str();
  cmd.add_option("--stage-delay-ms", o.stage_delay_ms,
                 "Test hook: staging a layout change waits this long first");
  cmd.add_option("--link-delay-ms", o.link_delay_ms,
                 "Fault: delay before each gradient collective");
  cmd.add_option("--link-delay-at", o.link_delay_at_s,
                 "Fault: link delay starts this many seconds in");
  cmd.add_option("--link-delay-for", o.link_delay_for_s,
                 "Fault: link delay lasts this many seconds");
  cmd.add_option("--link-delay-at-step", o.link_delay_at_step,
                 "Fault: link delay starts at this training step (instead of --link-delay-at)");
  cmd.add_option("--link-delay-for-steps", o.link_delay_for_steps,
                 "Fault: with --link-delay-at-step, link delay lasts this many steps");
  cmd.add_option("--link-cut-at-step", o.link_cut_at_step,
                 "Fault: at this step's boundary, cut this rank's connections to its peers (its "
                 "process, bus and store connection live on)");
}

Status read_torchrun_env(WorkerOptions& o) {
  return catch_input_error([&] { read_env_or_throw(o); });
}

Status validate(const WorkerOptions& o) {
  return catch_input_error([&] { validate_or_throw(o); });
}

int worker_main(int argc, char** argv) {
  // A peer that died must fail the collective writing to it (exit kWorkerCollectiveFailed), not
  // kill this worker: Gloo's sockets write without MSG_NOSIGNAL.
  std::signal(SIGPIPE, SIG_IGN);
  WorkerOptions o;
  CLI::App app{"parapilot worker"};
  add_worker_flags(app, o);
  try {
    app.parse(argc, argv);
    check(read_torchrun_env(o));
    return take(run_worker(o));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const InputError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}

}  // namespace parapilot::live
