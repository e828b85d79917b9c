"""Pipeline-parallel jobs (parapilot.pipeline) on 4 Gloo ranks on the CPU, driven by the scripted
agent: a plan that moves blocks between stages, streamed ahead of its boundary and committed
for step k, ends bit-identical (torch.equal on every parameter, buffer and optimizer state) to
running to step k, saving, relaunching on the new split, loading and running on, under both
schedules; so does a plan left to move at its boundary; plans this job
cannot run are refused with their reason; the JobInfo and per-step telemetry say what the
pipeline contract says; a gpipe job beside `parapilot deploy` (whose plans name no schedule)
applies the plan that moves blocks off its slowed stage.

torch.distributed.pipelining needs torch >= 2.4: under torch 1.13 every test is skipped (77)."""

import os
import shutil
import tempfile
import time
import unittest

import harness
from parapilot import pipeline_plan, telemetry_keys as keys

try:
    import torch
    from torch.distributed import pipelining  # noqa: F401
    HAVE_PIPELINING = True
except ImportError:
    HAVE_PIPELINING = False

SKIP = "needs torch >= 2.4 (torch.distributed.pipelining)"
WORLD = 4
START, NEW = [2, 2, 2, 2], [1, 3, 3, 1]
STEPS, HOLD, GATE = 14, 4, 8
SWITCH_AT = GATE + 2  # committed for the step after the one the gate releases (boundary.py)
STREAM_FROM = HOLD + 2  # staged before HOLD: reported at its end, agreed a boundary later
# abort_first: plan 8 streams from STREAM_FROM and is aborted while the job holds before HOLD2;
# plan 9 is agreed at the boundaries after it, streams from HOLD2 + 2, and is committed for
# SWITCH_AT2 while the job waits at its gate before GATE2.
HOLD2, GATE2, ABORTED = 7, 10, [1, 3, 2, 2]
SWITCH_AT2 = GATE2 + 2


def prepare_line(plan_id, split, schedule=None, size=4, pp=WORLD, micro_batches=4):
    """A plan as deploy sends it (no schedule, unless one is given): the Layout's micro-batches
    (the job runs 4 of 4 samples) and the name's samples per micro-batch."""
    name = pipeline_plan.layout_name(split, size, schedule)
    return f"prepare {plan_id} 1 - - 30000 {name} 1 {pp} {micro_batches}"


def load_states(prefix):
    from parapilot import pipeline_state
    return pipeline_state.load_blocks([f"{prefix}.{r}" for r in range(WORLD)])


def assert_same(test, a, b, where=""):
    """a and b (nested dicts / lists of tensors) are equal bit for bit."""
    if isinstance(a, torch.Tensor):
        test.assertTrue(isinstance(b, torch.Tensor) and a.dtype == b.dtype and
                        torch.equal(a, b), f"{where} differs")
    elif isinstance(a, dict):
        test.assertEqual(sorted(a), sorted(b), where)
        for k in a:
            assert_same(test, a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        test.assertEqual(len(a), len(b), where)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(test, x, y, f"{where}[{i}]")
    else:
        test.assertEqual(a, b, where)


class SplitAndPlanTest(unittest.TestCase):
    """The split arithmetic and the plan rule (no torch)."""

    def test_splits_and_moves(self):
        from parapilot import pipeline_split as ps
        self.assertEqual(ps.even_split(10, 4), [3, 3, 2, 2])
        self.assertEqual(list(ps.blocks_of([1, 3, 3, 1], 2)), [4, 5, 6])
        self.assertEqual(ps.first_blocks([1, 3, 3, 1]), [0, 1, 4, 7])
        self.assertEqual([(m.block, m.src, m.dst) for m in ps.moves(START, NEW)],
                         [(1, 0, 1), (6, 3, 2)])
        self.assertEqual(ps.pairs(ps.moves([3, 3, 2, 2], [2, 2, 3, 3])),
                         {(0, 1): [2], (1, 2): [4, 5], (2, 3): [7]})
        for bad in ([2, 2, 2], [0, 4, 2, 2], [2, 2, 2, 3]):
            with self.assertRaises(ps.SplitError):
                ps.check_split(bad, 8, 4)
        with self.assertRaises(ps.SplitError):
            ps.even_split(3, 4)

    def test_plan_rule(self):
        from parapilot import wire
        from parapilot.pipeline_plan import PlanRefused, plan_split

        def split_of(name, **layout):
            lay = dict(dp=1, tp=1, pp=WORLD, micro_batches=4)
            lay.update(layout)
            return plan_split(wire.PlanPrepare(1, wire.Layout(**lay), name), n_blocks=8,
                              n_stages=WORLD, micro_batches=4, global_batch=16,
                              schedule="1f1b")
        name = pipeline_plan.layout_name(NEW, 4, "1f1b")
        self.assertEqual(name, "dp1-tp1-pp4-mb4-z0;sc=1f1b;st=1,3,3,1")
        self.assertEqual(split_of(name), NEW)
        # Deploy's form (agent/deploy: plan_prepare_keeping_schedule) names no schedule: the
        # job's.
        self.assertEqual(pipeline_plan.layout_name(NEW, 4), "dp1-tp1-pp4-mb4-z0;st=1,3,3,1")
        self.assertEqual(split_of("dp1-tp1-pp4-mb4-z0;st=1,3,3,1"), NEW)
        for name, layout, reason in (
                ("dp1-tp1-pp4-mb4-z0;sc=gpipe;st=1,3,3,1", {}, "does not switch schedules"),
                ("dp1-tp1-pp4-mb4-z0;sc=1f1b", {}, "no stage_layers"),
                ("dp1-tp1-pp4-mb2-z0;sc=1f1b;st=1,3,3,1", {}, "mb2, this job"),
                ("dp1-tp1-pp4-mb4-z0;st=1,3,3,1", {"micro_batches": 8}, "micro_batches=8"),
                ("dp1-tp1-pp4-mb4-z0;st=1,3,3,1", {"dp": 2}, "dp=2"),
                ("s=1/2", {}, "a pipeline plan is a layout name"),
                ("dp1-tp1-pp4-mb4-z0;st=1,3,3", {}, "has 3 stages")):
            with self.assertRaises(PlanRefused) as e:
                split_of(name, **layout)
            self.assertIn(reason, str(e.exception), name)


@unittest.skipUnless(HAVE_PIPELINING, SKIP)
class SwitchTest(unittest.TestCase):
    def setUp(self):
        harness.require_agent(self)
        self.secret_file = harness.SecretFile()
        self.agent = harness.ScriptedAgent(self.secret_file.path)
        self.env = {"PARAPILOT_AGENT": self.agent.address,
                    "PARAPILOT_SECRET_FILE": self.secret_file.path}
        self.dir = tempfile.mkdtemp(prefix="parapilot-pp-")
        self.job = None

    def tearDown(self):
        if self.job is not None:
            self.job.kill()
        self.agent.stop()
        self.secret_file.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def ran(self, step, timeout):
        """Every rank sent step's telemetry (a rank sends it after the step's boundary, so a plan
        staged from now on is first reported at the next one)."""
        for _ in range(WORLD):
            self.agent.wait_for(lambda e: e["event"] == "telemetry" and e["step"] == step,
                                timeout=timeout)

    def ready(self, plan_id):
        return [self.agent.wait_for(lambda e: e["event"] == "plan_ready" and
                                    e["plan_id"] == plan_id, timeout=30) for _ in range(WORLD)]

    def live(self, schedule, optimizer, stream, abort_first=False):
        """The job switched by the agent at SWITCH_AT; first the plans it must refuse. The job
        holds before step HOLD while the plans are sent; the plan to apply is streamed from
        STREAM_FROM (stream true: ready once streamed) and committed while the job waits at its
        gate before step GATE. abort_first: a plan to another split is streamed first and
        aborted while the job holds before step HOLD2; then plan 9 is prepared and streams."""
        hold, gate = os.path.join(self.dir, "hold"), os.path.join(self.dir, "gate")
        hold2 = os.path.join(self.dir, "hold2")
        holds = [[HOLD, hold]] + ([[HOLD2, hold2]] if abort_first else [])
        self.job = harness.launch(WORLD, {
            "steps": STEPS, "schedule": schedule, "optimizer": optimizer, "split": START,
            "stream": stream, "holds": holds, "gate_step": GATE2 if abort_first else GATE,
            "gate_file": gate,
            "final_prefix": os.path.join(self.dir, "live")},
            env_extra=self.env, timeout=150, worker="pipeline_worker.py")
        self.ran(HOLD - 1, timeout=90)
        other = "gpipe" if schedule == "1f1b" else "1f1b"
        refusals = {
            1: (prepare_line(1, [0, 4, 2, 2], schedule), "leaves a stage without blocks"),
            2: (prepare_line(2, [2, 2, 2, 3], schedule), "covers 9 blocks, the model has 8"),
            3: (prepare_line(3, NEW, other), f"this job runs '{schedule}'"),
            4: (prepare_line(4, [4, 4], schedule, pp=2), "pp=2"),
            5: (prepare_line(5, NEW, schedule, micro_batches=8), "micro_batches=8"),
            6: (prepare_line(6, NEW, schedule, size=2), "mb2, this job dp1-tp1-pp4-mb4"),
        }
        for plan_id, (line, reason) in refusals.items():
            self.agent.command(line)
            for r in self.ready(plan_id):
                self.assertFalse(r["ok"], r)
                self.assertIn(reason, r["detail"], r)
        if abort_first:
            self.agent.command(prepare_line(8, ABORTED, schedule))
            open(hold, "w").close()
            for r in self.ready(8):
                self.assertTrue(r["ok"], r)
            self.ran(HOLD2 - 1, timeout=60)
            self.agent.command("abort 8 test")
            hold = hold2
        self.agent.command(prepare_line(9, NEW))  # deploy's form: the job keeps its schedule
        if stream:
            # Not ready while the job holds: the ranks agree to stream it at a boundary.
            time.sleep(1.0)
            self.assertEqual([e for e in self.agent.events_of("plan_ready")
                              if e["plan_id"] == 9], [])
        open(hold, "w").close()
        for r in self.ready(9):
            self.assertTrue(r["ok"], r)
        self.agent.command(f"commit 9 {SWITCH_AT2 if abort_first else SWITCH_AT}")
        open(gate, "w").close()
        for _ in range(WORLD):
            self.agent.wait_for(lambda e: e["event"] == "ack" and e["id"] == 9, timeout=60)
        results = self.job.wait()
        self.job = None
        return results

    def restart(self, schedule, optimizer, switch_at):
        """The same job stopped at switch_at, saved, relaunched on the new split, loaded."""
        ck = os.path.join(self.dir, "ck")
        base = {"steps": STEPS, "schedule": schedule, "optimizer": optimizer}
        harness.launch(WORLD, dict(base, split=START, save_at=switch_at, save_prefix=ck),
                       timeout=120, worker="pipeline_worker.py").wait()
        harness.launch(WORLD, dict(base, split=NEW, resume_prefix=ck,
                                   final_prefix=os.path.join(self.dir, "restart")),
                       timeout=120, worker="pipeline_worker.py").wait()

    def check_switch(self, schedule, optimizer, stream=True, abort_first=False):
        live = self.live(schedule, optimizer, stream, abort_first)
        switch_at = SWITCH_AT2 if abort_first else SWITCH_AT
        for r in live:
            self.assertEqual(r["applied_plans"], [9])
            self.assertEqual(r["split"], NEW)
            plans = {x["step"]: x["plan"] for x in r["records"]}
            self.assertEqual([s for s in range(STEPS) if plans[s] == 9],
                             list(range(switch_at, STEPS)), plans)
            (w,) = r["switches"]
            self.assertEqual((w["step"], w["plan_id"]), (switch_at, 9), w)
            if abort_first:
                self.assertIn(f"rank {r['rank']}: plan 8: stream ended at step {HOLD2 + 2} "
                              "(dropped by the agent); its copies are freed", r["log"])
            if stream:
                # Everything was streamed ahead: nothing is sent at the boundary.
                self.assertEqual(w["streamed_from"], HOLD2 + 2 if abort_first else STREAM_FROM,
                                 w)
                self.assertEqual(w["bytes_at_boundary"], 0, w)
            else:
                self.assertIsNone(w["streamed_from"], w)
                self.assertEqual(w["bytes_streamed"], 0, w)
        # The ranks that give blocks away sent them (stages 0 and 3 give one each).
        sent = [w["bytes_streamed"] + w["bytes_at_boundary"]
                for r in sorted(live, key=lambda r: r["rank"]) for w in r["switches"]]
        self.assertTrue(sent[0] > 0 and sent[3] > 0 and sent[1] == sent[2] == 0, sent)
        self.restart(schedule, optimizer, switch_at)
        a, b = load_states(os.path.join(self.dir, "live")), \
            load_states(os.path.join(self.dir, "restart"))
        self.assertEqual(a["step"], STEPS)
        self.assertEqual(sorted(a["blocks"]), list(range(8)))
        slots = 2 if optimizer == "adam" else 1
        for block, state in a["blocks"].items():
            self.assertTrue(all(len(d) >= slots for d in state["optim"]), (block, state["optim"]))
        assert_same(self, a, b, "blocks")

    def test_gpipe_adam_switch_is_exact(self):
        self.check_switch("gpipe", "adam")

    def test_1f1b_sgd_momentum_switch_is_exact(self):
        self.check_switch("1f1b", "sgd")

    def test_switch_moved_at_the_boundary_is_exact(self):
        self.check_switch("1f1b", "adam", stream=False)

    def test_aborted_stream_then_another_is_exact(self):
        # Plan 8 streams block 1 to stage 1 and is aborted: the copy is dropped. Plan 9 moves
        # block 1 there too (and block 6 to stage 2): its copy is made again from the holder's
        # block as it is then, and the switch is still exact.
        self.check_switch("gpipe", "adam", abort_first=True)


@unittest.skipUnless(HAVE_PIPELINING, SKIP)
class TelemetryTest(unittest.TestCase):
    def setUp(self):
        harness.require_agent(self)
        self.secret_file = harness.SecretFile()
        self.agent = harness.ScriptedAgent(self.secret_file.path)
        self.env = {"PARAPILOT_AGENT": self.agent.address,
                    "PARAPILOT_SECRET_FILE": self.secret_file.path}

    def tearDown(self):
        self.agent.stop()
        self.secret_file.close()

    def test_job_info_and_stage_telemetry(self):
        # Stage 2 is three times slower in its forward: its compute stands out, and its
        # neighbours' time shows up as waits in the pipeline's sends and receives, not compute.
        res = harness.launch(WORLD, {"steps": 10, "split": [1, 2, 3, 2], "slow_stage": 2,
                                     "slow_factor": 4.0, "width": 64},
                             env_extra=self.env, timeout=120, worker="pipeline_worker.py").wait()
        from parapilot import wire
        block = 64 * 64 + 64 + 2 * 64  # Linear and LayerNorm of one block, float32
        for r in res:
            info = r["job_info"]
            self.assertEqual(info["world_size"], WORLD)
            self.assertEqual(info["global_batch"], 16)
            self.assertEqual(info["capabilities"], wire.Capability.PIPELINE)
            self.assertTrue(info["framework"].startswith("pytorch-pipeline 2."), info)
            self.assertEqual(info["layers"], [[block, 4 * block]] * 8)
        tel = [e for e in self.agent.events_of("telemetry")]
        self.assertEqual(len(tel), 10 * WORLD)
        firsts = [0, 1, 3, 6]
        for e in tel:
            s = e["rank"]
            c = e["counts"]
            self.assertEqual(c[keys.STAGE], s)
            self.assertEqual(c[keys.FIRST_BLOCK], firsts[s])
            self.assertEqual(c[keys.BLOCKS], [1, 2, 3, 2][s])
            self.assertEqual(c[keys.MICROBATCHES], 4)
            self.assertEqual(c[keys.PLAN], 0)
            self.assertIn(keys.P2P_PP, e["collectives"])
            self.assertNotIn(keys.WAIT_DP, e["collectives"])
            blocks = sorted(int(k.rsplit("/", 1)[1]) for k in e["measures"]
                            if k.startswith(keys.BLOCK_MS_PREFIX))
            self.assertEqual(blocks, list(range(firsts[s], firsts[s] + [1, 2, 3, 2][s])))
            # Compute and the waits in sends and receives are disjoint parts of the step.
            cycle = (e["end_ns"] - e["start_ns"]) / 1e6
            self.assertLessEqual(e["compute_ms"] + e["collectives"][keys.P2P_PP][0],
                                 cycle + 1e-3, e)
            calls = e["collectives"][keys.P2P_PP][2]
            self.assertEqual(calls, (1 if s in (0, 3) else 2) * 2 * 4)
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        compute = [med([e["compute_ms"] for e in tel if e["rank"] == s and e["step"] >= 2])
                   for s in range(WORLD)]
        p2p = [med([e["collectives"][keys.P2P_PP][0] for e in tel
                    if e["rank"] == s and e["step"] >= 2]) for s in range(WORLD)]
        for s in (0, 1, 3):
            self.assertLess(compute[s], compute[2], f"compute per stage {compute}")
            self.assertGreater(p2p[s], p2p[2], f"p2p waits per stage {p2p}")


@unittest.skipUnless(HAVE_PIPELINING, SKIP)
class DeployTest(unittest.TestCase):
    """`parapilot deploy` with no schedule said (its plans name none) beside a gpipe job, the
    schedule other than the 1f1b of the job deploy's docs show: the job accepts the plan that
    moves blocks off its slowed stage and applies it on every rank."""

    def setUp(self):
        from test_deploy import parapilot_binary
        self.exe = parapilot_binary()
        if self.exe is None:
            self.skipTest("parapilot (with the deploy command) is not built")
        self.secret = harness.SecretFile()
        self.addCleanup(self.secret.close)

    def test_gpipe_job_beside_default_deploy_applies_a_plan(self):
        from test_pytorch_job import Deploy
        deploy = Deploy(self.exe, harness.free_port(), self.secret.path)
        try:
            # Stage 2 four times slower in its forward; each block's forward also waits 2 ms per
            # micro-batch (device time), so that the pipeline, not the shared cores, sets the step.
            res = harness.launch(WORLD, {"steps": 80, "schedule": "gpipe", "split": START,
                                         "slow_stage": 2, "slow_factor": 4.0, "device_ms": 2.0},
                                 env_extra={"PARAPILOT_AGENT": deploy.address,
                                            "PARAPILOT_SECRET_FILE": self.secret.path},
                                 timeout=240, worker="pipeline_worker.py").wait()
        finally:
            deploy.stop()
        migrations = deploy.events("migration")
        self.assertTrue(migrations, "deploy started no switch: " + str(deploy.events("decision")))
        aborted = [m for m in migrations if m["outcome"] != "committed"]
        self.assertEqual(aborted, [], "a plan the gpipe job refused or that did not commit")
        first = res[0]["applied_plans"]
        self.assertTrue(first, res[0])
        for r in res:
            self.assertEqual(r["applied_plans"], first, r)
            self.assertEqual(r["split"], res[0]["split"], r)
        self.assertLess(res[0]["split"][2], START[2], res[0]["split"])


if __name__ == "__main__":
    unittest.main()
