// The live cluster as an Env (env/env.h): "live:gloo(workers=2, interval_steps=10, horizon=20,
// slow_rank=1, slow_factor=3)". The env is the deploy agent (agent/deploy/agent.h) beside a
// local cluster of real training workers (LocalCluster), with the env's caller as its policy:
// the same Monitor beliefs, build_observation, planner candidates (restricted to what the workers
// can switch: the job described by live_job.h), guardrails and switch protocol that `parapilot
// deploy` runs. No libtorch here (workers are processes).
//
// reset(seed) starts the agent and the workers (that seed) and returns the first decision's
// observation; when the agent cannot listen, the workers cannot be launched, or no decision
// comes within 120 s, it stops whatever it started and returns the error (kUnavailable for the
// last). step(action) answers that decision (0 keep, k candidate k-1; the agent's
// guardrails may still keep), lets the job run to the next decision, interval_steps closed steps
// later, and returns its observation. Call step() promptly: the agent's decision waits for it.
// The run's length (horizon decisions) is known to the agent; there is no cool-down, as in the
// simulator. Reward: measured tokens/s between the two decisions divided by the compute-bound
// ideal under the monitor's per-rank compute rates (every rank busy all the time, communication
// free), so 1 is out of reach and higher is better; info.best_tokens is that ideal.
// Terminated when a rank is lost or no decision comes within 600 s. events() holds the agent's
// migration and monitor log lines.
//
// Parameters (all optional): workers (2), backend (gloo; the variant), interval_steps (10),
// horizon (20), slow_rank (-1 = none), slow_factor (3), slow_at (seconds, 0), link_delay_rank,
// link_delay_ms, layers, d_model, heads, seq_len, global_batch, microbatch, exe (/proc/self/exe),
// worker_arg ("worker"; the test programs use "--live-worker"), log_dir.
#pragma once

namespace parapilot::agent::deploy {

/// Registers "live" with the Env registry (idempotent). The CLI calls it at start-up.
void register_live_envs();

}  // namespace parapilot::agent::deploy
