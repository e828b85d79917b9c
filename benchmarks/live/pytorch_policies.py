#!/usr/bin/env python3
"""A live contest of deploy's policies on a real PyTorch DDP job.

    benchmarks/live/pytorch_policies.py [--rounds 5] [--policies rl,measured-shares,reactive]
        [--shape buffers] [--build build] [--json FILE]

The job is tests/python/job_shapes.py (4 CPU Gloo ranks, emulated devices whose time is slept).
Each round is one launch of it whose runs follow one another, for each condition

  forward    rank 2 a 3x slower device in its forward, the whole run
  mixed      devices 1, 1, 2 and 3x slower through their whole step
  healthy    every device alike
  transient  rank 2 3x slower in its forward for 15 s from 5 s after the run's first step,
             then healthy again

one run per policy, each beside its own fresh `parapilot deploy --policy P`, and one run without
the agent; conditions and runs within a condition are rotated from round to round, so that no
policy always runs first or last. Per run: the median step of the second half, the run's total
time (the sum of its steps; all runs of a condition have the same steps), the final shares,
deploy's commits and reverts (its `migration` events) and the policy deploy said it used (its
`agent_started` line and every `decision` line; a run with another policy, or a fallback, fails
the benchmark).

For each condition and each pair (rl against each other policy, every policy against no agent)
the paired differences over the rounds (the other's figure minus the first's: above 0 means the
first is faster), their mean and 95% interval (t distribution over the rounds) and a verdict:
better (interval above 0), tie (it contains 0) or worse (below 0); for the second-half median,
and for transient also the total time. Prints the tables; --json writes them in the envelope of
the other benchmarks (benchmarks/report.h). Exit code 2 on bad flags, 1 when a run fails.
"""

import argparse
import json
import math
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
from test_pytorch_job import Deploy  # noqa: E402  (deploy beside a job, its JSON lines)


SCRIPT = os.path.join(TESTS, "job_shapes.py")
SHAPES = ["buffers", "loss-log", "barrier", "accumulate", "eval", "clip", "groups"]
CONDITIONS = ["forward", "mixed", "healthy", "transient"]
NO_AGENT = "none"
RANKS = 4
GLOBAL_BATCH = 128
TRANSIENT_START_S, TRANSIENT_S = 5.0, 15.0
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def rotated(items, k):
    k %= len(items)
    return items[k:] + items[:k]


def base_name(policy):
    """A policy id without its parameters: what deploy names it in its log."""
    return policy.partition("(")[0]


def round_plan(r, policies):
    """The runs of round r in order: [(condition, policy or NO_AGENT)]."""
    return [(c, p) for c in rotated(CONDITIONS, r) for p in rotated([NO_AGENT] + policies, r)]


def run_round(a, r, policies, secret, tmp):
    """One launch of job_shapes.py with every run of round r; returns the runs' records."""
    plan = round_plan(r, policies)
    steps = {c: a.transient_steps if c == "transient" else a.steps for c in CONDITIONS}
    deploys = []
    try:
        for _, p in plan:
            if p != NO_AGENT:
                deploys.append(Deploy(a.parapilot, harness.free_port(), secret.path,
                                      ["--policy", p]))
        out = os.path.join(tmp, "round-%d.json" % r)
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"), OMP_NUM_THREADS="1",
                   PARAPILOT_SECRET_FILE=secret.path, PARAPILOT_AGENT="")
        runs = ",".join("%s:%s:%d" % (c, "none" if p == NO_AGENT else "agent", steps[c])
                        for c, p in plan)
        cmd = [a.python, "-m", "parapilot.launch", "--nproc", str(RANKS), "--timeout", "3000",
               SCRIPT, "--shape", a.shape, "--runs", runs,
               "--agents", ",".join(d.address for d in deploys),
               "--global-batch", str(GLOBAL_BATCH), "--transient-start-s", str(TRANSIENT_START_S),
               "--transient-s", str(TRANSIENT_S), "--out", out]
        job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3100)
    finally:
        for d in deploys:
            d.stop()
    if job.returncode != 0:
        raise RuntimeError("round %d: the job failed (exit %d):\n%s"
                           % (r, job.returncode, job.stderr[-4000:]))
    with open(out) as f:
        results = json.load(f)["runs"]
    agent_logs = iter(deploys)
    records = []
    for position, ((condition, policy), res) in enumerate(zip(plan, results)):
        assert res["condition"] == condition
        step_ms = res["step_ms"]
        rec = {"round": r, "position": position, "condition": condition, "policy": policy,
               "steps": len(step_ms),
               "second_half_ms": statistics.median(step_ms[len(step_ms) // 2:]),
               "total_s": sum(step_ms) / 1000.0, "final_counts": res["final_counts"],
               "plans_applied": len(res["applied_plans"])}
        if policy != NO_AGENT:
            rec.update(deploy_figures(next(agent_logs), policy, r, condition))
        records.append(rec)
    return records


def deploy_figures(d, asked, r, condition):
    """Commits, reverts and the policy of one deploy's log; raises when it used another policy."""
    where = "round %d, %s, --policy %s" % (r, condition, asked)
    started = d.events("agent_started")
    said = started[0]["policy"] if started else None
    deciding = sorted({e["policy"] for e in d.events("decision") if "policy" in e})
    if d.events("policy_fallback") or (started and started[0].get("fallback")):
        raise RuntimeError("%s: deploy fell back to another policy: %s"
                           % (where, d.events("policy_fallback")))
    if said is None or base_name(said) != base_name(asked) or \
            any(base_name(p) != base_name(asked) for p in deciding):
        raise RuntimeError("%s: deploy said it used policy %s and decided with %s"
                           % (where, said, deciding or "none"))
    if not d.events("decision"):
        raise RuntimeError("%s: deploy made no decision (did the job reach it?)" % where)
    migrations = [e for e in d.events("migration") if e.get("outcome") == "committed"]
    stopped = d.events("agent_stopped")
    return {"policy_reported": said, "decisions": len(d.events("decision")),
            "commits": len(migrations), "reverts": sum(1 for e in migrations if e.get("revert")),
            "aborted": stopped[-1]["aborted"] if stopped else None}


def interval(diffs):
    """Mean and 95% interval (t over the rounds) of paired differences; None bounds for one."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, None, None
    half = (T975[n - 2] if n - 1 <= len(T975) else 1.96) * statistics.stdev(diffs) / math.sqrt(n)
    return mean, mean - half, mean + half


def verdict(low, high):
    if low is None:
        return "n/a (one round)"
    return "better" if low > 0 else "worse" if high < 0 else "tie"


def compare(records, policies):
    """Paired comparisons per condition: rl against each other policy, each policy against no
    agent. A difference is the second's figure minus the first's (above 0: the first faster)."""
    by = {(x["condition"], x["policy"], x["round"]): x for x in records}
    rounds = sorted({x["round"] for x in records})
    first = "rl" if "rl" in policies else policies[0]
    pairs = [(first, p) for p in policies if p != first] + [(p, NO_AGENT) for p in policies]
    out = []
    for c in CONDITIONS:
        metrics = ["second_half_ms"] + (["total_s"] if c == "transient" else [])
        for a, b in pairs:
            for metric in metrics:
                diffs = [by[(c, b, r)][metric] - by[(c, a, r)][metric] for r in rounds]
                mean, low, high = interval(diffs)
                ref = statistics.fmean(by[(c, b, r)][metric] for r in rounds)
                out.append({"condition": c, "policy": a, "against": b, "metric": metric,
                            "diffs": diffs, "mean": mean, "low": low, "high": high,
                            "mean_pct_of_against": 100.0 * mean / ref if ref else None,
                            "verdict": verdict(low, high)})
    return out


def summarize(records, policies):
    """Per condition and policy: medians over the rounds, commits and reverts summed."""
    out = []
    for c in CONDITIONS:
        for p in policies + [NO_AGENT]:
            xs = [x for x in records if x["condition"] == c and x["policy"] == p]
            row = {"condition": c, "policy": p, "rounds": len(xs),
                   "second_half_ms": statistics.median(x["second_half_ms"] for x in xs),
                   "total_s": statistics.median(x["total_s"] for x in xs),
                   "final_counts": [x["final_counts"] for x in xs]}
            if p != NO_AGENT:
                row["commits"] = sum(x["commits"] for x in xs)
                row["reverts"] = sum(x["reverts"] for x in xs)
                row["policy_reported"] = sorted({x["policy_reported"] for x in xs})
            out.append(row)
    return out


def print_tables(summary, comparisons, rounds):
    print("\n%-9s  %-16s  %12s  %9s  %17s  %s" % ("condition", "policy", "2nd half ms",
                                                    "total s", "commits (reverts)",
                                                    "final shares, by round"))
    for s in summary:
        cr = "%d (%d)" % (s["commits"], s["reverts"]) if "commits" in s else "-"
        print("%-9s  %-16s  %12.1f  %9.2f  %17s  %s" % (
            s["condition"], s["policy"], s["second_half_ms"], s["total_s"], cr,
            " ".join(",".join(map(str, fc)) for fc in s["final_counts"])))
    print("\nPaired over %d round(s): mean of (second - first), 95%% interval" % rounds)
    for x in comparisons:
        unit = "ms" if x["metric"] == "second_half_ms" else "s"
        ci = ("[%+.2f, %+.2f]" % (x["low"], x["high"])) if x["low"] is not None else "-"
        print("%-9s  %-16s vs %-16s  %-14s  %+8.2f %-2s  %-18s  %s" % (
            x["condition"], x["policy"], x["against"], x["metric"], x["mean"], unit, ci,
            x["verdict"]))


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="launches, each with every run")
    ap.add_argument("--policies", default="rl,measured-shares,reactive",
                    help="comma-separated deploy --policy values")
    ap.add_argument("--shape", default="buffers", choices=SHAPES, help="job_shapes.py --shape")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="build folder holding parapilot")
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument("--steps", type=int, default=120, help="steps of a forward, mixed or "
                    "healthy run")
    ap.add_argument("--transient-steps", type=int, default=350,
                    help="steps of a transient run (past the slowdown's end with or without "
                    "the agent)")
    ap.add_argument("--python", default="/usr/bin/python3",
                    help="the interpreter with torch that runs the job")
    a = ap.parse_args(argv)
    policies = [p for p in a.policies.split(",") if p]
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.steps < 20 or a.transient_steps < 20:
        ap.error("--steps and --transient-steps must be at least 20")
    if not policies or len(set(policies)) != len(policies) or NO_AGENT in policies:
        ap.error("--policies: a comma-separated list of distinct deploy policies")
    a.parapilot = os.path.join(os.path.abspath(a.build), "parapilot")
    if not os.access(a.parapilot, os.X_OK):
        ap.error("--build: no parapilot in %s (cmake --build %s --target parapilot)"
                 % (a.build, a.build))
    if not os.access(a.python, os.X_OK):
        ap.error("--python: %s is not an executable" % a.python)
    if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
        ap.error("--json: no folder %s" % os.path.dirname(os.path.abspath(a.json)))
    a.policy_list = policies
    return a


def main(argv):
    a = parse_args(argv)
    results = run_results()
    report = results.envelope("benchmarks/live/pytorch_policies.py", argv)
    secret = harness.SecretFile()
    records = []
    start = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="parapilot-policies-") as tmp:
            for r in range(a.rounds):
                t0 = time.time()
                records += run_round(a, r, a.policy_list, secret, tmp)
                print("round %d/%d: %.0f s" % (r + 1, a.rounds, time.time() - t0),
                      file=sys.stderr, flush=True)
    except RuntimeError as e:
        print("pytorch_policies: %s" % e, file=sys.stderr)
        return 1
    finally:
        secret.close()
    summary = summarize(records, a.policy_list)
    comparisons = compare(records, a.policy_list)
    print_tables(summary, comparisons, a.rounds)
    if a.json:
        figures = {"shape": a.shape, "ranks": RANKS, "global_batch": GLOBAL_BATCH,
                   "rounds": a.rounds, "policies": a.policy_list, "steps": a.steps,
                   "transient_steps": a.transient_steps,
                   "transient": {"rank": 2, "factor": 3.0, "start_s": TRANSIENT_START_S,
                                 "length_s": TRANSIENT_S},
                   "wall_s": time.time() - start, "runs": records, "summary": summary,
                   "comparisons": comparisons}
        results.finish(report, figures, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
