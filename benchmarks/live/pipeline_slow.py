#!/usr/bin/env python3
"""A pipeline job with one stage slowed part way through: deploy, no agent, the best static split.

    /opt/parapilot/torch2/bin/python benchmarks/live/pipeline_slow.py [--build build]
        [--steps 300] [--slow-from 60] [--slow-until 210] [--json FILE]

A 4-stage GPT-like job (tests/python/pipeline_models.py: an embedding block, 8 transformer blocks
of width 128, a head block; Adam; 1f1b, 8 micro-batches of 2 sequences of 32 tokens) on 4 Gloo
ranks on the CPU, starting on the even split 3,3,2,2. Each block's forward also waits --device-ms
per micro-batch, as if it ran on a device: 4 ranks share 2 cores here (and other jobs), so
without it the CPU, not the pipeline, sets the step. From step --slow-from to --slow-until,
rank 2's forward (its compute and its device time) is 3 times slower, whichever blocks it holds
(pipeline_worker.py's slowdown).
Three runs of the same steps:

* deploy: `parapilot deploy` (its default policy) beside the job;
* no agent: the even split throughout;
* static: the split for the slowed phase, fixed from the start: the split deploy ran at the
  end of the slowed phase, or 3,3,1,3 (one block off the slowed stage) when deploy moved nothing.

Throughput (samples/s) per phase = global batch / median step wall time (rank 0's steps; the
first 10 steps of each phase left out: start-up and the switch to the phase), before, during and
after the slowdown, and the splits deploy committed (step, split). A phase deploy switched in is
also given per split (each split's steps in it: their count and throughput), and deploy's
decisions that were not `keep` (step, action, policy, predicted gain, target split, reason), so
that a phase's figure can be told apart into the machine's drift and deploy's moves. Nothing is
asserted: speed depends on the machine. --json writes the figures in the envelope of
scripts/run-results.py.
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "python")
sys.dont_write_bytecode = True  # the modules below are the source tree's: leave no caches in it
from bench_report import run_results  # noqa: E402  (the report envelope)
sys.path.insert(0, TESTS)
import harness  # noqa: E402  (tests/python: launches, secrets, free ports)
from test_pytorch_job import Deploy  # noqa: E402  (deploy beside a job, its JSON lines)

WORLD = 4
EVEN = [3, 3, 2, 2]
GLOBAL_BATCH = 16


def run(a, split, env=None):
    """One run; rank 0's per-step records and every rank's final split."""
    cfg = {"model": "gpt", "blocks": 8, "width": 128, "global_batch": GLOBAL_BATCH,
           "micro_batches": 8, "schedule": "1f1b", "optimizer": "adam", "split": split,
           "steps": a.steps, "slow_stage": 2, "slow_factor": 3.0, "slow_from": a.slow_from,
           "slow_until": a.slow_until, "device_ms": a.device_ms}
    res = harness.launch(WORLD, cfg, env_extra=env, timeout=1800,
                         worker="pipeline_worker.py").wait()
    return res[0]["records"]


def bounds(a):
    """The phases' steps, [lo, hi): before, during and after the slowdown."""
    return {"before": (10, a.slow_from), "during": (a.slow_from + 10, a.slow_until),
            "after": (a.slow_until + 10, a.steps)}


def phases(a, records):
    """Samples/s per phase: before, during and after the slowdown."""
    out = {}
    for name, (lo, hi) in bounds(a).items():
        walls = [r["wall_ms"] for r in records if lo <= r["step"] < hi]
        out[name] = GLOBAL_BATCH / (statistics.median(walls) / 1e3) if walls else None
    return out


def phases_by_split(a, records):
    """Per phase that ran more than one split: each split's steps and samples/s in it."""
    out = {}
    for name, (lo, hi) in bounds(a).items():
        walls = {}
        for r in records:
            if lo <= r["step"] < hi:
                walls.setdefault(",".join(map(str, r["split"])), []).append(r["wall_ms"])
        if len(walls) > 1:
            out[name] = [{"split": k, "steps": len(v),
                          "samples_per_s": GLOBAL_BATCH / (statistics.median(v) / 1e3)}
                         for k, v in walls.items()]
    return out


def with_deploy(a):
    secret = harness.SecretFile()
    deploy = Deploy(a.parapilot, harness.free_port(), secret.path)
    try:
        records = run(a, EVEN, {"PARAPILOT_AGENT": deploy.address,
                                "PARAPILOT_SECRET_FILE": secret.path})
    finally:
        deploy.stop()
        secret.close()
    changes, last = [], EVEN
    for r in records:
        if r["split"] != last:
            changes.append({"step": r["step"], "split": r["split"]})
            last = r["split"]
    moves = [{k: e.get(k) for k in ("step", "action", "policy", "predicted_gain", "target_split",
                                    "split", "reason")}
             for e in deploy.events("decision") if e.get("action") != "keep"]
    return records, changes, len(deploy.events("decision")), moves


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--slow-from", type=int, default=60)
    ap.add_argument("--slow-until", type=int, default=210)
    ap.add_argument("--device-ms", type=float, default=4.0,
                    help="device time of each block's forward per micro-batch (0: none)")
    ap.add_argument("--json", default="", help="write the report here")
    a = ap.parse_args(argv)
    a.parapilot = os.path.join(os.path.abspath(a.build), "parapilot")
    if not os.path.exists(a.parapilot):
        ap.error(f"no {a.parapilot} (cmake --build {a.build} --target parapilot)")
    results = run_results()
    report = results.envelope("benchmarks/live/pipeline_slow.py", argv)
    deploy_records, changes, decisions, moves = with_deploy(a)
    during = [c for c in changes if c["step"] < a.slow_until]
    static = during[-1]["split"] if during else [3, 3, 1, 3]
    runs = {"deploy": phases(a, deploy_records),
            "no agent": phases(a, run(a, EVEN)),
            "static %s" % ",".join(map(str, static)): phases(a, run(a, static))}
    for name, p in runs.items():
        print(f"{name:>16}: " + ", ".join(f"{k} {v:.1f}" for k, v in p.items()) + " samples/s")
    print("deploy's splits: " + ("; ".join(f"step {c['step']} {c['split']}" for c in changes)
                                 or "none"))
    figures = {"steps": a.steps, "device_ms": a.device_ms, "slow_from": a.slow_from, "slow_until": a.slow_until,
               "slow_factor": 3.0, "slow_stage": 2, "start_split": EVEN, "static_split": static,
               "static_from_deploy": bool(during), "deploy_splits": changes,
               "deploy_decisions": decisions, "deploy_moves": moves,
               "deploy_by_split": phases_by_split(a, deploy_records),
               "runs": [{"run": k, **v} for k, v in runs.items()]}
    if a.json:
        results.finish(report, figures, a.json)


if __name__ == "__main__":
    main(sys.argv[1:])
