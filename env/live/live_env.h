// The live cluster as an Env (env/env.h): "live:gloo(workers=2, interval_steps=10, horizon=20,
// slow_rank=1, slow_factor=3)". reset(seed) starts a local cluster of real training workers
// (LocalCluster) with that seed; step(action) applies the chosen candidate through the bus at an
// iteration boundary, lets the job run interval_steps steps, and returns the observation built
// from the workers' telemetry and the measured reward. No libtorch here (workers are processes).
//
// Candidates (always 4, all unmasked): 1 uniform shares, 2 elastic shares proportional to the
// measured per-rank speed, 3 adaptive per-layer compression (select_compression on the measured
// gradient statistics), 4 both. Reward: measured tokens/s over the interval divided by the
// compute-bound ideal under the measured speeds (every rank busy all the time, communication
// free), so 1 is unreachable and higher is better. info.best_tokens is that ideal.
//
// Parameters (all optional): workers (2), backend (gloo; the variant), interval_steps (10),
// horizon (20), slow_rank (-1 = none), slow_factor (3), slow_at (seconds, 0), link_delay_rank,
// link_delay_ms, layers, d_model, seq_len, global_batch, microbatch, exe (/proc/self/exe),
// worker_arg ("worker"; the test programs use "--live-worker"), log_dir.
#pragma once

namespace parapilot::live {

/// Registers "live" with the Env registry (idempotent). The CLI calls it at start-up.
void register_live_envs();

}  // namespace parapilot::live
