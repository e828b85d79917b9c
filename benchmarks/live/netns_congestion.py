#!/usr/bin/env python3
"""Real congestion: one host's link is rate-limited part way through a DDP job; what does deploy
see, and what does it do, against no agent?

    benchmarks/live/netns_congestion.py [--rate-mbit 50] [--host 2] [--hidden 256]
        [--steps 200] [--at-step 60] [--restore-after-s 0] [--json FILE]

Needs root and network namespaces (tests/python/netns_hosts.py; exit 77 without them) and
`parapilot deploy` (PARAPILOT_BINARY, or build/parapilot). Four hosts, one rank of
tests/python/ddp_worker.py per host (CPU Gloo over the veths, links not limited at start). Two
runs, each one launch: without an agent, and beside `parapilot deploy --listen HOST0:PORT
--secret-file F` on host 0 (nothing else: the shipped defaults). When host 0's interface has
sent --at-step steps' worth of ring all-reduce bytes (the kernel's counter, the same for both
runs, no agent needed to tell the step), --host's link is limited to --rate-mbit both ways (tbf)
for the rest of the run, or, with --restore-after-s S, for S seconds (then unlimited again).

Per run: the median step (rank 0's cycle) before and after the limit, the gradient bytes rank 0
all-reduced a step (the client's count: halved under fp16), the final shares, and, for deploy,
what it said: its slow-link and slow-rank events, its decisions (step, action, reason, target),
its migrations and its summary (agent_stopped). Prints them; --json writes them in the envelope of the other
benchmarks. Exit 1 when a run fails, 77 when namespaces or deploy are missing.
"""

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "python")
sys.dont_write_bytecode = True  # the modules below are the source tree's: leave no caches in it
from bench_report import run_results  # noqa: E402  (the report envelope)
sys.path.insert(0, TESTS)
import harness  # noqa: E402  (tests/python: secrets, free ports, launches)
import netns_hosts  # noqa: E402  (tests/python: hosts in network namespaces)
from test_deploy import parapilot_binary  # noqa: E402
from test_pytorch_job import Deploy  # noqa: E402  (deploy beside a job, its JSON lines)

RANKS = 4
GLOBAL_BATCH = 32
SKIPPED = 77


def ring_bytes_per_step(hidden):
    """What one rank sends a step in the ring all-reduce of ddp_worker's model of width hidden."""
    params = 16 * hidden + hidden + hidden * hidden + hidden + hidden * 4 + 4
    return 2 * (RANKS - 1) / RANKS * params * 4


def run_once(a, hosts, secret, exe, with_agent):
    """One launch; returns its figures."""
    deploy = None
    if with_agent:
        deploy = Deploy(exe, harness.free_port(), secret.path, host=hosts.addresses[0],
                        wrap=hosts.exec_argv(0))
    env = {"GLOO_SOCKET_IFNAME": hosts.ifname,
           "PARAPILOT_AGENT": deploy.address if deploy else "",
           "PARAPILOT_SECRET_FILE": secret.path}
    job = None
    limited_at_s = restored_at_s = None
    try:
        start_tx = hosts.bytes(0)["tx"]
        t0 = time.monotonic()
        job = harness.launch(RANKS, {"steps": a.steps, "global_batch": GLOBAL_BATCH,
                                     "hidden": a.hidden},
                             env_extra=env, wrap=hosts.exec_argv,
                             master_addr=hosts.addresses[0], timeout=600)
        threshold = start_tx + a.at_step * ring_bytes_per_step(a.hidden)
        while job.running():
            now = time.monotonic() - t0
            if limited_at_s is None and hosts.bytes(0)["tx"] >= threshold:
                hosts.shape(a.host, rate_mbit=a.rate_mbit)
                limited_at_s = now
                if not a.restore_after_s:
                    break
            elif limited_at_s is not None and now - limited_at_s >= a.restore_after_s:
                hosts.shape(a.host, None)
                restored_at_s = now
                break
            time.sleep(0.05)
        res = job.wait()
        job = None
    finally:
        if job is not None:
            job.kill()
        hosts.shape(a.host, None)
        if deploy is not None:
            deploy.stop()
    if limited_at_s is None:
        raise RuntimeError("the job ended before the link was limited (lower --at-step)")
    recs = res[0]["records"]
    out = {"mode": "agent" if with_agent else "none", "limited_at_s": limited_at_s,
           "restored_at_s": restored_at_s,
           "steps": len(recs), "shares": res[0]["shares"],
           "plans_applied": res[0]["applied"],
           "median_step_ms_before": statistics.median(x["cycle_ms"] for x in recs[5:a.at_step]),
           "median_step_ms_last_quarter": statistics.median(
               x["cycle_ms"] for x in recs[-len(recs) // 4:]),
           "wait_ms_last_quarter": statistics.median(
               x["waits"].get("wait/dp", [0, 0])[0] for x in recs[-len(recs) // 4:]),
           "grad_bytes_before": statistics.median(
               x["all_reduce_bytes"] + x["all_gather_bytes"] for x in recs[5:a.at_step]),
           "grad_bytes_last_quarter": statistics.median(
               x["all_reduce_bytes"] + x["all_gather_bytes"] for x in recs[-len(recs) // 4:]),
           "compute_ms_last_quarter": [statistics.median(
               x["compute_ms"] for x in r["records"][-len(recs) // 4:]) for r in res]}
    if deploy is not None:
        lines = deploy.lines
        out["events"] = dict(collections.Counter(e.get("event") for e in lines))
        out["decisions"] = [{k: e.get(k) for k in ("step", "action", "reason", "target_shares",
                                                   "target_compression") if k in e}
                            for e in lines if e.get("event") == "decision"]
        out["link"] = [e for e in lines if e.get("event") in ("slow_link", "link_restored")]
        out["slow_rank"] = [e for e in lines if e.get("event") in ("straggler", "slow_rank")]
        out["migrations"] = [e for e in lines if e.get("event") == "migration"]
        lost = [e for e in lines if e.get("event") == "rank_lost"]
        out["rank_lost_by_rank"] = dict(collections.Counter(str(e.get("rank")) for e in lost))
        out["rank_lost_reasons"] = dict(collections.Counter(str(e.get("reason")) for e in lost))
        stopped = [e for e in lines if e.get("event") == "agent_stopped"]
        out["summary"] = stopped[-1] if stopped else None
    return out


def print_run(r, a):
    print(f"{r['mode']}: host {a.host} limited to {a.rate_mbit:g} Mbit/s at "
          f"{r['limited_at_s']:.1f} s"
          + (f", unlimited again at {r['restored_at_s']:.1f} s" if r["restored_at_s"] else "")
          + f"; median step {r['median_step_ms_before']:.1f} ms before, "
          f"{r['median_step_ms_last_quarter']:.1f} ms in the last quarter (rank 0 wait "
          f"{r['wait_ms_last_quarter']:.1f} ms; compute per rank "
          + ", ".join(f"{c:.1f}" for c in r["compute_ms_last_quarter"])
          + f" ms); gradient bytes a step {r['grad_bytes_before']:.0f} before, "
          f"{r['grad_bytes_last_quarter']:.0f} in the last quarter; final shares {r['shares']}; "
          f"plans {r['plans_applied']}")
    if r["mode"] == "agent":
        print(f"  deploy's events: {r['events']}")
        for e in r["link"]:
            print(f"  {e.get('event')} at step {e.get('step')}: {e.get('evidence')}")
        for d in r["decisions"]:
            target = ", ".join(f"{k} {d[k]}" for k in ("target_shares", "target_compression")
                               if k in d)
            print(f"  decision at step {d['step']}: {d['action']}"
                  + (f" to {target}" if target else "") + f" ({d['reason']})")
        print(f"  bus connections lost, by rank: {r['rank_lost_by_rank']}; reasons: "
              f"{r['rank_lost_reasons']}")
        for e in r["slow_rank"]:
            print(f"  slow_rank at step {e.get('step')}: rank {e.get('rank')}: {e.get('evidence')}")
        for m in r["migrations"]:
            print(f"  migration: {m}")
        if r["summary"]:
            print(f"  summary: {r['summary']}")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=50.0)
    ap.add_argument("--host", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--at-step", type=int, default=60)
    ap.add_argument("--restore-after-s", type=float, default=0.0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if (not 0 <= a.host < RANKS or not a.rate_mbit > 0 or not 10 <= a.at_step < a.steps
            or a.restore_after_s < 0):
        ap.error("--host in 0..3, --rate-mbit > 0, 10 <= --at-step < --steps, "
                 "--restore-after-s >= 0")
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error(f"--json: no folder {os.path.dirname(os.path.abspath(a.json))}")
    return a


def main(argv):
    a = parse_args(argv)
    exe = parapilot_binary()
    why = netns_hosts.unavailable() or (None if exe else "parapilot (deploy) is not built")
    if why is not None:
        print(f"netns_congestion: skipped: {why}", file=sys.stderr)
        return SKIPPED
    results = run_results()
    report = results.envelope("benchmarks/live/netns_congestion.py", argv)
    secret = harness.SecretFile()
    runs = []
    start = time.time()
    try:
        with netns_hosts.Hosts(RANKS) as hosts:
            for with_agent in (False, True):
                runs.append(run_once(a, hosts, secret, exe, with_agent))
                print_run(runs[-1], a)
    except (RuntimeError, AssertionError) as e:
        print(f"netns_congestion: {e}", file=sys.stderr)
        return 1
    finally:
        secret.close()
    if a.json:
        figures = {"ranks": RANKS, "global_batch": GLOBAL_BATCH, "hidden": a.hidden,
                   "rate_mbit": a.rate_mbit, "host": a.host, "steps": a.steps,
                   "restore_after_s": a.restore_after_s,
                   "at_step": a.at_step, "wall_s": time.time() - start, "runs": runs}
        results.finish(report, figures, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
