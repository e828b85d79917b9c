"""A DDP job across network namespaces (netns_hosts.Hosts): 4 ranks of ddp_worker.py, each on its
own host joined to a switch by a veth pair (GLOO_SOCKET_IFNAME the host's interface, MASTER_ADDR
host 0's address), no agent.

  * The gradient traffic crosses the links: every host's interface counters, sent and received,
    are within [0.8, 1.6] of what a ring all-reduce moves per rank, 2 (W - 1) / W of the bytes
    the ranks' telemetry says they all-reduced, summed over the steps (the rest: the model's
    broadcast at start, the store and the step-boundary agreement).
  * A host whose link is limited with tbf (50 Mbit/s) slows every step: the median step is at
    least 80% of the time the limit itself sets for one step's ring traffic through that host
    (a bound of the limiter, not of the machine), and at least twice the unlimited run's median
    (a wall-time ratio on a shared machine: the ctest entry is labelled retry, as the job-shape
    matrix).

Skipped (77 through run_suite.py) without root, network namespaces or torch.
"""

import statistics
import unittest

import harness
import netns_hosts

try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False

WORLD = 4
HIDDEN = 256  # ddp_worker's model: 71,172 parameters, 284,688 gradient bytes a step
STEPS = 20
LIMIT_MBIT = 50
LIMITED = 2


def ring_bytes(record, world=WORLD):
    """What one rank sends (and receives) in a ring all-reduce of the step's gradient bytes."""
    return 2 * (world - 1) / world * (record["all_reduce_bytes"] + record["all_gather_bytes"])


@unittest.skipUnless(HAVE_TORCH, "needs torch (Debian python3-torch for /usr/bin/python3)")
class NetnsDDPTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        why = netns_hosts.unavailable()
        if why is not None:
            raise unittest.SkipTest(why)
        cls.hosts = netns_hosts.Hosts(WORLD)  # tag: the process id (entries may run at once)

    @classmethod
    def tearDownClass(cls):
        cls.hosts.close()

    def run_job(self, steps=STEPS):
        """Runs the job once across the hosts; returns (per-rank results, per-host byte deltas)."""
        h = self.hosts
        before = h.all_bytes()
        job = harness.launch(WORLD, {"steps": steps, "global_batch": 32, "hidden": HIDDEN},
                             env_extra={"GLOO_SOCKET_IFNAME": h.ifname, "PARAPILOT_AGENT": ""},
                             wrap=h.exec_argv, master_addr=h.addresses[0], timeout=180)
        res = job.wait()
        after = h.all_bytes()
        moved = [{k: after[i][k] - before[i][k] for k in ("tx", "rx")} for i in range(WORLD)]
        return res, moved

    def test_gradient_traffic_crosses_the_links(self):
        res, moved = self.run_job()
        for rank, r in enumerate(res):
            self.assertEqual(len(r["records"]), STEPS)
            expected = sum(ring_bytes(x) for x in r["records"])
            self.assertGreater(expected, STEPS * 400_000)
            for way in ("tx", "rx"):
                ratio = moved[rank][way] / expected
                self.assertTrue(0.8 <= ratio <= 1.6,
                                f"host {rank} {way} {moved[rank][way]} bytes for {expected:.0f} "
                                f"expected (ratio {ratio:.2f})")

    def test_a_rate_limited_host_slows_every_step(self):
        free, _ = self.run_job()
        self.hosts.shape(LIMITED, rate_mbit=LIMIT_MBIT)
        try:
            limited, moved = self.run_job()
        finally:
            self.hosts.shape(LIMITED, None)
        free_ms = statistics.median(x["cycle_ms"] for x in free[0]["records"])
        limited_ms = statistics.median(x["cycle_ms"] for x in limited[0]["records"])
        wire_ms = ring_bytes(limited[LIMITED]["records"][-1]) * 8 / (LIMIT_MBIT * 1e6) * 1e3
        print(f"median step: unlimited {free_ms:.1f} ms, host {LIMITED} at {LIMIT_MBIT} Mbit/s "
              f"{limited_ms:.1f} ms (its ring traffic alone: {wire_ms:.1f} ms a step)")
        self.assertGreater(limited_ms, 0.8 * wire_ms)
        self.assertGreater(limited_ms, 2 * free_ms)


if __name__ == "__main__":
    unittest.main()
