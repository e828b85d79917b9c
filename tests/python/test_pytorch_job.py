"""A PyTorch job brought as a new user brings it: tests/python/tutorial_ddp.py (the DDP tutorial's
shape with the documented lines added), 4 CPU Gloo ranks, beside `parapilot deploy` given only
--listen and --secret-file (no scenario, the shipped defaults).

Each case runs the same job without and with the agent:
  (a) healthy: at most 2 commits, at most 2 slow-rank events, and the shares the agent ends with
      cost no more than even shares beyond 10% (every rank equally fast, so a step is as long as
      the largest share);
  (b)-(c) one rank 3x slower inside its forward, or in its data loading (before the forward):
      the slow rank ends with the smallest share, and the shares the agent ends with, costed
      with the slowdown the test put in, make a step at least 10% shorter than even shares;
  (d) one rank slower in its optimizer step (a fixed extra per step, the same amount as (b) at
      an even share): the model has buffers, broadcast at every forward, so the optimizer step
      sits between two synchronisations and no share change shortens the step: the shares stay
      even;
  (e) deploy described by a scenario of another size: both sides say so, no plan is sent.
The job's compute per step is about the same under every torch build (tokens_per_sample): the
healthy case's bound on slow-rank events holds for a step whose compute is long against the
scheduling noise of 4 ranks on 2 cores, and Debian's torch 1.13 (a generic BLAS) computes the
tutorial's model about 20x slower than PyPI's torch 2.x (MKL).
The assertions are about what the agent did (its commits, the shares it chose, the plans it sent),
never about wall time, which on a shared machine depends on what else runs. The wall times of
both runs (second halves' median steps) are figures: they go to stderr, and to
$PARAPILOT_JOB_RESULTS as JSON lines when set (scripts/run-results.py pytorch).
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import harness
from test_deploy import HAVE_TORCH, parapilot_binary

SCRIPT = os.path.join(harness.HERE, "tutorial_ddp.py")
RANKS = 4
STEPS = 200
GLOBAL_BATCH = 256
SLOW_RANK = 1
SLOW_FACTOR = 3.0  # tutorial_ddp.py's default --slow-factor
EVEN = GLOBAL_BATCH // RANKS
GAIN = 0.10  # the least a rebalance must shorten the modelled step by (the test's bar)
# The forward + backward time of an even share the job is given (tokens_per_sample): about what
# Debian's torch 1.13 takes for one token per sample (about 19 ms on one core here), which this
# test's bounds were set with.
STEP_COMPUTE_MS = 20.0
MAX_TOKENS = 32


def tokens_per_sample():
    """Tokens per sample (tutorial_ddp.py --tokens) that give an even share's forward + backward
    about STEP_COMPUTE_MS on this torch build, one thread: 1 on Debian's torch 1.13, about 20 on
    PyPI's torch 2.x, whose kernels are that much faster. The fastest of several timings, so that
    a busy machine does not make the job shorter."""
    import torch
    from tutorial_ddp import Model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Model()
        x, y = torch.randn(EVEN, 1, 128), torch.randint(0, 16, (EVEN,))
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return max(1, min(MAX_TOKENS, round(STEP_COMPUTE_MS / min(times[2:]))))


def modelled_step(counts, slow_where=None):
    """A step for these shares in units of one healthy rank's time per sample: each healthy rank
    takes its samples, the slow rank its samples x SLOW_FACTOR (data, forward) or its samples plus
    (SLOW_FACTOR - 1) x an even share (optimizer: a fixed extra per step), as tutorial_ddp.py
    slows it. The step is the slowest rank's."""
    def cost(rank, n):
        if rank != SLOW_RANK or slow_where is None:
            return n
        if slow_where == "optimizer":
            return n + (SLOW_FACTOR - 1) * EVEN
        return SLOW_FACTOR * n
    return max(cost(r, n) for r, n in enumerate(counts))


class Deploy:
    """`parapilot deploy --listen ADDR --secret-file F`, its JSON lines collected. host: the
    address it listens on; wrap: an argv prefix (netns_hosts.Hosts.exec_argv: on a test host)."""

    def __init__(self, exe, port, secret_path, extra=(), host="127.0.0.1", wrap=()):
        self.address = f"{host}:{port}"
        self.proc = subprocess.Popen(
            [*wrap, exe, "deploy", "--listen", self.address, "--secret-file", secret_path,
             *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = []
        self.started = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        if not self.started.wait(20):
            self.stop()
            raise AssertionError("deploy did not start: " + self.proc.stderr.read())

    def _read(self):
        for line in self.proc.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            self.lines.append(e)
            if e.get("event") == "agent_started":
                self.started.set()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(timeout=5)
        self.proc.stdout.close()
        self.proc.stderr.close()

    def events(self, name):
        return [e for e in self.lines if e.get("event") == name]


@unittest.skipUnless(HAVE_TORCH, "needs torch (Debian python3-torch for /usr/bin/python3)")
class PyTorchJobTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tokens = tokens_per_sample()
        print(f"tokens per sample: {cls.tokens}", file=sys.stderr)

    def setUp(self):
        self.exe = parapilot_binary()
        if self.exe is None:
            self.skipTest("parapilot (with the deploy command) is not built")
        self.secret = harness.SecretFile()
        self.addCleanup(self.secret.close)
        self.tmp = tempfile.mkdtemp(prefix="parapilot-job-")

    def run_job(self, with_agent, slow_where=None, deploy_args=(), steps=STEPS):
        out = os.path.join(self.tmp, f"job-{with_agent}-{slow_where}.json")
        env = dict(os.environ, PYTHONPATH=os.path.join(harness.ROOT, "python"),
                   OMP_NUM_THREADS="1", PARAPILOT_SECRET_FILE=self.secret.path)
        deploy = None
        if with_agent:
            port = harness.free_port()
            deploy = Deploy(self.exe, port, self.secret.path, deploy_args)
            env["PARAPILOT_AGENT"] = f"127.0.0.1:{port}"
        else:
            env["PARAPILOT_AGENT"] = ""
        cmd = [sys.executable, "-m", "parapilot.launch", "--nproc", str(RANKS), "--timeout",
               "300", SCRIPT, "--steps", str(steps), "--global-batch", str(GLOBAL_BATCH),
               "--out", out, "--tokens", str(self.tokens)]
        if slow_where:
            cmd += ["--slow-rank", str(SLOW_RANK), "--slow-where", slow_where,
                    "--slow-factor", str(SLOW_FACTOR)]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360)
        finally:
            if deploy is not None:
                deploy.stop()
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        with open(out) as f:
            result = json.load(f)
        result["log"] = r.stderr
        result["deploy"] = deploy
        steps = result["step_ms"]
        result["second_half_ms"] = statistics.median(steps[len(steps) // 2:])
        return result

    def report(self, case, without, with_agent, slow_where=None):
        d = with_agent["deploy"]
        summary = d.events("agent_stopped")[-1]
        counts = with_agent["final_counts"]
        figures = {"case": case, "tokens": self.tokens,
                   "without_ms": round(without["second_half_ms"], 2),
                   "with_ms": round(with_agent["second_half_ms"], 2),
                   "ratio": round(with_agent["second_half_ms"] / without["second_half_ms"], 3),
                   "modelled_ratio": round(modelled_step(counts, slow_where) /
                                           modelled_step([EVEN] * RANKS, slow_where), 3),
                   "final_counts": counts,
                   "committed": summary["committed"], "reverted": summary["reverted"],
                   "aborted": summary["aborted"], "deploy_cpu_s": summary["cpu_s"],
                   "slow_rank_events": summary["stragglers_detected"],
                   "telemetry_rejected": summary["telemetry_rejected"]}
        print(json.dumps(figures), file=sys.stderr)
        path = os.environ.get("PARAPILOT_JOB_RESULTS")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(figures) + "\n")
        return summary

    def check_common(self, with_agent, summary):
        d = with_agent["deploy"]
        learned = d.events("job_learned")
        self.assertEqual(len(learned), 1, "deploy should learn the job once from its ranks")
        self.assertEqual(learned[0]["ranks"], RANKS)
        self.assertEqual(learned[0]["global_batch"], GLOBAL_BATCH)
        self.assertEqual(d.events("job_mismatch"), [])
        self.assertEqual(summary["aborted"], 0, "a plan was aborted: " + json.dumps(
            [e for e in d.events("migration") if e.get("outcome") != "committed"]))
        self.assertEqual(summary["telemetry_rejected"], {}, "valid telemetry was rejected")
        self.assertIn("connected to the agent", with_agent["log"])

    def slowed_case(self, where):
        without = self.run_job(False, where)
        with_agent = self.run_job(True, where)
        summary = self.report(where, without, with_agent, where)
        self.check_common(with_agent, summary)
        self.assertEqual(without["final_counts"], [EVEN] * RANKS)
        counts = with_agent["final_counts"]
        self.assertEqual(sum(counts), GLOBAL_BATCH, counts)
        self.assertLess(counts[SLOW_RANK], EVEN, counts)
        self.assertEqual(counts[SLOW_RANK], min(counts), counts)
        self.assertGreaterEqual(summary["committed"], 1)
        even = modelled_step([EVEN] * RANKS, where)
        self.assertLessEqual(modelled_step(counts, where), (1 - GAIN) * even,
                             f"shares {counts} with rank {SLOW_RANK} {SLOW_FACTOR}x slower in "
                             f"its {where}")

    def test_a_healthy(self):
        without = self.run_job(False)
        with_agent = self.run_job(True)
        summary = self.report("healthy", without, with_agent)
        self.check_common(with_agent, summary)
        self.assertLessEqual(summary["committed"], 2)
        self.assertLessEqual(summary["stragglers_detected"], 2, "noise flagged as slow ranks")
        # Every rank is equally fast: a step lasts as long as the largest share takes, and the
        # agent must not leave one much larger than an even share.
        counts = with_agent["final_counts"]
        self.assertEqual(sum(counts), GLOBAL_BATCH, counts)
        self.assertLessEqual(modelled_step(counts), (1 + GAIN) * EVEN,
                             f"shares {counts} on a healthy job")

    def test_e_world_size_mismatch_is_said_on_both_sides(self):
        # deploy described an 8-GPU job by a scenario; the job has 4 ranks.
        r = self.run_job(True, "forward", deploy_args=("--scenario", "straggler", "--gpus", "8"),
                         steps=60)
        d = r["deploy"]
        self.assertEqual(len(d.events("job_mismatch")), RANKS)
        self.assertIn("8 ranks", d.events("job_mismatch")[0]["reason"])
        self.assertEqual(d.events("migration"), [], "plans were sent to a job that cannot run them")
        self.assertIn("the agent will send no plans", r["log"])
        self.assertEqual(r["final_counts"], [EVEN] * RANKS)

    def test_b_slow_forward(self):
        self.slowed_case("forward")

    def test_c_slow_data_loading(self):
        self.slowed_case("data")

    def test_d_slow_optimizer(self):
        # The tutorial's model has buffers, which DDP broadcasts at every forward: the optimizer
        # step runs between that broadcast and the gradient reduction, and the others wait for
        # a slow one in the broadcast whatever their shares. No share change shortens the step,
        # and the agent must leave the shares even.
        without = self.run_job(False, "optimizer")
        with_agent = self.run_job(True, "optimizer")
        summary = self.report("optimizer", without, with_agent, "optimizer")
        self.check_common(with_agent, summary)
        self.assertEqual(with_agent["final_counts"], [EVEN] * RANKS)
        self.assertEqual(summary["committed"], 0)


if __name__ == "__main__":
    unittest.main()
