#!/usr/bin/env python3
"""Renders the figure tables of the docs from the JSON that scripts/run-results.py wrote.

    scripts/render-results.py [--data docs/data] [--check]

A generated block in a doc is delimited by

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

and everything between the two lines is replaced by the table NAME, rendered from the data
files, with a line saying which commit, machine load and core count it came from. `--check`
changes nothing and exits 1 when a doc differs from what its data renders (a hand-edited
table, or data committed without rendering). Text outside the blocks is left alone.
"""

import argparse
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["docs/results.md", "docs/planner.md", "docs/cost-model.md", "docs/live.md"]
FAMILIES = ["hetero", "straggler", "congestion", "failure", "phase", "mixed"]
BLOCK = re.compile(r"(<!-- generated: ([a-z0-9-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


class Data:
    def __init__(self, folder):
        self.folder = folder
        self.cache = {}

    def __call__(self, name):
        if name not in self.cache:
            path = os.path.join(self.folder, name)
            with open(path) as f:
                self.cache[name] = json.load(f)
        return self.cache[name]


def source(*reports):
    """Where figures came from: commit(s), load average range over the runs, cores, date."""
    commits = sorted({r["commit"] for r in reports})
    loads = [x for r in reports for k in ("start", "end")
             for x in [(r["load_average"].get(k) or [None])[0]] if x is not None]
    days = sorted({r["utc"][:10] for r in reports})
    load = ("load average %.1f–%.1f" % (min(loads), max(loads))) if loads else "load unknown"
    return "*Measured at commit %s, %s, %d cores, %s.*" % (
        ", ".join(commits), load, reports[0]["cores"], ", ".join(days))


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def n0(x):
    return "{:,.0f}".format(x)


def ms(x, digits=2):
    return ("%." + str(digits) + "f ms") % x


# ---- scheduling policy ---------------------------------------------------------------------

RULES = ["reactive", "reactive-tuned", "threshold", "ski-rental", "lookahead", "static", "uniform-dp"]


def policy_quality(d):
    r = d("policy-eval.json")
    fam = r["figures"]["families"]
    rows = []
    for f in FAMILIES:
        p = fam[f]["policies"]
        ref = fam[f]["reference"]
        s = lambda k: "%.3f ± %.3f" % (p[k]["score"], p[k]["score_ci95"])
        v = p["rl"]["vs_reference"]
        rows.append([f] + [s(k) for k in ["rl"] + RULES] + [
            n0(p["oracle"]["throughput_tokens_per_s"]), ref,
            "%+.4f ± %.4f %s" % (v["score_difference"], v["ci95"], v["verdict"]),
            " / ".join("%.1f" % p[k]["migrations_per_episode"] for k in ("rl", ref, "oracle"))])
    head = (["family", "rl"] + RULES +
            ["oracle tokens/s", "strongest rule", "rl − strongest rule, paired", "migrations rl / rule / oracle"])
    return table(head, rows) + "\n\n" + source(r)


def policy_summary(d):
    r = d("policy-eval.json")
    fam = r["figures"]["families"]
    mean = lambda k: statistics.mean(fam[f]["policies"][k]["score"] for f in FAMILIES)
    verdicts = [fam[f]["policies"]["rl"]["vs_reference"]["verdict"] for f in FAMILIES]
    rows = [["mean score over the six families"] + ["%.3f" % mean(k) for k in ["rl"] + RULES],
            ["migrations per episode, mean"] + ["%.1f" % mean_m(fam, k) for k in ["rl"] + RULES]]
    text = table([""] + ["rl"] + RULES, rows)
    text += "\n\nrl against the strongest rule of each family, paired over its 30 episodes: " \
            "better in %d, tied in %d, worse in %d of 6 families." % (
                verdicts.count("better"), verdicts.count("tie"), verdicts.count("worse"))
    return text + "\n\n" + source(r)


def policy_holdout(d):
    r = d("holdout-eval.json")
    sc = r["figures"]["scenarios"]
    rows = []
    for name in sorted(sc):
        p = sc[name]["policies"]
        ref = sc[name]["reference"]
        v = p["rl"]["vs_reference"]
        s = lambda k: "%.3f ± %.3f" % (p[k]["score"], p[k]["score_ci95"])
        rows.append(["`%s`" % name] + [s(k) for k in ["rl"] + RULES] + [
            ref, "%+.4f ± %.4f %s" % (v["score_difference"], v["ci95"], v["verdict"]),
            " / ".join("%.1f" % p[k]["migrations_per_episode"] for k in ("rl", ref, "oracle"))])
    head = (["scenario", "rl"] + RULES +
            ["strongest rule", "rl − strongest rule, paired", "migrations rl / rule / oracle"])
    return table(head, rows) + "\n\n" + source(r)


DP_TUNED = "measured-shares(min_gain=1.15,confirm=1)"
DP_RULES = ["measured-shares", DP_TUNED, "reactive", "reactive-tuned", "threshold", "ski-rental",
            "static"]


def dp_contest(d):
    r = d("dp-eval.json")
    envs, ids = r["figures"]["envs"], r["figures"]["ids"]
    rows = []
    for name in ids:
        p = envs[name]["policies"]
        ref = envs[name]["reference"]
        v = p["rl"]["vs_reference"]
        s = lambda k: "%.3f ± %.3f" % (p[k]["score"], p[k]["score_ci95"])
        m = lambda k: p[k]["migrations_per_episode"]
        ratio = m("rl") / m("oracle") if m("oracle") > 0 else float("inf")
        rows.append(["`%s`" % ids[name]] + [s(k) for k in ["rl"] + DP_RULES] + [
            "`%s`" % ref if ref == DP_TUNED else ref,
            "%+.4f ± %.4f %s" % (v["score_difference"], v["ci95"], v["verdict"]),
            " / ".join("%.1f" % m(k) for k in ("rl", ref, "oracle")),
            "%.2f" % ratio if m("oracle") > 0 else "—"])
    head = (["env", "rl"] + ["tuned measured-shares" if k == DP_TUNED else k for k in DP_RULES] +
            ["strongest rule", "rl − strongest rule, paired", "migrations rl / rule / oracle",
             "rl ÷ oracle migrations"])
    return table(head, rows) + "\n\n" + source(r)


def pts(x):
    """A share of the oracle's tokens in points (hundredths)."""
    return "%.2f" % (100 * x)


def policy_gap(d):
    mon = dict(d("policy-eval.json")["figures"]["families"])
    mon.update(d("holdout-eval.json")["figures"]["scenarios"])
    ex = d("information-eval.json")["figures"]["scenarios"]
    rows = []
    for name in FAMILIES + sorted(n for n in mon if n not in FAMILIES):
        p = mon[name]["policies"]
        ref = mon[name]["reference"]
        parts = lambda k, p=p: " / ".join(pts(p[k]["gap_to_oracle"][w]["share"])
                                          for w in ("onset", "next", "later"))
        gap = 1 - p[ref]["score"]
        q = ex[name]["policies"]
        best_exact = max((k for k in q if k != "oracle"), key=lambda k: q[k]["score"])
        gap_exact = 1 - q[best_exact]["score"]
        closed = "%.0f%%" % (100 * (gap - gap_exact) / gap) if gap > 0.0005 else "—"
        goal = pts(gap / 3) if gap > 0.02 else "— (under 2)"
        rows.append(["`%s`" % name if name not in FAMILIES else name, ref, pts(gap),
                     parts(ref), parts("rl"), goal,
                     "%s = %s (%s)" % (pts(gap_exact), parts(best_exact, q), best_exact), closed])
    head = ["scenario", "strongest rule", "its gap to the oracle",
            "where the truth changed / the interval after / the rest",
            "rl's, the same three", "(b): a third of the gap",
            "with exact beliefs: the strongest rule's gap, the same three",
            "of the gap, closed by exact beliefs"]
    reports = [d("policy-eval.json"), d("holdout-eval.json"), d("information-eval.json")]
    return table(head, rows) + "\n\n" + source(*reports)


def mean_m(fam, k):
    return statistics.mean(fam[f]["policies"][k]["migrations_per_episode"] for f in FAMILIES)


def training(d):
    r = d("training.json")
    rows = [m for m in r["figures"]["metrics"] if float(m["validation_score"]) >= 0]
    marks = [0.5, 1, 2, 3, 5, 8, 11, 15, 20, 30]
    out, best = [], -1.0
    for mark in marks:
        hit = next((m for m in rows if float(m["elapsed_s"]) >= 60 * mark), None)
        if hit is None:
            break
        out.append(["%.1f min" % mark, n0(int(hit["step"])), "%.3f" % float(hit["validation_score"]),
                    "%.0f s" % float(hit["cpu_s"])])
    last = rows[-1]
    best = max(rows, key=lambda m: float(m["validation_score"]))
    out.append(["end, %.1f min" % (float(last["elapsed_s"]) / 60), n0(int(last["step"])),
                "%.3f" % float(last["validation_score"]), "%.0f s" % float(last["cpu_s"])])
    text = table(["wall time (first validation past it)", "env steps", "validation score",
                  "process CPU"], out)
    text += ("\n\nBest validation score %.3f at %s steps (%.1f min). " %
             (float(best["validation_score"]), n0(int(best["step"])),
              float(best["elapsed_s"]) / 60))
    steps_per_s = [float(m["steps_per_s"]) for m in r["figures"]["metrics"]]
    text += "Env steps/s per update: median %s.\n\n" % n0(statistics.median(steps_per_s))
    return text + source(r)


def policy_latency(d):
    r = d("policy-latency.json")
    f = r["figures"]
    rows = [[p["description"], "%.1f µs" % p["median_us"], "%.1f µs" % p["p90_us"],
             "%.1f µs" % p["p99_us"], n0(p["decisions"])] for p in f["paths"]]
    text = table(["path", "median", "p90", "p99", "decisions"], rows)
    shipped = "the shipped policy" if f.get("checkpoint_found") else "no checkpoint found"
    return text + "\n\n%s network of %s parameters (%s). Target: median < 50 µs.\n\n" % (
        "A", n0(f["parameters"]), shipped) + source(r)


def tps3(x):
    return " / ".join(n0(x[k]) if x.get(k) is not None else "–" for k in ("before", "during", "after"))


def deploy_straggler(d):
    reports = [d("deploy-straggler-64.json"), d("deploy-straggler-64-reactive.json"),
               d("deploy-straggler-256.json")]
    rows = []
    for r in reports:
        f = r["figures"]
        c, det, com = f["config"], f["detection"], f["commit"]
        t = f["true_tokens_per_s"]
        rows.append([
            n0(c["ranks"]), f["policy"]["name"],
            ("step %d, +%.0f ms" % (det["step"], det["ms_after_slowdown"])) if det["detected"] else "not detected",
            ("step %d, +%.0f ms" % (com["step"], com["ms_after_slowdown"])) if com["committed"] else "none",
            "`%s`" % com["layout"] if com["committed"] else "–",
            tps3(t["with_agent"]), tps3(t["without_agent"]),
            "%.2f×" % f["simulated_job_s"]["without_over_with"]])
    head = ["ranks", "policy", "detected", "committed", "switched to",
            "tokens/s with the agent, before / during / after",
            "without the agent, same windows", "job time without ÷ with"]
    ev = reports[0]["figures"]["detection"]
    text = table(head, rows)
    if ev.get("evidence"):
        text += "\n\nThe evidence of the first detection (64 ranks): %s." % ev["evidence"]
    return text + "\n\n" + source(*reports)


def q3(x, digits=2):
    if x.get("p50") is None:
        return "–"
    return " / ".join(("%." + str(digits) + "f") % x[k] for k in ("p50", "p99", "max"))


def deploy_latency(d):
    reports = []
    for i in (1, 2, 3):
        try:
            reports.append(d("deploy-latency-%d.json" % i))
        except FileNotFoundError:
            break
    rows = []
    for i, r in enumerate(reports, 1):
        f = r["figures"]
        la = r["load_average"]
        prep = f["prepare_latency_ms"].get("per_switch") or []
        rows.append([i, "%.1f–%.1f" % (la["start"][0], la["end"][0]), f["policy"]["name"],
                     q3(f["decision_latency_ms"]) + " ms", q3(f["step_close_ms"]) + " ms",
                     q3(f["decide_ms"], 3) + " ms",
                     ("%.2f–%.2f ms (%d)" % (min(prep), max(prep), len(prep))) if prep else "none",
                     "%.2f s of %.1f s (%.0f%%), %.0f MiB" % (
                         f["agent_cpu_s"], f["wall_s"], 100 * f["agent_cpu_share_of_core"],
                         f["peak_rss_mib"]),
                     "%d in the background, last %.1f ms" % (f["planner"]["searches"],
                                                             f["planner"]["last_search_ms"])])
    head = ["run", "load (1-min, start–end)", "policy",
            "last telemetry → decision p50 / p99 / max", "of which step close",
            "of which decide()", "→ PlanPrepare (switches)", "agent CPU, peak RSS",
            "planner"]
    return table(head, rows) + "\n\n" + source(*reports)


def deploy_scale(d):
    reports = [d("deploy-scale-16384-%d.json" % i) for i in (1, 2, 3)]
    reports.append(d("deploy-scale-65536-1.json"))
    rows = []
    for r in reports:
        f = r["figures"]
        la = r["load_average"]
        load = "%.1f–%.1f" % (la["start"][0], la["end"][0])
        ranks = n0(f["config"]["ranks"])
        if "not_run" in f:
            rows.append([ranks, load, "not run: " + f["not_run"], "", "", "", ""])
            continue
        bus = f["bus"]
        cluster = f.get("cluster") or {}
        rows.append([ranks, load,
                     q3(f["decision_latency_ms"]) + " ms (%d)" % f["decision_latency_ms"]["n"],
                     q3(f["step_close_ms"]) + " ms", q3(f["decide_ms"], 3) + " ms",
                     "%.0f%% of one core, %.0f MiB" % (100 * f["agent_cpu_share_of_core"],
                                                       f["peak_rss_mib"]),
                     "%s accepted, %s authenticated, %s closed for an error, %s waited for a "
                     "handshake slot; %s of %s ranks connected at the last step" % (
                         n0(bus["accepted"]), n0(bus["authenticated"]), n0(bus["rejected"]),
                         n0(bus["handshakes_queued"]), n0(cluster.get("connected_ranks", 0)),
                         ranks)])
    head = ["ranks", "load (1-min, start–end)", "last telemetry → decision p50 / p99 / max (n)",
            "of which step close", "of which decide()", "agent CPU, peak RSS", "bus"]
    return table(head, rows) + "\n\n" + source(*reports)


def transport_bus(d):
    r = d("transport.json")
    f = r["figures"]
    by = {(m["publishers"], m["bus"]): m for m in f["medians"]}
    rows = []
    for n in sorted({m["publishers"] for m in f["medians"]}):
        ours, zmq = by.get((n, "parapilot")), by.get((n, "zeromq"))
        if not ours or not zmq:
            continue
        runs = [x for x in f["runs"] if x["publishers"] == n]
        per_run = " ".join("%.2f" % (a["throughput_msgs_per_s"] / b["throughput_msgs_per_s"])
                           for a, b in zip([x for x in runs if x["bus"] == "parapilot"],
                                           [x for x in runs if x["bus"] == "zeromq"]))
        rows.append([n, "%s / %s" % (n0(ours["throughput_msgs_per_s"]),
                                     n0(zmq["throughput_msgs_per_s"])),
                     "%.2f× (runs: %s)" % (ours["throughput_msgs_per_s"] /
                                           zmq["throughput_msgs_per_s"], per_run),
                     "%.0f / %.0f µs" % (ours["p99_us"], zmq["p99_us"]),
                     "%.0f / %.0f µs" % (ours["p50_us"], zmq["p50_us"]),
                     "%.2f / %.2f µs" % (ours["cpu_us_per_msg"], zmq["cpu_us_per_msg"])])
    c = f["config"]
    head = ["publishers", "throughput msgs/s, parapilot / ZeroMQ", "ratio (median)",
            "p99 latency", "p50 latency", "CPU per message"]
    return table(head, rows) + (
        "\n\n%d-byte frames; throughput with at most %s in flight; latency at %s msgs/s "
        "offered; %.1f s per phase; medians of %d runs, the buses alternating. " % (
            c["frame_bytes"], n0(c["window"]), n0(c["rate"]), c["seconds"], c["repeat"])) + source(r)


def pct(x):
    return "–" if x is None else "%.1f%%" % (100 * x)


def deploy_live(d):
    reports = [d("deploy-live.json"), d("deploy-live-reactive.json")]
    rows = []
    medians = []
    for r in reports:
        f = r["figures"]
        pol = f["policy"]
        name = pol["name"] + (" (fell back: %s)" % pol["fallback_reason"] if pol["fallback"] else "")
        medians.append((name, f["median"].get("recovered_share_of_loss"),
                        f["median"].get("after_over_ideal")))
        rows += deploy_live_rows(f, name)
    head = ["policy", "round", "onset step", "detected", "committed",
            "samples/s with the agent: before / during / after", "without: before / after",
            "ideal", "after ÷ ideal", "recovered (of the loss)"]
    summary = "; ".join("%s recovered %s of the loss (after ÷ ideal %s)" % (n, pct(rec), pct(ai))
                        for n, rec, ai in medians)
    return (table(head, rows) + "\n\nMedians over the rounds: " + summary + ".\n\n" +
            source(*reports))


def num(x):
    """One decimal, or a dash where the round has no figure (no switch after the onset)."""
    return "–" if x is None else "%.1f" % x


def deploy_live_rows(f, name):
    rows = []
    for x in f["rounds"] + [dict(f["median"], round="median")]:
        sp = x["samples_per_s"]
        w, wo = sp["with_agent"], sp["without_agent"]
        rows.append([name, x["round"], x.get("onset_step", ""),
                     "+%.2f s" % x["detection_delay_s"] if x.get("detection_delay_s") is not None else "–",
                     "+%.2f s" % x["commit_delay_s"] if x.get("commit_delay_s") is not None else "–",
                     "%s / %s / **%s**" % (num(w["before"]), num(w["during"]), num(w["after"])),
                     "%.1f / %.1f" % (wo["before"], wo["after"]), "%.1f" % sp["ideal"],
                     pct(x.get("after_over_ideal")), pct(x.get("recovered_share_of_loss"))])
    return rows


def pytorch_job(d):
    r = d("pytorch-job.json")
    names = {"healthy": "(a) healthy", "forward": "(b) slow inside the forward",
             "data": "(c) slow in data loading, before the forward",
             "optimizer": "(d) slow in the optimizer step (fixed per step)"}
    rows = []
    for c in r["figures"]["cases"]:
        rej = sum(c["telemetry_rejected"].values()) if c.get("telemetry_rejected") else 0
        rows.append([names.get(c["case"], c["case"]), ms(c["without_ms"]), ms(c["with_ms"]),
                     "%.3f" % c["ratio"], "%d (%d)" % (c["committed"], c["reverted"]),
                     c["aborted"], c["slow_rank_events"],
                     ",".join(str(v) for v in c["final_counts"]), rej,
                     "%.2f s" % c["deploy_cpu_s"]])
    head = ["case", "without the agent", "with the agent", "ratio", "commits (reverts)",
            "aborted", "slow-rank events", "final shares", "telemetry rejected", "deploy CPU"]
    return table(head, rows) + "\n\n" + source(r)


def pytorch_matrix(d):
    r = d("pytorch-matrix.json")
    cases = r["figures"]["cases"]
    rows = []
    for c in cases:
        if c["shape"] == "guardrail":
            continue
        without = " / ".join("%.1f" % x for x in c["without_ms"])
        rows.append([c["shape"], c["condition"], without, "%.1f" % c["with_ms"], "%.2f" % c["ratio"],
                     ",".join(str(v) for v in c["final_counts"]),
                     "%d (%d)" % (c["committed"], c["reverted"]),
                     "yes" if not c["failed"] else "**no**: " + "; ".join(c["failed"])])
    head = ["shape", "condition", "without the agent (ms)", "with, second half (ms)", "ratio",
            "final shares", "commits (reverts)", "passed"]
    out = table(head, rows)
    guard = [c for c in cases if c["shape"] == "guardrail"]
    if guard:
        g = guard[-1]
        out += ("\n\nGuardrail (a deliberately wrong switch): deploy's switches and reverts in "
                "order: %s; final shares %s; %d reverted." % (
                    ", ".join(g["decisions"]) or "none",
                    ",".join(str(v) for v in g["final_counts"]), g["reverted"]))
    out += "\n\nctest exit code %d.\n\n" % r["figures"]["ctest_exit"] + source(r)
    return out


def pytorch_policies(d):
    r = d("pytorch-policies.json")
    f = r["figures"]
    rows = []
    for x in f["summary"]:
        shares = {}
        for counts in x["final_counts"]:
            key = ",".join(str(v) for v in counts)
            shares[key] = shares.get(key, 0) + 1
        rows.append([x["condition"], x["policy"] if x["policy"] != "none" else "no agent",
                     "%.1f" % x["second_half_ms"], "%.2f" % x["total_s"],
                     "%d (%d)" % (x["commits"], x["reverts"]) if "commits" in x else "–",
                     "; ".join("%s ×%d" % (k, n) if n > 1 else k for k, n in shares.items())])
    head = ["condition", "policy", "second half (ms)", "total (s)", "commits (reverts)",
            "final shares (rounds)"]
    out = ("Medians over the %d rounds; commits and reverts summed over them.\n\n"
           % f["rounds"]) + table(head, rows)
    rows = []
    for x in f["comparisons"]:
        against = "no agent" if x["against"] == "none" else x["against"]
        unit, digits = ("ms", 1) if x["metric"] == "second_half_ms" else ("s", 2)
        fmt = "%+." + str(digits) + "f"
        ci = ("[" + fmt % x["low"] + ", " + fmt % x["high"] + "]") if x["low"] is not None else "–"
        rows.append([x["condition"], "%s vs %s" % (x["policy"], against),
                     "second half" if x["metric"] == "second_half_ms" else "total time",
                     (fmt + " %s (%+.1f%%)") % (x["mean"], unit, x["mean_pct_of_against"]),
                     ci, "**%s**" % x["verdict"] if x["verdict"] == "worse" else x["verdict"]])
    head = ["condition", "pair (A vs B)", "figure", "mean of B − A", "95% interval",
            "verdict for A"]
    out += ("\n\nPaired over the rounds: B's figure minus A's in the same round (above 0: A "
            "faster); the interval is the t distribution's over the rounds.\n\n" + table(head, rows))
    out += ("\n\nThe %d rounds took %.0f minutes.\n\n" % (f["rounds"], f["wall_s"] / 60) +
            source(r))
    return out


def fsdp(d):
    r = d("fsdp-mixed.json")
    f = r["figures"]
    s = f["summary"]
    names = {"healthy": "healthy devices, no agent", "none": "mixed devices, no agent",
             "agent": "mixed devices, deploy"}
    rows = []
    for k in ("healthy", "none", "agent"):
        shares = {}
        for counts in s["final_counts"][k]:
            key = ",".join(str(v) for v in counts)
            shares[key] = shares.get(key, 0) + 1
        rows.append([names[k], "%.1f" % s["second_half_ms"][k], "%.2f" % s["steps_per_s"][k],
                     "; ".join("%s ×%d" % (c, n) if n > 1 else c for c, n in shares.items())])
    rows.append(["sum-of-speeds bound (mixed)", "%.1f" % s["bound_step_ms"],
                 "%.2f" % s["bound_steps_per_s"], "–"])
    head = ["run", "second half (ms)", "steps/s", "final shares (rounds)"]
    out = ("Medians over %d rounds of %d steps. Bound: %d samples / %.2f (the sum of the speeds) × "
           "%.1f ms + %.1f ms fixed (the healthy run's step less an even share's device time)."
           "\n\n" % (f["rounds"], f["steps"], f["global_batch"], s["sum_of_speeds"],
                      f["device_ms_per_sample"], s["fixed_ms"])) + table(head, rows)
    out += ("\n\nWith deploy: %.2f× the steps/s without it, %.0f%% of the bound; %d commits "
            "(%d reverts) over the rounds.\n\n" % (s["agent_over_none"],
                                                    100 * s["agent_of_bound"], s["commits"],
                                                    s["reverts"]) + source(r))
    return out


def netns_compression(d):
    reports = [d("netns-compression-200.json"), d("netns-compression-0.json")]
    rows = []
    for r in reports:
        f = r["figures"]
        link = "%g Mbit/s" % f["rate_mbit"] if f["rate_mbit"] else "not limited"
        order = ["none", "fp16", "topk", "powersgd"]
        for m, x in sorted(f["summary"].items(),
                           key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
            rows.append([link, m, "%.1f (%.1f–%.1f)" % (x["median_step_ms"], x["min_ms"], x["max_ms"]),
                         "%.2f×" % x["step_vs_none"], "%.1f" % (x["wire_tx_per_host_step"] / 1e3),
                         "%.1f" % (x["client_bytes_per_step"] / 1e3),
                         "%.3f" % statistics.median(x["final_loss"])])
    head = ["links", "method", "median step ms (range over rounds)", "vs none",
            "sent per host per step, wire KB", "client KB", "final loss"]
    f = reports[0]["figures"]
    out = ("4 ranks, one per host, model width %d, global batch %d, %d rounds of %d steps under "
           "the plan (after its first 3). Wire bytes: the hosts' interface counters; client: the "
           "bytes the client says it all-reduced and all-gathered.\n\n"
           % (f["hidden"], f["global_batch"], f["rounds"], f["steps"])) + table(head, rows)
    return out + "\n\n" + source(*reports)


def netns_congestion(d):
    reports = [d("netns-congestion-%d.json" % i) for i in (1, 2, 3)]
    restore = d("netns-congestion-restore.json")
    rows = []

    def switches(agent):
        out = []
        for e in agent.get("link", []):
            out.append("%s at %d" % (e["event"], e["step"]))
        for m in agent.get("migrations", []):
            if m.get("outcome") == "committed":
                out.append("%s from %d%s" % (m.get("compression", "?"), m["switch_at_step"],
                                            " (shares %s)" % m["shares"]
                                            if m.get("shares") != "8,8,8,8" else ""))
        return "; ".join(out) or "none"

    for name, r in [("%d" % (i + 1), x) for i, x in enumerate(reports)] + [("recovers", restore)]:
        none, agent = r["figures"]["runs"]
        rows.append([name, "%.1f / %.1f" % (none["median_step_ms_before"],
                                             none["median_step_ms_last_quarter"]),
                     "%.1f / %.1f" % (agent["median_step_ms_before"],
                                      agent["median_step_ms_last_quarter"]),
                     "%.2f×" % (agent["median_step_ms_last_quarter"]
                                / none["median_step_ms_last_quarter"]),
                     "%.0f" % (agent["grad_bytes_last_quarter"] / 1e3), switches(agent)])
    head = ["run", "no agent: step ms before / last quarter",
            "deploy: step ms before / last quarter", "last quarter vs no agent",
            "deploy: gradient KB a step, last quarter", "deploy's link events and switches (step)"]
    f = reports[0]["figures"]
    g = restore["figures"]
    out = ("4 ranks, one per host, model width %d, global batch %d, %d steps; host %d's link "
           "limited to %g Mbit/s once host 0 has sent about %d steps' traffic (for the rest of "
           "the run; \"recovers\": %d steps, unlimited again %g s later). Step: rank 0's median "
           "cycle; gradient KB: the client's count.\n\n"
           % (f["hidden"], f["global_batch"], f["steps"], f["host"], f["rate_mbit"],
              f["at_step"], g["steps"], g["restore_after_s"])) + table(head, rows)
    return out + "\n\n" + source(*reports, restore)


def pytorch_overhead(d):
    r = d("pytorch-overhead.json")
    f = r["figures"]
    m, o, p = f["median_step_ms"], f["overhead_ms"], f["overhead_pct"]
    b = f["session_bookkeeping_ms_median"]
    row = [ms(m["plain"]),
           "%s (%+.2f ms, %+.1f%%)" % (ms(m["session"]), o["session"], p["session"]),
           "%s (%+.2f ms, %+.1f%%)" % (ms(m["session+agent"]), o["session+agent"],
                                       p["session+agent"]),
           "%.2f ms / %.2f ms" % (b["session"], b["session+agent"]),
           "%.2f s" % f["deploy_cpu_s"] if f.get("deploy_cpu_s") is not None else "–"]
    head = ["plain DDP step", "+ Session, no agent", "+ Session and agent",
            "session's own work per step (no agent / agent)", "deploy's CPU over the run"]
    return table(head, [row]) + "\n\n" + source(r)


def live_elastic(d):
    r = d("live-elastic.json")
    f = r["figures"]
    rows = []
    for x in f["rounds"] + [dict(f["median"], round="median")]:
        rows.append([x["round"], n0(x["healthy_tokens_per_s"]), n0(x["uniform_tokens_per_s"]),
                     n0(x["elastic_tokens_per_s"]), n0(x["ideal_tokens_per_s"]),
                     pct(x["elastic_over_ideal"]), "**%s**" % pct(x["recovered_share_of_loss"]),
                     " / ".join("%.2f" % v for v in x["elastic_shares"]) if "elastic_shares" in x else ""])
    head = ["round", "healthy", "uniform", "elastic", "ideal", "elastic ÷ ideal",
            "recovered (of the loss)", "shares"]
    return table(head, rows) + "\n\n(tokens/s.) " + source(r)


def live_compression(d):
    r = d("live-compression.json")
    rows = []
    for x in r["figures"]["runs"]:
        plan = x["plan"]["summary"] if x.get("plan") else "none"
        rows.append([x["label"], plan, n0(x["allreduce_bytes_per_rank_modelled"]),
                     "—" if x["run"] == "uncompressed" else "**%s**" % pct(x["bytes_cut_share"]),
                     "%.4f" % x["final_loss"],
                     "—" if x["run"] == "uncompressed" else "%+.2f%%" % (100 * x["final_loss_vs_uncompressed"])])
    head = ["run", "plan", "all-reduce bytes per rank (modelled)", "cut", "final loss",
            "vs uncompressed"]
    note = ("\n\nBytes are rank 0's over the whole run, from the ring algorithms' formulas "
            "applied to each collective's payload (docs/live.md, Telemetry), not counted on the "
            "wire; top-k layers add their all-gather's bytes.")
    return table(head, rows) + note + "\n\n" + source(r)


def opt(x, fmt):
    return "–" if x is None else fmt % x


def live_layouts(d):
    r = d("live-layouts.json")
    rows = []
    for x in r["figures"]["layouts"]:
        diff = x["parameters_vs_dp4"]
        rows.append(["`%s`" % x["layout"], "%.8f" % x["loss"],
                     "—" if diff is None else ("identical" if x["identical_to_dp4"] else "%.1e" % diff),
                     "%.1f s" % x["wall_s"]])
    last = r["figures"]["layouts"][0]["last_step"]
    return table(["layout", "loss at step %d" % last, "parameters vs dp=4", "wall"], rows) + \
        "\n\n" + source(r)


def live_switch_pause(d):
    r = d("live-switch-pause.json")
    rows = []
    for x in r["figures"]["pause"]:
        rows.append([x["kind"], "`%s` → `%s`" % (x["from"], x["to"]), "%.1f" % x["pause_ms"],
                     opt(x.get("switch_step_excess_ms"), "%.0f"), n0(x["bytes_moved"]),
                     "%.0f" % x["staged_ms"],
                     opt(x.get("boundary_pause_ms"), "%.1f"),
                     "–" if x.get("boundary_bytes_moved") is None else n0(x["boundary_bytes_moved"]),
                     n0(x["restart_downtime_ms"]),
                     "%s / %s / %s" % (opt(x.get("restart_stop_to_exit_ms"), "%.0f"),
                                       opt(x.get("restart_exit_to_start_ms"), "%.0f"),
                                       opt(x.get("restart_start_to_first_step_ms"), "%.0f")),
                     opt(x.get("restart_step_ms"), "%.0f"),
                     "**%.2f%%**" % (100 * x["pause_over_restart"]),
                     opt(None if x.get("excess_over_restart") is None
                         else 100 * x["excess_over_restart"], "%.1f%%")])
    head = ["kind", "switch", "pause (ms)", "switch step's excess (ms)", "bytes moved",
            "staged beside training (ms)", "pause at the boundary (ms)",
            "bytes moved at the boundary", "restart downtime (ms)",
            "of it: save and exit / relaunch / start to first step (ms)", "step after restart (ms)",
            "pause ÷ restart", "excess ÷ restart"]
    return table(head, rows) + "\n\n" + source(r)


def pipeline_switch(d):
    r = d("pipeline-switch.json")
    f = r["figures"]
    rows = []
    for name, x in f["runs"].items():
        rows.append(["live block move, %s (%d switches)" % (name, len(x["pauses"])),
                     "%.1f" % x["pause_median_ms"], ", ".join("%.1f" % p for p in x["pauses"]),
                     "%+.0f" % x["excess_median_ms"],
                     "–" if x["streaming_excess"] is None else "%+.1f" % x["streaming_excess"],
                     "%+.1f" % x["quiet_excess"],
                     n0(statistics.median(x["moved"])), "%.0f" % x["step_ms"]])
    rows.append(["stop, save, relaunch, load (%d restarts)" % len(f["restart_pauses_ms"]),
                 n0(f["restart_pause_median_ms"]),
                 ", ".join(n0(x) for x in f["restart_pauses_ms"]), "–", "–", "–", "–", "–"])
    head = ["way", "pause, median (ms)", "each (ms)", "switching step's excess, median (ms)",
            "streaming steps' excess, median (ms)", "other steps' excess, median (ms)",
            "bytes moved", "median step (ms)"]
    return (table(head, rows) + "\n\nSplit %s ↔ %s of %d blocks over %d stages (width %d). "
            "Restart ÷ streamed live pause: **%.0f×**.\n\n"
            % (",".join(map(str, f["split_a"])), ",".join(map(str, f["split_b"])), f["blocks"],
               f["stages"], f["width"], f["ratio"]) + source(r))


def pipeline_slow(d):
    r = d("pipeline-slow.json")
    f = r["figures"]
    rows = [[x["run"], "%.1f" % x["before"], "**%.1f**" % x["during"], "%.1f" % x["after"]]
            for x in f["runs"]]
    head = ["run", "before (samples/s)", "slowed (samples/s)", "after (samples/s)"]
    splits = "; ".join("step %d: %s" % (c["step"], ",".join(map(str, c["split"])))
                       for c in f["deploy_splits"]) or "none"
    static = ("the split deploy ran at the end of the slowed phase" if f["static_from_deploy"]
              else "one block off the slowed stage (deploy moved nothing while it was slow)")
    return (table(head, rows) + "\n\nStage 2 three times slower from step %d to %d of %d; "
            "the static run is %s. Deploy's splits: %s.\n\n"
            % (f["slow_from"], f["slow_until"], f["steps"], static, splits) + source(r))


def live_switch_slowed(d):
    r = d("live-switch-slowed.json")
    f = r["figures"]["slowed"]

    def sps(x):
        return "–" if x is None else "%.1f" % x

    def switch(w):
        early = "".join("step %d to %s, before the slowdown; " % (e["step"], e["to"])
                        for e in w.get("switches_before_onset", []))
        if w.get("switch_step") is None:
            return early + "none after the slowdown (ends on `%s`)" % w["final_layout"]
        return early + "step %d to %s (ends on `%s`)" % (w["switch_step"], w["switched_to"],
                                                        w["final_layout"])
    rows = []
    for key, name in (("deploy_default", "deploy, the shipped policy"),
                      ("deploy_reactive", "deploy, reactive"), ("none", "no agent")):
        w = f[key]
        rows.append([name, w["onset_step"], sps(w["before"]), sps(w["during"]), sps(w["after"]),
                     switch(w)])
    for x in f["static"]:
        best = " (best)" if x["layout"] == f["best_static"]["layout"] else ""
        rows.append(["static `%s`%s, slowed from the start" % (x["layout"], best), "–", "–",
                     sps(x["slowed"]), "–", "–"])
    head = ["run", "slowdown from step", "samples/s before", "during (slowed, before a switch)",
            "after the switch", "switches committed (deploy's log)"]
    notes = []
    for key, name in (("deploy_default", "shipped policy"), ("deploy_reactive", "reactive")):
        lines = f[key].get("agent", [])
        if lines:
            notes.append("Deploy's own summary (%s):\n\n```\n%s\n```" % (name, "\n".join(lines)))
    return table(head, rows) + "\n\n" + "\n\n".join(notes) + "\n\n" + source(r)


def live_switch_staging(d):
    r = d("live-switch-staging.json")
    rows = []
    for x in r["figures"]["staging"]:
        rows.append(["%.0f" % x["stage_delay_ms"],
                     "%d / %d / %d" % (x["prepared_at_step"], x["ready_at_step"], x["at_step"]),
                     "%.0f" % x["staged_ms"], opt(x.get("step_ms_before"), "%.0f"),
                     "%s (%d steps, max %s)" % (opt(x.get("step_ms_staging"), "%.0f"),
                                                x["staging_steps"],
                                                opt(x.get("step_ms_staging_max"), "%.0f")),
                     "%s (%d steps)" % (opt(x.get("step_ms_held"), "%.0f"), x["held_steps"]),
                     opt(None if x.get("staging_over_before") is None
                         else 100 * (x["staging_over_before"] - 1), "%+.1f%%")])
    head = ["stage delay (ms)", "PlanPrepare / PlanReady / switch at step", "staged (ms)",
            "step before (ms)", "step while staging (ms)", "step with the staged copy held (ms)",
            "staging vs before"]
    return table(head, rows) + "\n\n" + source(r)


# ---- planner, simulator and cost model speed -------------------------------------------------

def planner_searches(d):
    r = d("planner.json")
    f = r["figures"]
    names = {"gpt3-175b": "gpt3-175b, %d a100-80g",
             "llama2-70b-mixed": "llama2-70b, half a100-80g / half h800 (%d), two slowed GPUs"}
    rows = [[names.get(x["name"], x["name"] + " %d") % x["gpus"], ms(x["median_ms"], 1),
             n0(x["evaluated"]), n0(x["pruned"])] for x in f["searches"]]
    text = table(["search", "wall time (median of %d)" % f["repetitions"], "evaluated",
                  "pruned by bound"], rows)
    grow = [[n0(x["gpus"]), ms(x["gpt3_175b"]["median_ms"], 1),
             ms(x["llama2_70b_mixed"]["median_ms"], 1), n0(x["gpt3_175b"]["evaluated"]),
             n0(x["llama2_70b_mixed"]["evaluated"])] for x in f["scaling"]]
    text += "\n\n" + table(["GPUs", "gpt3-175b", "llama2-70b mixed, 2 slowed",
                               "evaluated (gpt3)", "evaluated (llama2)"], grow)
    return text + "\n\n" + source(r)


def planner_mixed(d):
    r = d("planner.json")
    m = r["figures"]["mixed_cluster"]
    return ("%s on %s, global batch %d: the planner's layout %s %s tokens/s, %.2f× uniform data "
            "parallel (%s) and %.1f%% of the upper bound %s tokens/s (the sum of the GPUs' "
            "speeds: each GPU alone at its best microbatch).\n\n" % (
                m["model"], m["cluster"], m["global_batch"],
                "(elastic shares)" if m["planner_elastic_shares"] else "",
                n0(m["planner_best_tokens_per_s"]), m["planner_over_uniform"],
                n0(m["uniform_dp_tokens_per_s"]), 100 * m["planner_over_sum_of_speeds"],
                n0(m["sum_of_gpu_speeds_tokens_per_s"]))) + source(r)


def env_speed(d):
    r = d("env.json")
    f = r["figures"]
    rows = []
    for x in f["envs"]:
        big = "1024" in x["env"]
        target = f["target_steps_per_s_1024_gpus" if big else "target_steps_per_s_64_gpus"]
        rows.append(["`%s`" % x["env"], n0(x["steps_per_s_one_thread"]),
                     n0(x["steps_per_s_vectorised"]), n0(target),
                     "met" if x["steps_per_s_one_thread"] >= target else "**not met**"])
    envs = f["envs"][0]
    head = ["env", "steps/s, 1 thread",
            "steps/s, %d envs on %d threads" % (envs["vector_envs"], envs["vector_threads"]),
            "target (1 thread)", ""]
    return table(head, rows) + "\n\n%g s per case. " % f["seconds_per_case"] + source(r)


def cost_model_calibration(d):
    r = d("calibration.json")
    rows = []
    for x in r["figures"]["rows"]:
        unit = "s/step" if x["figure"] == "iteration_s" else "TFLOP/s/GPU"
        fmt = "%.3f %s" if x["figure"] == "iteration_s" else "%.1f %s"
        rows.append(["%s (`%s`)" % (x["run"], x["file"]), x["gpus"], x["layout"], x["attention"],
                     fmt % (x["published"], unit), fmt % (x["predicted"], unit),
                     "%+.1f%%" % (100 * x["error"]),
                     "%.1f of %.0f GiB, %s" % (x["memory_gib"], x["memory_capacity_gib"],
                                               "fits" if x["fits_in_memory"] else "**does not fit**")])
    head = ["run", "GPUs", "layout", "attention", "published", "predicted", "error", "memory"]
    return table(head, rows) + "\n\nDeterministic (no timing). " + source(r)


def cost_model_speed(d):
    r = d("cost-model.json")
    f = r["figures"]
    names = {"nominal": "nominal", "slowed": "two slowed GPUs, one congested node"}
    rows = []
    for c in f["cases"]:
        target = c.get("target_evaluations_per_s", f["target_evaluations_per_s"])
        rows.append([names.get(c["conditions"], c["conditions"]), n0(c["median_evaluations_per_s"]),
                     "%s–%s" % (n0(c["min_evaluations_per_s"]), n0(c["max_evaluations_per_s"])),
                     n0(target), "met" if c["median_evaluations_per_s"] >= target else "**not met**"])
    head = ["conditions", "evaluations/s, median", "range", "target", ""]
    return table(head, rows) + "\n\n%s on %s, %d layouts in turn, one thread. " % (
        f["model"], f["cluster"], f["layouts"]) + source(r)


RENDER = {
    "policy-holdout": policy_holdout,
    "policy-latency": policy_latency,
    "deploy-straggler": deploy_straggler,
    "deploy-latency": deploy_latency,
    "deploy-scale": deploy_scale,
    "transport-bus": transport_bus,
    "deploy-live": deploy_live,
    "pytorch-job": pytorch_job,
    "pytorch-overhead": pytorch_overhead,
    "pytorch-matrix": pytorch_matrix,
    "pytorch-policies": pytorch_policies,
    "fsdp": fsdp,
    "live-elastic": live_elastic,
    "live-compression": live_compression,
    "netns-compression": netns_compression,
    "netns-congestion": netns_congestion,
    "live-layouts": live_layouts,
    "live-switch-pause": live_switch_pause,
    "live-switch-slowed": live_switch_slowed,
    "live-switch-staging": live_switch_staging,
    "pipeline-switch": pipeline_switch,
    "pipeline-slow": pipeline_slow,
    "planner-searches": planner_searches,
    "planner-mixed": planner_mixed,
    "env-speed": env_speed,
    "cost-model-speed": cost_model_speed,
    "cost-model-calibration": cost_model_calibration,
    "training": training,
    "policy-quality": policy_quality,
    "policy-summary": policy_summary,
    "policy-gap": policy_gap,
    "dp-contest": dp_contest,
}


def render_doc(text, data, missing):
    def one(m):
        name = m.group(2)
        if name not in RENDER:
            missing.append("%s (no such table)" % name)
            return m.group(0)
        try:
            body = RENDER[name](data).rstrip("\n") + "\n"
        except FileNotFoundError as e:
            missing.append("%s (%s)" % (name, os.path.basename(e.filename)))
            return m.group(0)
        return m.group(1) + body + m.group(4)
    return BLOCK.sub(one, text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    ap.add_argument("--check", action="store_true", help="exit 1 when a doc is out of date")
    a = ap.parse_args()
    data = Data(a.data)
    stale, missing = [], []
    for doc in DOCS:
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()
        new = render_doc(text, data, missing)
        if new != text:
            stale.append(doc)
            if not a.check:
                with open(path + ".tmp", "w") as f:
                    f.write(new)
                os.replace(path + ".tmp", path)
    for m in missing:
        print("no data for %s" % m, file=sys.stderr)
    if a.check:
        for doc in stale:
            print("%s: its tables differ from what %s renders" % (doc, a.data), file=sys.stderr)
        sys.exit(1 if stale or missing else 0)
    for doc in stale:
        print("rendered %s" % doc, file=sys.stderr)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
