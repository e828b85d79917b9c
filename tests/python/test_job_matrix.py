"""The job-shape matrix: the project's own DDP scripts of the shapes real jobs have
(job_shapes.py: buffers broadcast at every forward, a logging all-reduce, barriers, gradient
accumulation with no_sync, evaluation between epochs, gradient clipping, two parameter groups),
each on 4 CPU Gloo ranks, under every condition, without and with `parapilot deploy --listen
ADDR --secret-file F` (nothing else: the shipped defaults).

Conditions (each rank's emulated device, job_shapes.Device): healthy; rank 2 a 3x slower
device with the extra time in its forward, backward, data loading or optimizer step; mixed
speeds 1, 1, 2, 3x through the whole step (device generations). Each case asserts:
  * the slowed ranks end with the smallest shares (a single slowed rank: the smallest, below
    an even share; mixed: both slowed ranks below both healthy ones);
  * no healthy rank ends below an even share (healthy: the shares stay even);
  * slowed: the second half of the run with the agent is at least 10% faster (median step) than
    the run without it;
  * healthy: the run with the agent is no slower than the two runs without it around it, beyond
    their spread (the largest of the two runs' difference, the difference of each run's two
    halves, and three robust standard errors). The runs without it are as long as the run with
    it and are measured over the same steps (the second half): a job's step time drifts within
    a run on a shared machine, and a window from another part of the run would charge that
    drift to the agent.
A slow optimizer step on a shape with a second synchronisation point every step (FIXED_APART)
is the exception: no share change can shorten that step, and the case asserts even shares and a
job no slower than without the agent (beyond 5% and three standard errors).
A class per shape (one ctest entry each) runs all its conditions in one launch: one process
group, a fresh model, Session and deploy per run. Figures go to stderr and, as JSON lines, to
$PARAPILOT_JOB_RESULTS when set (scripts/run-results.py pytorch renders the table).

Guardrail: a deliberately wrong switch on a real job. Rank 2 is slowed 2.5x until the agent's
first plan applies, and from that step on rank 3 is, 3.5x, instead: the switch that moved work off rank
2 now gives the slow rank more work, and the steps after it are slower than before. deploy must
revert it.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import unittest

import harness
from test_deploy import HAVE_TORCH, parapilot_binary
from test_pytorch_job import Deploy

SCRIPT = os.path.join(harness.HERE, "job_shapes.py")
RANKS = 4
GLOBAL_BATCH = 128
EVEN = GLOBAL_BATCH // RANKS
STEPS = 120           # a run with the agent
BASELINE_STEPS = 50   # a run without it
SKIP_STEPS = 10       # start-up steps left out of a run's median
SLOW_RANK = 2         # job_shapes.SLOW_RANK
SLOWED = ["forward", "backward", "data", "optimizer"]
GAIN = 0.10
# Shapes with a second synchronisation point every step besides the gradient reduction: DDP's
# buffer broadcast at the forward's start, the logging all-reduce after the optimizer. There the
# optimizer step runs between two synchronisations of its own, so the others wait for a slow
# optimizer step whatever their shares: no share change shortens the step, and the case asserts
# that the shares stay even and the job is no slower (the healthy case's check).
FIXED_APART = {"buffers", "loss-log"}


def median_and_se(steps):
    """Median of a run's steps and its robust standard error (1.4826 MAD / sqrt(n))."""
    m = statistics.median(steps)
    mad = statistics.median(abs(x - m) for x in steps)
    return m, 1.4826 * mad / max(1, len(steps)) ** 0.5


class _Matrix(unittest.TestCase):
    shape = ""

    def setUp(self):
        if not HAVE_TORCH:
            self.skipTest("needs torch (Debian python3-torch for /usr/bin/python3)")
        self.exe = parapilot_binary()
        if self.exe is None:
            self.skipTest("parapilot (with the deploy command) is not built")
        self.secret = harness.SecretFile()
        self.addCleanup(self.secret.close)
        self.tmp = tempfile.mkdtemp(prefix="parapilot-matrix-")

    def launch(self, runs, extra=()):
        """Runs job_shapes.py with `runs` ([(condition, mode, steps or None for the mode's
        default)]); returns (runs' results, the deploys of the agent runs in order, the job's
        stderr)."""
        deploys = []
        try:
            for condition, mode, _ in runs:
                if mode == "agent":
                    deploys.append(Deploy(self.exe, harness.free_port(), self.secret.path))
            out = os.path.join(self.tmp, f"{self.shape}.json")
            env = dict(os.environ, PYTHONPATH=os.path.join(harness.ROOT, "python"),
                       OMP_NUM_THREADS="1", PARAPILOT_SECRET_FILE=self.secret.path,
                       PARAPILOT_AGENT="")
            agents = ",".join(d.address for d in deploys)
            cmd = [sys.executable, "-m", "parapilot.launch", "--nproc", str(RANKS), "--timeout",
                   "1500", SCRIPT, "--shape", self.shape,
                   "--runs", ",".join(f"{c}:{m}" + (f":{n}" if n else "") for c, m, n in runs),
                   "--agents", agents,
                   "--steps", str(STEPS), "--baseline-steps", str(BASELINE_STEPS),
                   "--global-batch", str(GLOBAL_BATCH), "--out", out, *extra]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1600)
        finally:
            for d in deploys:
                d.stop()
        self.assertEqual(r.returncode, 0, r.stderr[-4000:])
        with open(out) as f:
            results = json.load(f)["runs"]
        return results, deploys, r.stderr

    def check_deploy(self, d):
        learned = d.events("job_learned")
        self.assertEqual(len(learned), 1, "deploy should learn the job once from its ranks")
        self.assertEqual(learned[0]["ranks"], RANKS)
        summary = d.events("agent_stopped")[-1]
        self.assertEqual(summary["aborted"], 0)
        self.assertEqual(summary["telemetry_rejected"], {}, "valid telemetry was rejected")
        return summary

    def report(self, figures):
        print(json.dumps(figures), file=sys.stderr)
        path = os.environ.get("PARAPILOT_JOB_RESULTS")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(figures) + "\n")

    def run_matrix(self):
        runs = [("healthy", "none", STEPS), ("healthy", "agent", None),
                ("healthy", "none", STEPS)]
        for c in SLOWED + ["mixed"]:
            runs += [(c, "none", None), (c, "agent", None)]
        results, deploys, log = self.launch(runs)
        agent_runs = iter(deploys)
        failures = []
        for i, (condition, mode, _) in enumerate(runs):
            if mode != "agent":
                continue
            d = next(agent_runs)
            res = results[i]
            without = [results[i - 1]] + ([results[i + 1]] if condition == "healthy" else [])
            try:
                self.check_case(condition, res, without, d)
            except AssertionError as e:
                failures.append(f"{self.shape} / {condition}: {e}")
        if failures:
            tail = "\n".join(line for line in log.splitlines() if "parapilot" in line)[-3000:]
            self.fail("\n".join(failures) + "\n--- job log (tail) ---\n" + tail)

    def check_case(self, condition, res, without, d):
        """Reports the case's figures with what failed in it, then fails if anything did."""
        summary = self.check_deploy(d)
        counts = res["final_counts"]
        with_ms = statistics.median(res["step_ms"][len(res["step_ms"]) // 2:])
        if condition == "healthy":  # runs as long as this one: the same steps (second half)
            base = [median_and_se(w["step_ms"][len(w["step_ms"]) // 2:]) for w in without]
        else:
            base = [median_and_se(w["step_ms"][SKIP_STEPS:]) for w in without]
        figures = {"shape": self.shape, "condition": condition, "final_counts": counts,
                   "with_ms": round(with_ms, 2),
                   "without_ms": [round(m, 2) for m, _ in base],
                   "ratio": round(with_ms / max(m for m, _ in base), 3),
                   "committed": summary["committed"], "reverted": summary["reverted"],
                   "slow_rank_events": summary["stragglers_detected"],
                   "gaps_excluded": res["gaps_excluded"]}
        problems = []

        def expect(ok, text):
            if not ok:
                problems.append(text)
        expect(sum(counts) == GLOBAL_BATCH, f"shares {counts} do not sum to {GLOBAL_BATCH}")
        if condition == "healthy":
            healthy = range(RANKS)
            slowed = []
        elif condition == "mixed":
            healthy, slowed = [0, 1], [2, 3]
        else:
            healthy = [r for r in range(RANKS) if r != SLOW_RANK]
            slowed = [SLOW_RANK]
        for r in healthy:
            expect(counts[r] >= EVEN, f"healthy rank {r} ended below an even share: {counts}")
        if condition == "optimizer" and self.shape in FIXED_APART:
            expect(counts == [EVEN] * RANKS, f"shares moved for a slow optimizer step that "
                   f"shares cannot shorten here: {counts}")
            slowed = []
        if slowed:
            expect(max(counts[r] for r in slowed) < min(counts[r] for r in healthy),
                   f"slowed ranks {slowed} do not have the smallest shares: {counts}")
            expect(max(counts[r] for r in slowed) < EVEN,
                   f"slowed ranks {slowed} not below an even share: {counts}")
            without_ms = base[0][0]
            expect(with_ms <= (1 - GAIN) * without_ms,
                   f"second half {with_ms:.1f} ms with the agent vs {without_ms:.1f} ms "
                   f"without: not {GAIN:.0%} faster")
        elif len(base) == 1:
            a, se_a = base[0]
            expect(with_ms <= a + 3 * se_a * 2 ** 0.5 + 0.05 * a,
                   f"slower with the agent: {with_ms:.1f} ms vs {a:.1f} ms without")
        else:
            (a, se_a), (b, se_b) = base
            # Run-to-run drift on a shared machine: the two runs' difference, the difference of
            # each run's halves, or three standard errors, whichever is largest.
            halves = []
            for w in without:
                steps = w["step_ms"]
                half = len(steps) // 2
                halves.append(abs(statistics.median(steps[SKIP_STEPS:half]) -
                                  statistics.median(steps[half:])))
            spread = max(abs(a - b), *halves, 3 * (se_a ** 2 + se_b ** 2) ** 0.5)
            expect(with_ms <= max(a, b) + spread,
                   f"healthy run slower with the agent: {with_ms:.1f} ms vs {a:.1f} and "
                   f"{b:.1f} ms without (spread {spread:.1f})")
        figures["failed"] = problems
        self.report(figures)
        if problems:
            raise AssertionError("; ".join(problems) + f" ({json.dumps(figures)})")


def _shape_class(shape):
    name = "".join(part.capitalize() for part in shape.split("-"))
    return type(name, (_Matrix,), {"shape": shape, "test_matrix": _Matrix.run_matrix})


for _shape in ["buffers", "loss-log", "barrier", "accumulate", "eval", "clip", "groups"]:
    _cls = _shape_class(_shape)
    globals()[_cls.__name__] = _cls
del _shape, _cls


class Guardrail(_Matrix):
    """A deliberately wrong switch on a real job is reverted (see the module docstring)."""

    shape = "buffers"

    def test_wrong_switch_is_reverted(self):
        results, deploys, log = self.launch([("moving", "agent", None)])
        d = deploys[0]
        summary = self.check_deploy(d)
        decisions = [e for e in d.events("decision") if e.get("action") in ("rebalance", "revert")]
        kinds = [e["action"] for e in decisions]
        judged = [e["reason"] for e in d.events("decision")
                  if e["reason"].startswith(("the last switch held", "the last switch made"))]
        self.report({"shape": "guardrail", "condition": "moving", "decisions": kinds,
                     "judged": judged,
                     "committed": summary["committed"], "reverted": summary["reverted"],
                     "final_counts": results[0]["final_counts"]})
        self.assertIn("rebalance", kinds, "no switch was made")
        self.assertIn("revert", kinds[kinds.index("rebalance") + 1:],
                      "the wrong switch was not reverted: " + json.dumps(decisions)[-2000:])
        self.assertGreaterEqual(summary["reverted"], 1)


if __name__ == "__main__":
    unittest.main()
