#!/usr/bin/env python3
"""Gradient compression on rate-limited links: does it save wall time, not just ring-formula bytes?

    benchmarks/live/netns_compression.py [--rate-mbit 200] [--hidden 512] [--steps 40]
        [--methods none,fp16,topk,powersgd] [--rounds 1] [--json FILE]

--rate-mbit 0: links not limited (the veths' own speed). Needs root and network namespaces (tests/python/netns_hosts.py; exit 77 without them) and the
scripted agent (PARAPILOT_SCRIPTED_AGENT, or build/tests/python/scripted_agent). Four hosts, each
link limited to --rate-mbit both ways (tbf), one rank of tests/python/ddp_worker.py per host
(model Linear(16,H) ReLU Linear(H,H) ReLU Linear(H,4), H = --hidden; CPU Gloo over the veths).
The scripted agent runs on host 0 (reached through a relay on host 0's address). Each run is one
launch: after step 2 the agent switches every rank to a plan whose compression is the method's
(the same path for "none": a plan with no compression), then the job runs --steps more.

Methods (the agent's per-layer compression, as test_ddp.py sends it; layers 0, 1, 2):
  none      no compression
  fp16      0-2:1:0      fp16 everywhere
  topk      0-1:2:0.01   top-k 1% on layers 0-1 (all-gathered), layer 2 plain
  powersgd  0-1:3:4      PowerSGD rank 4 on layers 0-1, layer 2 plain (PowerSGD on layer 2,
                         Linear(H,4), stops the job at H = 512 under torch 1.13: a Gloo size
                         mismatch between the ranks, or a hang; H = 128 runs)

Per run, measured over the steps after the plan's first 3 (PowerSGD's first two are plain): the
median step (rank 0's cycle), the bytes each host's interface sent and received per step (the
kernel's counters, read when the agent's telemetry reaches the window's first and last step:
everything on the link, not a formula), the bytes the client says it sent (all-reduce +
all-gather), and the final loss (rank 0's mean over the last 10 steps; the same data and steps
for every method).
Prints a table; --json writes it in the envelope of the other benchmarks. Exit 1 when a run
fails, 2 on bad flags, 77 when namespaces or the agent are missing.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "python")
sys.dont_write_bytecode = True  # the modules below are the source tree's: leave no caches in it
from bench_report import run_results  # noqa: E402  (the report envelope)
sys.path.insert(0, TESTS)
import harness  # noqa: E402  (tests/python: the scripted agent, secrets, launches)
import netns_hosts  # noqa: E402  (tests/python: hosts in network namespaces)

RANKS = 4
GLOBAL_BATCH = 32
SWITCH_AFTER = 2  # the plan is prepared once the agent has seen this step
SETTLE = 3  # steps of the new plan left out of the window (PowerSGD's plain first two)
METHODS = {"none": "-", "fp16": "0-2:1:0", "topk": "0-1:2:0.01", "powersgd": "0-1:3:4"}
SKIPPED = 77


def switch(agent, plan_id, compression):
    """Prepare on every rank, wait for every PlanReady (ok), commit 3 steps ahead, wait for every
    Ack (as test_ddp.py's AgentTest.switch). Returns the commit step."""
    agent.command(f"prepare {plan_id} {RANKS} 1,1,1,1 {compression} 10000 bench")
    for _ in range(RANKS):
        r = agent.wait_for(lambda e: e["event"] == "plan_ready" and e["plan_id"] == plan_id,
                           timeout=60)
        if not r["ok"]:
            raise RuntimeError(f"plan {plan_id} ({compression}) refused: {r}")
    newest = max(e["step"] for e in agent.events_of("telemetry"))
    at = newest + 4
    agent.command(f"commit {plan_id} {at}")
    for _ in range(RANKS):
        agent.wait_for(lambda e: e["event"] == "ack" and e["id"] == plan_id, timeout=60)
    return at


def wait_step(agent, step, timeout=300):
    """Waits until every rank's telemetry reached `step`; returns the smallest step they said."""
    seen = {}
    while len(seen) < RANKS:
        e = agent.wait_for(lambda e: e["event"] == "telemetry" and e["step"] >= step
                           and e["rank"] not in seen, timeout)
        seen[e["rank"]] = e["step"]
    return min(seen.values())


def run_method(a, hosts, secret, method, plan_id):
    """One launch under `method`; returns its figures."""
    agent = harness.ScriptedAgent(secret.path, wrap=hosts.exec_argv(0))
    job = None
    try:
        address = hosts.relay(0, harness.free_port(), agent.port)
        env = {"GLOO_SOCKET_IFNAME": hosts.ifname, "PARAPILOT_AGENT": address,
               "PARAPILOT_SECRET_FILE": secret.path}
        total = SWITCH_AFTER + 4 + SETTLE + a.steps
        job = harness.launch(RANKS, {"steps": total, "global_batch": GLOBAL_BATCH,
                                     "hidden": a.hidden},
                             env_extra=env, wrap=hosts.exec_argv, master_addr=hosts.addresses[0],
                             timeout=600)
        wait_step(agent, SWITCH_AFTER)
        at = switch(agent, plan_id, METHODS[method])
        # The window ends 3 steps before the job does: the last steps' telemetry may still be
        # in flight when the ranks close their links.
        first = wait_step(agent, at + SETTLE)
        b0, t0 = hosts.all_bytes(), time.monotonic()
        last = wait_step(agent, total - 3)
        b1, t1 = hosts.all_bytes(), time.monotonic()
        res = job.wait()
        job = None
    except AssertionError as e:  # the agent's wait_for: say what the ranks said
        if job is not None:
            job.kill()
            tails = [f"rank {k} exit {code}: {err[-1500:]}" for k, (code, _, err)
                     in enumerate(job.outcomes())]
            job = None
            raise RuntimeError(f"{method}: {str(e)[:300]}\n" + "\n".join(tails)) from e
        raise
    finally:
        if job is not None:
            job.kill()
        agent.stop()
    r0 = [x for x in res[0]["records"] if first < x["step"] <= last]
    if not r0 or any(x["plan"] != plan_id for x in r0):
        raise RuntimeError(f"{method}: the window's steps did not all run plan {plan_id}")
    n = last - first
    wire = [{k: (b1[i][k] - b0[i][k]) / n for k in ("tx", "rx")} for i in range(RANKS)]
    return {"method": method, "compression": METHODS[method], "steps": n,
            "median_step_ms": statistics.median(x["cycle_ms"] for x in r0),
            "window_s": t1 - t0,
            "wire_tx_per_step": [w["tx"] for w in wire],
            "wire_rx_per_step": [w["rx"] for w in wire],
            "client_bytes_per_step": r0[-1]["all_reduce_bytes"] + r0[-1]["all_gather_bytes"],
            "final_loss": statistics.mean(x["loss"] for x in res[0]["records"][-10:])}


def summarize(runs):
    """Per method over the rounds: the median step's median and range, the mean bytes per host per
    step on the wire (sent), the client's bytes, the final losses, and the median step's ratio to
    the uncompressed run's (when it ran)."""
    out = {}
    for m in dict.fromkeys(r["method"] for r in runs):
        rs = [r for r in runs if r["method"] == m]
        steps = [r["median_step_ms"] for r in rs]
        out[m] = {"median_step_ms": statistics.median(steps), "min_ms": min(steps),
                  "max_ms": max(steps),
                  "wire_tx_per_host_step": statistics.mean(
                      statistics.mean(r["wire_tx_per_step"]) for r in rs),
                  "client_bytes_per_step": rs[-1]["client_bytes_per_step"],
                  "final_loss": [r["final_loss"] for r in rs]}
    if "none" in out:
        for m in out:
            out[m]["step_vs_none"] = out[m]["median_step_ms"] / out["none"]["median_step_ms"]
    return out


def print_table(summary, rate, rounds):
    link = f"links {rate:g} Mbit/s each way (tbf)" if rate else "links not limited"
    print(f"4 hosts, {link}; {rounds} round(s); per step over each run's window")
    print(f"{'method':<9} {'median ms':>9} {'range ms':>13} {'vs none':>7} {'wire tx/host KB':>15} "
          f"{'client KB':>9}  final loss")
    for m, r in summary.items():
        ratio = f"{r['step_vs_none']:.2f}" if "step_vs_none" in r else "-"
        print(f"{m:<9} {r['median_step_ms']:>9.1f} {r['min_ms']:>6.1f}-{r['max_ms']:<6.1f} "
              f"{ratio:>7} {r['wire_tx_per_host_step'] / 1e3:>15.1f} "
              f"{r['client_bytes_per_step'] / 1e3:>9.1f}  "
              + " ".join(f"{x:.3f}" for x in r["final_loss"]))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--methods", default="none,fp16,topk,powersgd")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    a.methods = a.methods.split(",")
    for m in a.methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r} (known: {', '.join(METHODS)})")
    if a.steps < 2 or a.rounds < 1 or a.hidden < 4 or a.rate_mbit < 0:
        ap.error("--steps >= 2, --rounds >= 1, --hidden >= 4 and --rate-mbit >= 0")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error(f"--json: no folder {os.path.dirname(os.path.abspath(a.json))}")
    return a


def main(argv):
    a = parse_args(argv)
    why = netns_hosts.unavailable() or (
        None if harness.scripted_agent_path() else "scripted_agent is not built")
    if why is not None:
        print(f"netns_compression: skipped: {why}", file=sys.stderr)
        return SKIPPED
    results = run_results()
    report = results.envelope("benchmarks/live/netns_compression.py", argv)
    secret = harness.SecretFile()
    runs = []
    start = time.time()
    try:
        with netns_hosts.Hosts(RANKS) as hosts:
            for i in range(RANKS):
                hosts.shape(i, rate_mbit=a.rate_mbit or None)
            for r in range(a.rounds):
                order = a.methods[r % len(a.methods):] + a.methods[:r % len(a.methods)]
                for k, m in enumerate(order):
                    runs.append(dict(run_method(a, hosts, secret, m, 100 + k), round=r))
                    print(f"round {r + 1}: {m} done", file=sys.stderr, flush=True)
    except (RuntimeError, AssertionError) as e:
        print(f"netns_compression: {e}", file=sys.stderr)
        return 1
    finally:
        secret.close()
    summary = summarize(runs)
    print_table(summary, a.rate_mbit, a.rounds)
    if a.json:
        figures = {"summary": summary, "ranks": RANKS, "global_batch": GLOBAL_BATCH, "hidden": a.hidden,
                   "rate_mbit": a.rate_mbit, "rounds": a.rounds, "steps": a.steps,
                   "wall_s": time.time() - start, "runs": runs}
        results.finish(report, figures, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
