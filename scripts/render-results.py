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
DOCS = ["docs/results.md", "docs/planner.md", "docs/cost-model.md"]
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

def policy_quality(d):
    r = d("policy-eval.json")
    fam = r["figures"]["families"]
    rows = []
    for f in FAMILIES:
        p = fam[f]["policies"]
        s = lambda k: "%.3f ± %.3f" % (p[k]["score"], p[k]["score_ci95"])
        tps = lambda k: p[k]["throughput_tokens_per_s"]
        diff = round(100 * (p["rl"]["score"] - p["reactive"]["score"]), 1) + 0.0
        rows.append([f, s("rl"), s("static"), s("reactive"), s("uniform-dp"),
                     n0(tps("oracle")), "%.2f×" % (tps("rl") / tps("static")),
                     "%.2f×" % (tps("rl") / tps("uniform-dp")), "%+.1f" % diff,
                     " / ".join("%.1f" % p[k]["migrations_per_episode"]
                                for k in ("rl", "reactive", "oracle"))])
    head = ["family", "rl", "static", "reactive", "uniform-dp", "oracle tokens/s",
            "rl ÷ static", "rl ÷ uniform-dp", "rl − reactive (points)",
            "migrations rl / reactive / oracle"]
    return table(head, rows) + "\n\n" + source(r)


def policy_summary(d):
    r = d("policy-eval.json")
    fam = r["figures"]["families"]
    mean = lambda k: statistics.mean(fam[f]["policies"][k]["score"] for f in FAMILIES)
    ahead = [f for f in FAMILIES
             if fam[f]["policies"]["rl"]["score"] >= fam[f]["policies"]["reactive"]["score"]]
    inside = [f for f in FAMILIES
              if abs(fam[f]["policies"]["rl"]["score"] - fam[f]["policies"]["reactive"]["score"])
              <= fam[f]["policies"]["rl"]["score_ci95"] + fam[f]["policies"]["reactive"]["score_ci95"]]
    rows = [["mean score over the six families", "%.3f" % mean("rl"), "%.3f" % mean("reactive"),
             "%.3f" % mean("static")],
            ["families where rl ≥ reactive", "%d of 6" % len(ahead), "", ""],
            ["families where the two intervals overlap", "%d of 6" % len(inside), "", ""],
            ["migrations per episode, mean", "%.1f" % mean_m(fam, "rl"),
             "%.1f" % mean_m(fam, "reactive"), "%.1f" % mean_m(fam, "static")]]
    return table(["", "rl", "reactive", "static"], rows) + "\n\n" + source(r)


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


RENDER = {
    "training": training,
    "policy-quality": policy_quality,
    "policy-summary": policy_summary,
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
