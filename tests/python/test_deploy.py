"""End to end: an 8-rank CPU/Gloo DDP job (ddp_worker.py, rank 3 slowed down) connected to a real
`parapilot deploy`, with its default (the shipped learned policy) and with the reactive baseline
beside it. Telemetry reaches the agent, it detects the slow rank and
commits elastic shares; every rank switches at the committed step, the slow rank gets fewer
samples, the share-weighted update still equals the full-batch update, and after the agent is
stopped the job trains to the end on its last plan. deploy's scenarios need >= 8 GPUs, hence 8
ranks. Skipped when build/parapilot is not built.

On a loaded machine (8 ranks and the agent on 2 shared cores) nothing here depends on how many
seconds pass, only on steps, except the two liveness timeouts that cannot be counted in steps
(the agent does not step):
* The switch step: deploy commits --commit-margin-steps 20 steps past the newest step it has
  seen (its wall-time lead, --commit-lead-ms, only ever adds steps). However slowly the machine
  runs, the ranks run those 20 steps while the commit travels; the Python client needs it two
  boundaries ahead.
* Waiting for the agent's events: bounded by the job itself (its steps), and by the job's
  deadline only as a guard against a hang.
* The bus client's heartbeat timeout is the client's default, 5 s, not the 1 s the other
  Python tests use to see a lost agent quickly: an agent descheduled for a second is not lost,
  and a client that declared it so would drop its staged plan and the plan would not commit.
"""

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest

import harness

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def parapilot_binary():
    path = os.environ.get("PARAPILOT_BINARY")
    cands = [path] if path else []
    cands += [os.path.join(harness.ROOT, b, "parapilot") for b in ("build-py", "build")]
    for c in cands:
        if c and os.path.exists(c):
            try:
                r = subprocess.run([c, "deploy", "--help"], capture_output=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if r.returncode == 0:
                return c
    return None


@unittest.skipUnless(HAVE_TORCH, "needs torch (Debian python3-torch for /usr/bin/python3)")
class DeployEndToEndTest(unittest.TestCase):
    POLICY = None  # deploy's default: the shipped learned policy

    def setUp(self):
        self.exe = parapilot_binary()
        if self.exe is None:
            self.skipTest("parapilot (with the deploy command) is not built")
        self.secret = harness.SecretFile()
        self.port = harness.free_port()
        # The job is pure data parallel: let the agent plan only such layouts, so that every
        # plan it sends is one this job accepts (tp and pp stay 1; shares may change).
        scenario = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        scenario.write('[scenario]\nfamily = "straggler"\ngpus = 8\n\n[space]\ntp = [1]\npp = [1]\n'
                       'microbatch_size = [1]\nzero = [1]\nrecompute = ["selective"]\n')
        scenario.close()
        self.scenario_path = scenario.name
        self.addCleanup(os.unlink, self.scenario_path)
        policy = ["--policy", self.POLICY] if self.POLICY else []
        self.deploy = subprocess.Popen(
            [self.exe, "deploy", "--scenario", self.scenario_path] + policy + [
             "--initial-layout", "uniform-dp", "--interval-steps", "5", "--cooldown", "1",
             "--commit-margin-steps", "20",
             "--listen", f"127.0.0.1:{self.port}", "--secret-file", self.secret.path],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        started = self.wait_line(lambda e: e.get("event") == "agent_started", 20)
        # The policy asked for is the one that runs: no silent fallback to a baseline.
        self.assertEqual(started["policy"], self.POLICY or "rl")
        self.assertFalse(started["fallback"])
        self.job = None

    def _read(self):
        for line in self.deploy.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                self.lines.append(ev)
                self.cond.notify_all()

    def wait_line(self, pred, timeout):
        """The first event matching pred; fails once the job (its steps) or deploy has ended
        without one, or, as a guard against a hang, after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.lines:
                    if pred(e):
                        return e
                left = deadline - time.monotonic()
                job = getattr(self, "job", None)
                job_over = job is not None and not job.running()
                if left <= 0 or job_over or self.deploy.poll() is not None:
                    decisions = [(e.get("step"), e.get("action"), e.get("reason"))
                                 for e in self.lines if e.get("event") == "decision"]
                    raise AssertionError(f"deploy: no such event; last: {self.lines[-3:]}; "
                                         f"last decisions: {decisions[-4:]}")
                self.cond.wait(min(left, 0.5))

    def tearDown(self):
        if self.job is not None:
            self.job.kill()
        if self.deploy.poll() is None:
            self.deploy.send_signal(signal.SIGINT)
            try:
                self.deploy.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.deploy.kill()
                self.deploy.wait(timeout=5)
        self.reader.join(timeout=5)
        self.deploy.stdout.close()
        self.deploy.stderr.close()
        self.secret.close()

    def test_slow_rank_shares_from_deploy(self):
        env = {"PARAPILOT_AGENT": f"127.0.0.1:{self.port}",
               "PARAPILOT_SECRET_FILE": self.secret.path}
        # Enough steps that the agent detects, plans and commits well before the job ends, even
        # on a loaded machine.
        steps = 240
        self.job = harness.launch(8, {"steps": steps, "global_batch": 64, "slow_rank": 3,
                                      "slow_ms": 30, "reference": True,
                                      "heartbeat_timeout_ms": 5000},
                                  env_extra=env, timeout=200)
        slow = self.wait_line(lambda e: e.get("event") == "slow_rank" and e.get("rank") == 3, 190)
        self.assertLess(slow["value"], 0.9)
        commit = self.wait_line(lambda e: e.get("event") == "migration"
                                and e.get("outcome") == "committed"
                                and "elastic" in e.get("layout", ""), 190)
        self.deploy.send_signal(signal.SIGINT)  # the agent goes away; the job must carry on
        self.deploy.wait(timeout=20)
        res = self.job.wait()
        self.job = None
        plan, at = commit["plan_id"], commit["switch_at_step"]
        for r in res:
            self.assertIn(plan, r["applied"])
            self.assertEqual(len(r["records"]), steps)  # trained to the end without the agent
            first = [x["step"] for x in r["records"] if x["plan"] == plan]
            self.assertEqual(first[0], at)  # every rank switched at the committed step
            self.assertEqual(r["records"][-1]["plan"], r["applied"][-1])
        for step in range(steps):
            self.assertEqual(sum(r["records"][step]["samples"] for r in res), 64)
        after = [x["samples"] for x in res[3]["records"] if x["plan"] == plan]
        self.assertLess(max(after), 8)  # the slow rank got less than an even share
        # Weighted update == full-batch update. On failure, say where it first diverged.
        big = [(x["step"], x["plan"], [r["records"][x["step"]]["samples"] for r in res], x["diff"])
               for x in res[0]["records"] if x.get("diff", 0) > 1e-5][:3]
        self.assertLess(res[0]["max_diff"], 1e-5,
                        f"first diverging steps (step, plan, samples per rank, diff): {big}; "
                        f"plans applied {res[0]['applied']}, committed {plan} at step {at}")


class DeployReactiveEndToEndTest(DeployEndToEndTest):
    """The same job with the reactive baseline, for comparison."""
    POLICY = "reactive"


if __name__ == "__main__":
    unittest.main()
