"""PyTorch DDP integration on CPU/Gloo: the share-weighted average equals the full-batch update,
plans from the (scripted) agent are staged, committed and applied at the same step on every
rank, compression cuts bytes as decided, and the agent going away leaves the job training."""

import math
import os
import unittest

import harness
from parapilot import telemetry_keys as keys

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False
try:
    from torch.distributed import _functional_collectives  # noqa: F401  (torch 2.x)
    HAVE_FUNCOL = True
except ImportError:
    HAVE_FUNCOL = False


@unittest.skipUnless(HAVE_TORCH, "needs torch (Debian python3-torch for /usr/bin/python3)")
class OfflineTest(unittest.TestCase):
    def test_split_batch(self):
        from parapilot.pytorch import split_batch
        self.assertEqual(split_batch(8, [3, 1]), [6, 2])
        self.assertEqual(split_batch(10, [1, 1, 1]), [4, 3, 3])
        self.assertEqual(split_batch(4, [1000, 1, 1, 1]), [1, 1, 1, 1])
        for shares in ([5, 1, 2], [1], [7, 7], [1, 2, 3, 4]):
            for b in range(len(shares), 40):
                c = split_batch(b, shares)
                self.assertEqual(sum(c), b)
                self.assertTrue(all(x >= 1 for x in c))

    def test_shares_from_deploy_layout_names(self):
        from parapilot import wire
        from parapilot.pytorch import plan_shares, shares_from_layout_name
        self.assertEqual(shares_from_layout_name("dp4-tp1-pp1-mb1-z1;sc=1f1b;rc=none;sh=3,1*2,5"),
                         [3, 1, 1, 5])
        self.assertEqual(shares_from_layout_name("dp2-tp1-pp1-mb1-z1;sc=1f1b"), [])
        p = wire.PlanPrepare(1, wire.Layout(dp=2, dp_shares=[2, 7]), "dp2-tp1-pp1-mb1-z1;sh=1,1")
        self.assertEqual(plan_shares(p), [2, 7])  # the structured field wins
        p.layout.dp_shares = []
        self.assertEqual(plan_shares(p), [1, 1])
        with self.assertRaises(ValueError):
            shares_from_layout_name("dp1-tp1-pp1-mb1-z1;sh=3*0")
        # Replica i placed on GPU g[i]: each rank keeps its device and takes that replica's share.
        p = wire.PlanPrepare(1, wire.Layout(dp=4), "dp4-tp1-pp1-mb1-z1;sh=4,3,2,1;g=1-3,0")
        self.assertEqual(plan_shares(p), [1, 4, 3, 2])

    def test_weighted_update_equals_full_batch_update(self):
        res = harness.launch(2, {"steps": 12, "global_batch": 16, "initial_shares": [3, 1],
                                 "reference": True}, timeout=60).wait()
        self.assertEqual([r["records"][0]["samples"] for r in res], [12, 4])
        self.assertLess(res[0]["max_diff"], 1e-5)
        self.assertEqual(res[0]["digest"], res[1]["digest"])

    def test_uneven_three_ranks(self):
        res = harness.launch(3, {"steps": 8, "global_batch": 15, "initial_shares": [1, 2, 7],
                                 "reference": True}, timeout=60).wait()
        self.assertEqual([r["records"][0]["samples"] for r in res], [2, 3, 10])
        self.assertLess(res[0]["max_diff"], 1e-5)

    def test_waits_in_every_collective_are_not_compute(self):
        # 4 ranks, rank 3 sleeps 40 ms before each forward (before DDP's buffer broadcast); the
        # model has buffers; the script all-reduces its loss after every step, synchronously and
        # asynchronously, and runs a barrier every 3 steps. Whoever waits for rank 3, in the
        # broadcast or anywhere else, must not be charged with it.
        res = harness.launch(4, {"steps": 24, "global_batch": 32, "buffers": True,
                                 "slow_rank": 3, "slow_ms": 40, "log_all_reduce": True,
                                 "async_all_reduce": True, "barrier_every": 3},
                             timeout=120).wait()
        med = lambda v: sorted(v)[len(v) // 2]
        compute = [med([x["compute_ms"] for x in r["records"][4:]]) for r in res]
        for rank in range(3):
            self.assertLess(compute[rank], 0.5 * compute[3], f"compute per rank {compute}")
        for r in res:
            recs = r["records"][4:]
            self.assertTrue(all(x["waits"][keys.BROADCAST_BUFFERS][1] == 1 for x in recs))
            # The loss all-reduces run between steps: the next step's cycle holds both.
            self.assertTrue(all(x["waits"][keys.script_key("all_reduce")][1] == 2 for x in recs))
            self.assertEqual(sum(x["waits"].get(keys.script_key("barrier"), [0, 0])[1] for x in recs),
                             len([x for x in recs if (x["step"] - 1) % 3 == 0]))
            for x in recs:
                self.assertLessEqual(x["compute_ms"] + x["waits"][keys.WAIT_DP][0] +
                                     x["waits"][keys.WAIT_OTHER][0], x["cycle_ms"] + 1e-6)
            self.assertEqual(r["telemetry_before_first_step"], "None")
        # The healthy ranks spent the slow rank's 40 ms waiting somewhere measured.
        waited = [med([x["waits"][keys.WAIT_DP][0] + x["waits"][keys.WAIT_OTHER][0]
                       for x in r["records"][4:]]) for r in res]
        for rank in range(3):
            self.assertGreater(waited[rank], 20, f"waits per rank {waited}")

    def test_work_outside_steps_is_charged_to_no_step(self):
        # A marked 300 ms pause (with a barrier in it) every 4 steps, and an unmarked 400 ms gap
        # before step 13: neither lengthens a step's cycle.
        res = harness.launch(2, {"steps": 20, "global_batch": 16, "outside_every": 4,
                                 "outside_ms": 300, "gap_at": 13, "gap_ms": 400},
                             timeout=120).wait()
        for r in res:
            cycles = [x["cycle_ms"] for x in r["records"][1:]]
            self.assertLess(max(cycles), 150, cycles)
            self.assertEqual(r["gaps_excluded"], 5 + 1)
            self.assertTrue(all(keys.script_key("barrier") not in x["waits"] for x in r["records"]))


@unittest.skipUnless(HAVE_FUNCOL, "needs torch 2.x (functional collectives, torch.compile)")
class Torch2Test(unittest.TestCase):
    """What scripts written for torch 2.x do, against the Session's attribution."""

    def test_waits_in_functional_collectives_are_not_compute(self):
        # Rank 3 sleeps 40 ms after its optimizer step; then every rank all-reduces its loss
        # through the functional collectives (as torchtitan logs its loss) and reads it: the
        # healthy ranks block in the result's wait, which must not count as their compute.
        res = harness.launch(4, {"steps": 16, "global_batch": 32, "slow_rank": 3,
                                 "slow_after_ms": 40, "funcol_all_reduce": True},
                             timeout=120).wait()
        med = lambda v: sorted(v)[len(v) // 2]
        compute = [med([x["compute_ms"] for x in r["records"][4:]]) for r in res]
        for rank in range(3):
            self.assertLess(compute[rank], 0.5 * compute[3], f"compute per rank {compute}")
        key = keys.script_key("functional")
        for r in res:
            self.assertTrue(all(x["waits"][key][1] == 1 for x in r["records"][4:]), r["rank"])
        waited = [med([x["waits"][key][0] for x in r["records"][4:]]) for r in res]
        for rank in range(3):
            self.assertGreater(waited[rank], 20, f"functional waits per rank {waited}")

    def test_torch2_idioms_keep_attribution(self):
        # DDP with static_graph and gradient_as_bucket_view, run through torch.compile, its
        # forward under bf16 autocast; rank 3 is 40 ms late before each forward. The Session's
        # timing holds: the healthy ranks wait for it in the gradient reduction, not in compute.
        res = harness.launch(4, {"steps": 24, "global_batch": 32, "slow_rank": 3,
                                 "slow_ms": 40, "torch2_idioms": True}, timeout=240).wait()
        med = lambda v: sorted(v)[len(v) // 2]
        compute = [med([x["compute_ms"] for x in r["records"][8:]]) for r in res]
        waited = [med([x["waits"][keys.WAIT_DP][0] for x in r["records"][8:]]) for r in res]
        for rank in range(3):
            self.assertLess(compute[rank], 0.5 * compute[3], f"compute per rank {compute}")
            self.assertGreater(waited[rank], 20, f"gradient waits per rank {waited}")
        self.assertTrue(all(math.isfinite(r["records"][-1]["loss"]) for r in res))


@unittest.skipUnless(HAVE_TORCH, "needs torch (Debian python3-torch for /usr/bin/python3)")
class AgentTest(unittest.TestCase):
    def setUp(self):
        harness.require_agent(self)
        self.secret_file = harness.SecretFile()
        self.agent = harness.ScriptedAgent(self.secret_file.path)
        self.env = {"PARAPILOT_AGENT": self.agent.address,
                    "PARAPILOT_SECRET_FILE": self.secret_file.path}
        self.job = None

    def tearDown(self):
        if self.job is not None:
            self.job.kill()
        self.agent.stop()
        self.secret_file.close()

    def wait_telemetry(self, pred, timeout=20):
        return self.agent.wait_for(lambda e: e["event"] == "telemetry" and pred(e), timeout)

    def prepare(self, plan_id, world, shares, compression="-"):
        """Prepare on every rank and wait for every rank's PlanReady, which must say ok."""
        self.agent.command(f"prepare {plan_id} {world} {shares} {compression} 10000 test")
        for _ in range(world):
            r = self.agent.wait_for(lambda e: e["event"] == "plan_ready" and e["plan_id"] == plan_id)
            self.assertTrue(r["ok"], r)

    def switch(self, plan_id, world, shares, compression="-", margin=3):
        """Prepare on every rank, wait for every PlanReady, commit a few steps ahead, wait for
        every Ack (what the agent's migration executor does)."""
        self.prepare(plan_id, world, shares, compression)
        newest = max(e["step"] for e in self.agent.events_of("telemetry"))
        at = newest + 1 + margin
        self.agent.command(f"commit {plan_id} {at}")
        for _ in range(world):
            self.agent.wait_for(lambda e: e["event"] == "ack" and e["id"] == plan_id, timeout=20)
        return at

    def test_slow_rank_gets_a_smaller_share_and_the_update_stays_exact(self):
        world = 3
        self.job = harness.launch(world, {"steps": 400, "global_batch": 24, "slow_rank": 2,
                                          "slow_ms": 20, "reference": True, "until_plans": 1,
                                          "min_steps": 1, "step_sleep_ms": 2},
                                  env_extra=self.env, timeout=60)
        # Telemetry arrives from every rank; the slow rank's compute-only time stands out.
        compute = {}
        while len(compute) < world or min(len(v) for v in compute.values()) < 3:
            e = self.wait_telemetry(lambda e: True)
            compute.setdefault(e["rank"], []).append(e["compute_ms"])
            for key in (keys.ALL_REDUCE_DP, keys.PHASE_FORWARD, keys.PHASE_BACKWARD,
                        keys.PHASE_OPTIMIZER):
                self.assertIn(key, e["collectives"])
            for key in (keys.PLAN, keys.SAMPLES):
                self.assertIn(key, e["counts"])
        med = {r: sorted(v)[len(v) // 2] for r, v in compute.items()}
        self.assertGreater(med[2], 15)
        self.assertLess(max(med[0], med[1]), med[2] / 2)
        # Shares inversely proportional to compute time (what the agent's elastic shares do).
        shares = [max(1, round(1000 / med[r])) for r in range(world)]
        at = self.switch(77, world, ",".join(map(str, shares)))
        res = self.job.wait()
        self.job = None
        for r in res:
            self.assertEqual(r["applied"], [77])
            switched = [x["step"] for x in r["records"] if x["plan"] == 77]
            self.assertEqual(switched[0], at)  # every rank at the same step
        from parapilot.pytorch import split_batch
        counts = split_batch(24, shares)
        self.assertLess(counts[2], 8)
        for rank, r in enumerate(res):
            after = [x["samples"] for x in r["records"] if x["plan"] == 77]
            before = [x["samples"] for x in r["records"] if x["plan"] == 0]
            self.assertEqual(set(before), {8})
            self.assertEqual(set(after), {counts[rank]})
        self.assertLess(res[0]["max_diff"], 1e-5)  # weighted update == full-batch update

    def test_compression_cuts_bytes_as_decided(self):
        world = 2
        self.job = harness.launch(world, {"steps": 400, "global_batch": 16, "until_plans": 4,
                                          "min_steps": 1, "step_sleep_ms": 2},
                                  env_extra=self.env, timeout=60)
        self.wait_telemetry(lambda e: e["step"] >= 2)

        def run_for_steps(plan_id, at, steps=4):
            # Each plan runs some steps before the next is prepared (torch's PowerSGD sends its
            # first two iterations uncompressed), counted in the job's steps, not seconds.
            self.wait_telemetry(lambda e: e["counts"].get(keys.PLAN) == plan_id
                                and e["step"] >= at + steps, timeout=60)

        # Layers: 0 = Linear(16,64), 1 = Linear(64,64), 2 = Linear(64,4).
        run_for_steps(1, self.switch(1, world, "1,1", "0-2:1:0"))     # fp16 everywhere
        run_for_steps(2, self.switch(2, world, "1,1", "0-1:2:0.05"))  # top-k 5% on layers 0-1
        run_for_steps(3, self.switch(3, world, "1,1", "0-2:3:2"))     # PowerSGD rank 2 everywhere
        # Mixed in one bucket: per-tensor PowerSGD on layer 0, fp16 on layer 2, layer 1 plain.
        self.switch(4, world, "3,1", "0-0:3:4;2-2:1:0")
        res = self.job.wait()
        self.job = None
        dense = (16 * 64 + 64 + 64 * 64 + 64 + 64 * 4 + 4) * 4
        for r in res:
            self.assertEqual(r["applied"], [1, 2, 3, 4])
            by_plan = {}
            for x in r["records"]:
                by_plan.setdefault(x["plan"], []).append(x)
            self.assertEqual(by_plan[0][-1]["all_reduce_bytes"], dense)
            self.assertEqual(by_plan[1][-1]["all_reduce_bytes"], dense // 2)
            topk = by_plan[2][-1]
            k0, k1 = int(0.05 * (16 * 64 + 64)), int(0.05 * (64 * 64 + 64))
            self.assertEqual(topk["all_gather_bytes"], (k0 + k1) * 8)
            self.assertEqual(topk["all_reduce_bytes"], (64 * 4 + 4) * 4)
            self.assertLess(topk["all_reduce_bytes"] + topk["all_gather_bytes"], dense / 4)
            psgd = by_plan[3][-1]
            self.assertLess(psgd["all_reduce_bytes"], dense / 3)
            mixed = by_plan[4][-1]
            # layer 0 weight as P (16x4) + Q (64x4), its bias plain, layer 1 plain, layer 2 fp16.
            self.assertEqual(mixed["all_reduce_bytes"],
                             (16 * 4 + 64 * 4) * 4 + 64 * 4 + (64 * 64 + 64) * 4 + (64 * 4 + 4) * 2)
            self.assertTrue(all(x["loss"] == x["loss"] for x in r["records"]))  # no NaN

    def test_agent_going_away_leaves_the_job_on_its_last_plan(self):
        world = 2
        self.job = harness.launch(world, {"steps": 60, "global_batch": 16, "step_sleep_ms": 10,
                                          "reference": True},
                                  env_extra=self.env, timeout=60)
        self.wait_telemetry(lambda e: e["step"] >= 2)
        self.switch(5, world, "3,1")
        self.agent.stop()  # the agent goes away for good
        res = self.job.wait()
        self.job = None
        for r in res:
            self.assertEqual(r["applied"], [5])
            self.assertEqual(len(r["records"]), 60)  # trained to the end
            self.assertEqual(r["records"][-1]["plan"], 5)
        self.assertEqual(res[0]["records"][-1]["samples"], 12)
        self.assertLess(res[0]["max_diff"], 1e-5)

    def test_refused_plan_and_abort_keep_the_current_plan(self):
        world = 2
        self.job = harness.launch(world, {"steps": 40, "global_batch": 16, "step_sleep_ms": 5},
                                  env_extra=self.env, timeout=60)
        self.wait_telemetry(lambda e: e["step"] >= 1)
        self.agent.command("prepare 9 2 1,1 - 1000 tp2 2 1")
        for _ in range(world):
            r = self.agent.wait_for(lambda e: e["event"] == "plan_ready" and e["plan_id"] == 9)
            self.assertFalse(r["ok"])
            self.assertIn("pure data parallel", r["detail"])
        self.agent.command("prepare 10 2 1,3 - 1000")
        for _ in range(world):
            self.agent.wait_for(lambda e: e["event"] == "plan_ready" and e["plan_id"] == 10)
        self.agent.command("abort 10 rank 1 not ready")
        self.agent.command("shutdown maintenance")
        res = self.job.wait()
        self.job = None
        for r in res:
            self.assertEqual(r["applied"], [])
            self.assertEqual(r["stop_reason"] is not None, True)
        self.assertEqual(len(res[0]["records"]), len(res[1]["records"]))  # stopped together
        self.assertLess(len(res[0]["records"]), 40)

    def commit_far_ahead(self, plan_id, world, margin=150):
        """Prepares plan_id (shares 3,1,...), commits it `margin` steps past the newest step and
        waits until every rank has trained 5 steps past the commit (it holds it by then).
        Returns the commit's step."""
        self.prepare(plan_id, world, ",".join(["3"] + ["1"] * (world - 1)))
        sent = max(e["step"] for e in self.agent.events_of("telemetry"))
        at = sent + 1 + margin
        self.agent.command(f"commit {plan_id} {at}")
        for rank in range(world):
            self.wait_telemetry(lambda e: e["rank"] == rank and e["step"] >= sent + 5)
        return at

    def check_stopped_before(self, outcomes, at, plan_id, gone, name):
        """Every rank but `gone` exited 3 before step `at` with PeerLost naming `name`, and
        none applied plan_id."""
        for rank, (code, result, err) in enumerate(outcomes):
            if rank == gone:
                continue
            with self.subTest(rank=rank):
                self.assertEqual(code, 3, err[-3000:])
                self.assertEqual(result["applied"], [])
                self.assertTrue(all(x["plan"] == 0 for x in result["records"]))
                self.assertLess(result["step_index"], at)
                msg = result["failed"]
                self.assertIn(f"rank {rank}: stopped at step {result['step_index']}", msg)
                self.assertIn(name, msg)
                self.assertIn(f"plan {plan_id}, committed for step {at}, was not applied", msg)

    def test_rank_killed_after_commit_stops_the_survivors_naming_it(self):
        # Plan 7 is committed 150 steps ahead; once every rank holds the commit, rank 2 is
        # killed. The survivors' next gradient reduction fails: each stops (exit 3, PeerLost)
        # long before the switch step, names rank 2 and the plan it did not apply, and none
        # switched. The job's deadline (60 s) bounds the test; a hang fails it.
        world = 3
        self.job = harness.launch(world, {"steps": 100000, "global_batch": 24,
                                          "step_sleep_ms": 5}, env_extra=self.env, timeout=60)
        self.wait_telemetry(lambda e: e["step"] >= 2)
        at = self.commit_far_ahead(7, world)
        self.job.kill_rank(2)
        outcomes = self.job.outcomes()
        self.job = None
        self.check_stopped_before(outcomes, at, 7, gone=2,
                                  name="lost: rank 2, no answer in the job's store")

    def test_link_cut_after_commit_stops_every_rank_naming_it(self):
        # The same, but rank 1's process lives: it cuts its connections to its peers (its
        # process groups' sockets; the store and the agent stay connected). Every rank stops
        # (exit 3, PeerLost) before the switch step, none switched, and the survivors say no
        # process was lost and name rank 1's cut links.
        world = 3
        cut_file = os.path.join(self.secret_file.dir, "cut")
        self.job = harness.launch(world, {"steps": 100000, "global_batch": 24,
                                          "step_sleep_ms": 5, "cut_links_rank": 1,
                                          "cut_links_file": cut_file},
                                  env_extra=self.env, timeout=60)
        self.wait_telemetry(lambda e: e["step"] >= 2)
        at = self.commit_far_ahead(8, world)
        open(cut_file, "w").close()
        outcomes = self.job.outcomes()
        self.job = None
        self.check_stopped_before(outcomes, at, 8, gone=-1,
                                  name="no rank lost: every rank answered in the job's store")
        for rank in (0, 2):
            self.assertIn("rank 1: links to its peers cut before step", outcomes[rank][1]["failed"])
        self.assertIn("(this rank: links to its peers cut before step", outcomes[1][1]["failed"])


if __name__ == "__main__":
    unittest.main()
