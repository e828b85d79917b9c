#!/usr/bin/env python3
"""The pause of a live pipeline switch against a stop-save-relaunch-load restart.

    /opt/parapilot/torch2/bin/python benchmarks/live/pipeline_switch.py [--switches 5]
        [--restarts 3] [--build build] [--json FILE]

A 4-stage GPT-like job (tests/python/pipeline_models.py: an embedding block, --layers transformer
blocks of --width, a head block; Adam; gpipe, 8 micro-batches of 2 sequences of 32 tokens) on 4
Gloo ranks on the CPU, split A = 3,3,2,2 blocks.

* Live, twice: the scripted agent (build/tests/python/scripted_agent) moves the job between A
  and B = 2,2,3,3 --switches times (PlanPrepare, every PlanReady, PlanCommit a few steps ahead,
  every Ack). Each switch moves 4 blocks (their parameters and Adam state).
  - streamed (the default): the blocks are streamed ahead of the boundary (pipeline_stream.py);
    at the boundary a rank waits for the last step's gradients to be applied to its copies,
    installs them and rebuilds its stage, schedule and optimizer;
  - at the boundary (PipelineSession(stream=False)): the blocks are sent at the boundary.
  A switch's pause is the longest time a rank spent switching at the boundary
  (PipelineSession.switches); the step excess is the switching step's wall time minus the
  median step, on the slowest rank; the streaming steps' excess is the median wall time of the
  steps that streamed, minus the median step, on the slowest rank; the quiet steps' excess is
  the median over the other steps of the slowest rank's wall time minus its median step (the
  noise the other two are read against).
* Restart, --restarts times: the job on A stops after 5 steps and saves its blocks (parameters and
  Adam state, every rank); a new job on B is launched, loads them and runs. The pause runs from
  the first rank starting its save to the last rank starting its first step on B (process exit,
  interpreter and torch start, process group, model, load).

Prints both medians and their ratio; --json writes them in the envelope of
scripts/run-results.py. Nothing here is asserted: speed depends on the machine.
"""

import argparse
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "python")
sys.dont_write_bytecode = True  # the modules below are the source tree's: leave no caches in it
from bench_report import run_results  # noqa: E402  (the report envelope)
sys.path.insert(0, TESTS)
import harness  # noqa: E402  (tests/python: the scripted agent, launches, secrets)

sys.path.insert(0, os.path.join(ROOT, "python"))
from parapilot import pipeline_plan  # noqa: E402

WORLD = 4
SPLIT_A, SPLIT_B = [3, 3, 2, 2], [2, 2, 3, 3]


def job_config(a, **extra):
    return dict({"model": "gpt", "blocks": a.layers, "width": a.width, "global_batch": 16,
                 "micro_batches": 8, "schedule": "gpipe", "optimizer": "adam"}, **extra)


def live(a, stream):
    """A.switches switches between A and B: their pauses, the switching steps' excess, the bytes
    moved, the median step and the streaming steps' excess (ms; None when not streamed)."""
    secret = harness.SecretFile()
    agent = harness.ScriptedAgent(secret.path)
    env = {"PARAPILOT_AGENT": agent.address, "PARAPILOT_SECRET_FILE": secret.path}
    job = harness.launch(WORLD, job_config(a, steps=100000, split=SPLIT_A, stream=stream),
                         env_extra=env,
                         timeout=600, worker="pipeline_worker.py")
    try:
        splits = [SPLIT_B, SPLIT_A]
        for i in range(a.switches):
            newest = agent.wait_for(lambda e: e["event"] == "telemetry" and e["step"] >= 10 +
                                    12 * i, timeout=300)["step"]
            plan = 100 + i
            name = pipeline_plan.layout_name(splits[i % 2], 2, "gpipe")  # 8 x 2
            agent.command(f"prepare {plan} 1 - - 30000 {name} 1 {WORLD} 8")
            for _ in range(WORLD):
                r = agent.wait_for(lambda e: e["event"] == "plan_ready" and
                                   e["plan_id"] == plan, timeout=60)
                if not r["ok"]:
                    raise SystemExit(f"plan refused: {r}")
            newest = max(e["step"] for e in agent.events_of("telemetry"))
            agent.command(f"commit {plan} {newest + 4}")
            for _ in range(WORLD):
                agent.wait_for(lambda e: e["event"] == "ack" and e["id"] == plan, timeout=120)
        agent.command("shutdown benchmark done")
        results = job.wait()
        job = None
    finally:
        if job is not None:
            job.kill()
        agent.stop()
        secret.close()
    pauses = [max(r["switches"][i]["pause_ms"] for r in results) for i in range(a.switches)]
    moved = [sum(r["switches"][i]["bytes_at_boundary"] + r["switches"][i]["bytes_streamed"]
                 for r in results) for i in range(a.switches)]
    excess = []
    for i, plan in enumerate(range(100, 100 + a.switches)):
        worst = 0.0
        for r in results:
            walls = [x["wall_ms"] for x in r["records"] if x["step"] >= 5]
            median = statistics.median(walls)
            first = min(x["step"] for x in r["records"] if x["plan"] == plan)
            before = [x for x in r["records"] if x["step"] == first - 1][0]
            worst = max(worst, before["wall_ms"] - median)
        excess.append(worst)
    steps = [statistics.median(x["wall_ms"] for x in r["records"] if x["step"] >= 5)
             for r in results]
    # The same statistic for the steps that neither switched nor streamed: the noise it is read
    # against.
    special = set()
    for r in results:
        for w in r["switches"]:
            special.add(w["step"] - 1)
            if w["streamed_from"] is not None:
                special.update(range(w["streamed_from"], w["step"]))
    medians = {r["rank"]: m for r, m in zip(results, steps)}
    by_step = {}
    for r in results:
        for x in r["records"]:
            if x["step"] >= 5 and x["step"] not in special:
                by_step.setdefault(x["step"], []).append(x["wall_ms"] - medians[r["rank"]])
    quiet = statistics.median(max(v) for v in by_step.values())
    streaming = None
    if stream:
        streaming = 0.0
        for r, median in zip(results, steps):
            during = {s for w in r["switches"] for s in range(w["streamed_from"], w["step"])}
            walls = [x["wall_ms"] for x in r["records"] if x["step"] in during]
            streaming = max(streaming, statistics.median(walls) - median)
    return {"pauses": pauses, "excess": excess, "moved": moved, "step_ms": max(steps),
            "streaming_excess": streaming, "quiet_excess": quiet}


def restart(a, tmp):
    """Pauses (ms) of one stop-save-relaunch-load restart from A to B."""
    ck = os.path.join(tmp, "ck")
    first = harness.launch(WORLD, job_config(a, steps=100, split=SPLIT_A, save_at=5,
                                             save_prefix=ck),
                           timeout=300, worker="pipeline_worker.py").wait()
    second = harness.launch(WORLD, job_config(a, steps=8, split=SPLIT_B, resume_prefix=ck),
                            timeout=300, worker="pipeline_worker.py").wait()
    return (max(r["t_first_step"] for r in second) - min(r["t_save"] for r in first)) * 1e3


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switches", type=int, default=5)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--json", default="", help="write the report here")
    a = ap.parse_args(argv)
    agent = os.path.join(os.path.abspath(a.build), "tests", "python", "scripted_agent")
    if not os.path.exists(agent):
        ap.error(f"no {agent} (cmake --build {a.build} --target scripted_agent)")
    os.environ["PARAPILOT_SCRIPTED_AGENT"] = agent
    results = run_results()
    report = results.envelope("benchmarks/live/pipeline_switch.py", argv)
    runs = {}
    for name, stream in (("streamed", True), ("at the boundary", False)):
        x = live(a, stream)
        x["pause_median_ms"] = statistics.median(x["pauses"])
        x["excess_median_ms"] = statistics.median(x["excess"])
        runs[name] = x
        print(f"live switch, {name}: pause {x['pause_median_ms']:.1f} ms median over "
              f"{len(x['pauses'])} switches ({', '.join(f'{p:.1f}' for p in x['pauses'])}); "
              f"switching step {x['excess_median_ms']:+.1f} ms over the median step of "
              f"{x['step_ms']:.1f} ms" + ("" if x["streaming_excess"] is None else
                                         f"; streaming steps {x['streaming_excess']:+.1f} ms") +
              f"; other steps {x['quiet_excess']:+.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        restarts = [restart(a, tmp) for _ in range(a.restarts)]
    restart_med = statistics.median(restarts)
    live_med = runs["streamed"]["pause_median_ms"]
    figures = {"stages": WORLD, "blocks": a.layers + 2, "width": a.width,
               "split_a": SPLIT_A, "split_b": SPLIT_B, "runs": runs,
               "restart_pauses_ms": restarts, "restart_pause_median_ms": restart_med,
               "ratio": restart_med / live_med}
    print(f"restart (stop, save, relaunch, load): {restart_med:.0f} ms median over "
          f"{len(restarts)} ({', '.join(f'{p:.0f}' for p in restarts)})")
    print(f"ratio restart / streamed live switch: {restart_med / live_med:.0f}x")
    if a.json:
        results.finish(report, figures, a.json)


if __name__ == "__main__":
    main(sys.argv[1:])
