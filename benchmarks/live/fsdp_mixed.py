#!/usr/bin/env python3
"""An FSDP2 job on devices of mixed speeds, with and without deploy.

    benchmarks/live/fsdp_mixed.py [--rounds 3] [--steps 120] [--build build]
        [--python /opt/parapilot/torch2/bin/python] [--json FILE]

The job is tests/python/fsdp_worker.py's "device" model (job_shapes.Model, every Linear and the
root wrapped with fully_shard, parapilot.pytorch.FSDPSession, the loss scaled by
session.loss_scale), 4 CPU Gloo ranks, global batch 128, on emulated devices whose time is slept
(job_shapes.Device: DEVICE_MS per sample in the forward and backward, DEVICE_OPT_MS per
optimizer step). Rank r's device is FACTORS[r] = 1, 1, 2, 3 times slower per sample (the extra
time is slept in its forward, in proportion to its samples): relative speeds 1, 1, 1/2, 1/3.

Each round runs, in one order rotated from round to round:
  healthy   every device alike, no agent: the fixed part of a step
  none      the mixed devices, no agent (even shares)
  agent     the mixed devices beside `parapilot deploy --listen ADDR --secret-file F`
Per run: the median step of its second half (ms) and the steps per second it gives, the final
shares and (with the agent) deploy's commits. The bound is the throughput if every rank
finished its share at the same time:
  bound step = global batch / sum of speeds x DEVICE_MS + fixed,
  fixed = the healthy run's second-half median step - an even share x DEVICE_MS,
(everything of a step that is not a speed-1 device's per-sample time: the collectives, the host
work, the optimizer). Medians over the rounds; the load average at the start and the end.
Prints the table; --json writes it in the envelope of the other benchmarks (benchmarks/report.h).
Exit code 2 on bad flags, 1 when a run fails.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "python")
sys.dont_write_bytecode = True  # the modules below are the source tree's: leave no caches in it
from bench_report import run_results  # noqa: E402  (the report envelope)
sys.path.insert(0, TESTS)
import harness  # noqa: E402  (tests/python: secrets and free ports)
from job_shapes import DEVICE_MS  # noqa: E402  (the emulated device's time per sample)
from test_pytorch_job import Deploy  # noqa: E402  (deploy beside a job, its JSON lines)

WORKER = os.path.join(TESTS, "fsdp_worker.py")
RANKS = 4
GLOBAL_BATCH = 128
FACTORS = [1.0, 1.0, 2.0, 3.0]
RUNS = ["healthy", "none", "agent"]


def run_job(a, kind, secret, tmp):
    """One launch of fsdp_worker.py; returns rank 0's result and deploy (or None). A launch
    whose rendezvous port another process took between its choice and its use (EADDRINUSE, on
    a shared machine) is run again, once."""
    try:
        return launch_job(a, kind, secret, tmp)
    except PortTaken:
        print("%s run: the rendezvous port was taken; running it again" % kind, file=sys.stderr)
        return launch_job(a, kind, secret, tmp)


class PortTaken(RuntimeError):
    pass


def launch_job(a, kind, secret, tmp):
    cfg = {"model": "device", "steps": a.steps, "global_batch": GLOBAL_BATCH,
           "device_where": "forward",
           "speeds": [1.0] * RANKS if kind == "healthy" else FACTORS,
           "out": os.path.join(tmp, kind)}
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1",
               PARAPILOT_SECRET_FILE=secret.path, PARAPILOT_AGENT="")
    deploy = None
    if kind == "agent":
        deploy = Deploy(a.parapilot, harness.free_port(), secret.path)
        env["PARAPILOT_AGENT"] = deploy.address
    try:
        job = subprocess.run([a.python, "-m", "parapilot.launch", "--nproc", str(RANKS),
                              "--timeout", "600", WORKER, json.dumps(cfg)],
                             env=env, capture_output=True, text=True, timeout=700)
    finally:
        if deploy is not None:
            deploy.stop()
    if job.returncode != 0 and "EADDRINUSE" in job.stderr:
        raise PortTaken(kind)
    if job.returncode != 0:
        raise RuntimeError("%s run failed (exit %d):\n%s" % (kind, job.returncode,
                                                             job.stderr[-4000:]))
    with open(cfg["out"] + ".0.json") as f:
        return json.load(f), deploy


def run_round(a, r, secret, tmp):
    records = []
    for k in range(len(RUNS)):
        kind = RUNS[(k + r) % len(RUNS)]
        res, deploy = run_job(a, kind, secret, tmp)
        steps = res["step_ms"]
        second = statistics.median(steps[len(steps) // 2:])
        rec = {"round": r, "run": kind, "steps": len(steps), "second_half_ms": second,
               "steps_per_s": 1000.0 / second, "final_counts": res["final_counts"],
               "plans_applied": len(res["applied"])}
        if deploy is not None:
            migrations = [e for e in deploy.events("migration") if e.get("outcome") == "committed"]
            rec["commits"] = len(migrations)
            rec["reverts"] = sum(1 for e in migrations if e.get("revert"))
        records.append(rec)
    return records


def bound(healthy_ms):
    """(bound step ms, fixed ms) from a healthy run's second-half median step."""
    even = GLOBAL_BATCH // RANKS
    fixed = max(0.0, healthy_ms - even * DEVICE_MS)
    speeds = sum(1.0 / f for f in FACTORS)
    return GLOBAL_BATCH / speeds * DEVICE_MS + fixed, fixed


def summarize(records):
    by_run = {k: [x for x in records if x["run"] == k] for k in RUNS}
    med = {k: statistics.median(x["second_half_ms"] for x in xs) for k, xs in by_run.items()}
    bound_ms, fixed = bound(med["healthy"])
    return {"second_half_ms": med,
            "steps_per_s": {k: 1000.0 / v for k, v in med.items()},
            "bound_step_ms": bound_ms, "bound_steps_per_s": 1000.0 / bound_ms,
            "fixed_ms": fixed, "sum_of_speeds": sum(1.0 / f for f in FACTORS),
            "agent_over_none": med["none"] / med["agent"],
            "agent_of_bound": bound_ms / med["agent"],
            "final_counts": {k: [x["final_counts"] for x in xs] for k, xs in by_run.items()},
            "commits": sum(x.get("commits", 0) for x in by_run["agent"]),
            "reverts": sum(x.get("reverts", 0) for x in by_run["agent"])}


def print_table(s, rounds):
    print("\nFSDP2, 4 ranks, devices 1, 1, 2, 3x slower per sample; medians over %d round(s)"
          % rounds)
    print("%-22s %12s %10s  %s" % ("run", "2nd half ms", "steps/s", "final shares, by round"))
    names = {"healthy": "healthy (no agent)", "none": "mixed, no agent", "agent": "mixed, deploy"}
    for k in RUNS:
        print("%-22s %12.1f %10.2f  %s" % (names[k], s["second_half_ms"][k], s["steps_per_s"][k],
                                           " ".join(",".join(map(str, c))
                                                    for c in s["final_counts"][k])))
    print("%-22s %12.1f %10.2f  (sum of speeds %.2f, fixed part %.1f ms)" % (
        "sum-of-speeds bound", s["bound_step_ms"], s["bound_steps_per_s"], s["sum_of_speeds"],
        s["fixed_ms"]))
    print("deploy: %.2fx the steps/s without it, %.0f%% of the bound; %d commits (%d reverts)"
          % (s["agent_over_none"], 100 * s["agent_of_bound"], s["commits"], s["reverts"]))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with every run")
    ap.add_argument("--steps", type=int, default=120, help="steps of a run")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="build folder holding parapilot")
    ap.add_argument("--python", default=os.environ.get("PARAPILOT_TORCH2_PYTHON",
                                                       "/opt/parapilot/torch2/bin/python"),
                    help="the interpreter with torch 2.x (FSDP2) that runs the job")
    ap.add_argument("--json", default="", help="write the report here")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.steps < 40:
        ap.error("--steps must be at least 40 (deploy measures 10 steps, then decides)")
    a.parapilot = os.path.join(os.path.abspath(a.build), "parapilot")
    if not os.access(a.parapilot, os.X_OK):
        ap.error("--build: no parapilot in %s (cmake --build %s --target parapilot)"
                 % (a.build, a.build))
    if not os.access(a.python, os.X_OK):
        ap.error("--python: %s is not an executable (bash scripts/install-torch2.sh makes it)"
                 % a.python)
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error("--json: no folder %s" % os.path.dirname(os.path.abspath(a.json)))
    return a


def main(argv):
    a = parse_args(argv)
    results = run_results()
    report = results.envelope("benchmarks/live/fsdp_mixed.py", argv)
    secret = harness.SecretFile()
    records = []
    start = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="parapilot-fsdp-") as tmp:
            for r in range(a.rounds):
                t0 = time.time()
                records += run_round(a, r, secret, tmp)
                print("round %d/%d: %.0f s" % (r + 1, a.rounds, time.time() - t0),
                      file=sys.stderr, flush=True)
    except RuntimeError as e:
        print("fsdp_mixed: %s" % e, file=sys.stderr)
        return 1
    finally:
        secret.close()
    summary = summarize(records)
    print_table(summary, a.rounds)
    if a.json:
        figures = {"ranks": RANKS, "global_batch": GLOBAL_BATCH, "factors": FACTORS,
                   "device_ms_per_sample": DEVICE_MS, "rounds": a.rounds, "steps": a.steps,
                   "wall_s": time.time() - start, "runs": records, "summary": summary}
        results.finish(report, figures, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
