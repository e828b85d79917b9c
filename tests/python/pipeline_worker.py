"""A pipeline-parallel training job for the tests and benchmarks: one process per stage,
torchrun's environment variables, a JSON config in argv[1]; writes a JSON result per rank
(out.<rank>.json) and, with final_prefix, the rank's block states at the end
(final_prefix.<rank>, pipeline_state.save_blocks).

Config keys: model ("mlp" or "gpt"), blocks (mlp: blocks; gpt: transformer layers), width,
steps, global_batch, micro_batches, schedule, split, optimizer ("adam", "sgd": SGD with momentum),
stream (PipelineSession's; default true), save_at (stop before that step and save a checkpoint
to save_prefix.<rank>), resume_prefix (start from those checkpoints), holds ([[step, file],
...]: before each step wait, outside steps, until its file exists, up to 120 s), gate_step /
gate_file (before gate_step wait, outside steps, until gate_file exists and then until a plan is
committed, up to 120 s), device_ms (every block's forward waits that long per micro-batch:
device time), slow_stage / slow_factor / slow_from / slow_until (that stage's blocks sleep
(factor - 1) x their forward time in each forward from step slow_from to slow_until),
final_prefix, out.

The result holds the session's log lines ("log"). A rank whose session raises PeerLost writes its result with "failed" and exits 3.
"""

import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import pipeline_models as models
from parapilot import pipeline as pp
from parapilot import peer_failure, pipeline_state


class Slowdown:
    """Makes one stage's blocks slower: each forward sleeps (factor - 1) x its own time while
    active (the backward is not slowed; the forward dominates a small model's step here)."""

    def __init__(self, blocks, factor):
        self.factor, self.active = factor, False
        for b in blocks:
            b.register_forward_pre_hook(self._pre)
            b.register_forward_hook(self._post)

    def _pre(self, m, a):
        m._pp_t0 = time.perf_counter()

    def _post(self, m, a, o):
        if self.active:
            time.sleep((self.factor - 1) * (time.perf_counter() - m._pp_t0))


def device_time(blocks, ms):
    """Each block's forward also waits `ms` per micro-batch, as if it ran on a device: the step's
    time is then set by the pipeline, not by how many cores the ranks share."""
    for b in blocks:
        b.register_forward_hook(lambda m, a, o: time.sleep(ms / 1e3))


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kind = cfg.get("model", "mlp")
    width = cfg.get("width", 32)
    if kind == "gpt":
        blocks, loss_fn = models.gpt_blocks(cfg.get("blocks", 6), width), models.gpt_loss
    else:
        blocks, loss_fn = models.mlp_blocks(cfg.get("blocks", 8), width), torch.nn.functional.mse_loss
    if cfg.get("optimizer", "adam") == "adam":
        factory = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    else:
        factory = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    world = dist.get_world_size()
    resume = cfg.get("resume_prefix")
    lines = []  # what the session said, for the result

    def log(level, text):
        lines.append(text)
        if level != "debug":
            print(f"parapilot {level.upper()} {text}", file=sys.stderr, flush=True)
    session = pp.PipelineSession(
        blocks, loss_fn, factory, global_batch=cfg.get("global_batch", 16),
        micro_batches=cfg.get("micro_batches", 4), schedule=cfg.get("schedule", "gpipe"),
        split=cfg.get("split"), stream=cfg.get("stream", True),
        resume_from=[f"{resume}.{r}" for r in range(world)] if resume else None, log=log)
    if cfg.get("device_ms"):
        device_time(blocks, cfg["device_ms"])
    slow = None
    if cfg.get("slow_stage") is not None:
        slow = Slowdown(blocks, cfg.get("slow_factor", 3.0))
    # Wall-clock times (time.time()) for the restart's pause: the first step's start after
    # construction (and loading), and the start of the save.
    records, result = [], {"rank": rank, "t_first_step": time.time()}
    try:
        while session.step_index < cfg["steps"]:
            s = session.step_index
            if s == cfg.get("save_at"):
                result["t_save"] = time.time()
                session.save(f"{cfg['save_prefix']}.{rank}")
                break
            for step, path in cfg.get("holds", []):
                if s == step:
                    with session.outside_steps():
                        wait_file(path)
            if s == cfg.get("gate_step"):
                with session.outside_steps():
                    wait_gate(session, cfg["gate_file"])
            if slow is not None:
                slow.active = (rank == cfg["slow_stage"] and cfg.get("slow_from", 0) <= s
                               < cfg.get("slow_until", 1 << 30))
            t0 = time.perf_counter()
            x, y = models.batch(kind, s, cfg.get("global_batch", 16), width)
            loss = session.step(x, y)
            t = session.last_telemetry
            records.append({"step": s, "wall_ms": (time.perf_counter() - t0) * 1e3,
                            "loss": None if loss is None else float(loss),
                            "split": session.split, "plan": t.counts.get("info/plan"),
                            "compute_ms": t.compute_ms,
                            "p2p_ms": t.collectives["p2p/pp"].ms})
            if session.should_stop:
                break
    except peer_failure.PeerLost as e:
        result["failed"] = str(e)
    info = session.job_info()
    result["job_info"] = {"world_size": info.world_size, "global_batch": info.global_batch,
                          "capabilities": info.capabilities, "framework": info.framework,
                          "layers": [[l.params, l.grad_bytes] for l in info.layers]}
    result.update(records=records, applied_plans=session.applied_plans,
                  switches=[dataclasses.asdict(w) for w in session.switches],
                  split=session.split,
                  held=list(session.held))
    if cfg.get("final_prefix") and "failed" not in result:
        pipeline_state.save_blocks(f"{cfg['final_prefix']}.{rank}", session.block_states(),
                                   session.step_index)
    session.close()
    result["log"] = lines
    with open(f"{cfg['out']}.{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()
    if "failed" in result:
        sys.exit(3)


def wait_file(path, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def wait_gate(session, path, timeout=120.0):
    deadline = time.monotonic() + timeout
    wait_file(path, timeout)
    while session.book.committed_at(1 << 62, session.plan_id) == 0 and \
            time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
