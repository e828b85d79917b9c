"""Bus client against the scripted C++ agent: handshake, telemetry, plan protocol, heartbeats,
reconnects, the bounded telemetry buffer and a wrong secret."""

import os
import time
import unittest

import harness
from parapilot import telemetry_keys as keys, wire
from parapilot.auth import Secret, SecretError, load_secret, load_secret_from_file
from parapilot.client import Client
from parapilot.plans import PlanBook


def quiet(level, line):
    pass


def telemetry(rank, step):
    now = time.time_ns()
    return wire.Telemetry(rank, step, now - 1000, now, now, 0.5, 0,
                          {keys.ALL_REDUCE_DP: wire.CollectiveStat(0.25, 1024, 1)})


class ClientTest(unittest.TestCase):
    def setUp(self):
        harness.require_agent(self)
        self.secret_file = harness.SecretFile()
        self.secret = load_secret_from_file(self.secret_file.path)
        self.agent = harness.ScriptedAgent(self.secret_file.path)
        self.clients = []

    def tearDown(self):
        for c in self.clients:
            c.stop()
        self.agent.stop()
        self.secret_file.close()

    def client(self, rank=0, **kw):
        kw.setdefault("logger", quiet)
        kw.setdefault("heartbeat_interval_ms", 200)
        kw.setdefault("heartbeat_timeout_ms", 1000)
        c = Client(self.agent.address, self.secret, name=f"worker-{rank}", rank=rank, **kw)
        self.clients.append(c)
        return c

    def test_telemetry_arrives_in_order(self):
        c = self.client(rank=1)
        self.assertTrue(c.wait_connected(5))
        ev = self.agent.wait_for(lambda e: e["event"] == "connect")
        self.assertEqual((ev["rank"], ev["name"]), (1, "worker-1"))
        for step in range(50):
            self.assertTrue(c.send(telemetry(1, step)))
        steps = [self.agent.wait_for(lambda e: e["event"] == "telemetry")["step"] for _ in range(50)]
        self.assertEqual(steps, list(range(50)))
        last = [e for e in self.agent.log if e["event"] == "telemetry"][-1]
        self.assertEqual(last["collectives"][keys.ALL_REDUCE_DP], [0.25, 1024, 1])

    def test_invalid_and_internal_messages_are_refused(self):
        c = self.client()
        bad = telemetry(0, 1)
        bad.compute_ms = float("nan")
        self.assertFalse(c.send(bad))
        self.assertFalse(c.send(wire.Heartbeat(1, 2)))

    def test_plan_protocol(self):
        got = []
        book_ref = []

        def on_message(m):
            got.append(m)
            book_ref[0].on_message(m)

        c = self.client(rank=0, on_message=on_message)
        book = PlanBook(0, c.send, check=lambda p: "" if p.layout.tp == 1 else "tp > 1 unsupported",
                        stage=lambda p: list(p.layout.dp_shares))
        book_ref.append(book)
        self.assertTrue(c.wait_connected(5))
        self.agent.wait_for(lambda e: e["event"] == "connect")
        self.agent.command("prepare 5 2 3,1 0-3:1:0 1000 elastic")
        ready = self.agent.wait_for(lambda e: e["event"] == "plan_ready")
        self.assertEqual((ready["plan_id"], ready["rank"], ready["ok"]), (5, 0, True))
        self.assertEqual(book.get(5).staged, [3, 1])
        self.assertEqual(book.get(5).prepare.layout.compression[0].method, wire.CompressionMethod.FP16)
        self.agent.command("commit 5 10")
        deadline = time.monotonic() + 5
        while book.committed_at(10, 0) != 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(book.committed_at(9, 0), 0)
        self.assertEqual(book.committed_at(10, 0), 5)
        self.assertEqual(book.committed_at(10, 5), 0)
        book.applied(5)
        ack = self.agent.wait_for(lambda e: e["event"] == "ack")
        self.assertEqual((ack["acked"], ack["id"], ack["rank"]), (9, 5, 0))
        # A layout the job cannot run is refused with the reason.
        self.agent.command("prepare 6 1 - - 1000 tp2 2 1")
        ready = self.agent.wait_for(lambda e: e["event"] == "plan_ready")
        self.assertEqual((ready["plan_id"], ready["ok"], ready["detail"]), (6, False, "tp > 1 unsupported"))
        # Abort drops a staged plan.
        self.agent.command("prepare 7 2 1,1 - 1000")
        self.agent.wait_for(lambda e: e["event"] == "plan_ready" and e["plan_id"] == 7)
        self.agent.command("abort 7 rank 1 not ready")
        deadline = time.monotonic() + 5
        while book.get(7) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertIsNone(book.get(7))
        self.agent.command("shutdown job done")
        deadline = time.monotonic() + 5
        while book.stop_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(book.stop_reason, "job done")

    def test_heartbeats_keep_an_idle_connection(self):
        c = self.client()
        self.assertTrue(c.wait_connected(5))
        time.sleep(1.6)  # > the agent's heartbeat timeout (5 x 200 ms) and the client's (1 s)
        self.assertTrue(c.connected)
        self.assertEqual(c.stats().connects, 1)
        self.assertFalse(any(e["event"] == "disconnect" for e in self.agent.log))

    def test_a_timeout_no_longer_than_the_servers_heartbeat_interval_is_widened(self):
        # The agent sends a heartbeat after 1000 ms of idleness (its Welcome says so); a client
        # asking for 400 ms of silence would drop a healthy connection every 400 ms. Widened to
        # 2000 ms, it keeps it through two of the agent's heartbeats.
        self.agent.stop()
        self.agent = harness.ScriptedAgent(self.secret_file.path, heartbeat_ms=1000)
        c = self.client(heartbeat_timeout_ms=400)
        self.assertTrue(c.wait_connected(5))
        time.sleep(2.5)
        self.assertTrue(c.connected)
        self.assertEqual(c.stats().connects, 1)
        self.assertFalse(any(e["event"] == "disconnect" for e in self.agent.log))

    def test_wrong_secret_is_refused(self):
        reasons = []
        c = Client(self.agent.address, Secret(b"a-different-secret-of-32-bytes!!"), name="intruder",
                   rank=0, logger=quiet, on_disconnect=reasons.append, reconnect_initial_ms=20)
        self.clients.append(c)
        self.assertFalse(c.wait_connected(0.5))
        self.assertTrue(any("proof mismatch" in r for r in reasons), reasons)
        self.assertFalse(any(e["event"] == "connect" for e in self.agent.log))

    def test_reconnects_and_buffers_telemetry_dropping_the_oldest(self):
        port = self.agent.port
        c = self.client(rank=2, telemetry_buffer_capacity=10, reconnect_initial_ms=20,
                        reconnect_max_ms=100)
        self.assertTrue(c.wait_connected(5))
        self.agent.stop()  # the agent goes away
        deadline = time.monotonic() + 5
        while c.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertFalse(c.connected)
        for step in range(30):
            c.send(telemetry(2, step))
        self.assertEqual(c.stats().telemetry_dropped, 20)
        self.assertTrue(c.send(wire.Ack(9, 1, 2)))  # control messages are kept
        self.agent = harness.ScriptedAgent(self.secret_file.path, port=port)
        self.assertTrue(c.wait_connected(5))
        steps = [self.agent.wait_for(lambda e: e["event"] == "telemetry")["step"] for _ in range(10)]
        self.assertEqual(steps, list(range(20, 30)))
        self.agent.wait_for(lambda e: e["event"] == "ack")
        self.assertTrue(c.flush(5))
        self.assertGreaterEqual(c.stats().connects, 2)

    def test_stop_is_prompt_without_a_server(self):
        c = Client(f"127.0.0.1:{harness.free_port()}", self.secret, logger=quiet)
        t0 = time.monotonic()
        c.stop()
        c.stop()
        self.assertLess(time.monotonic() - t0, 2)
        self.assertFalse(c.send(telemetry(0, 0)))


class SecretTest(unittest.TestCase):
    """Every way of not having a usable secret names both variables and how to make one."""

    def check(self, **env):
        saved = {k: os.environ.pop(k, None) for k in ("PARAPILOT_SECRET", "PARAPILOT_SECRET_FILE")}
        try:
            os.environ.update(env)
            with self.assertRaises(SecretError) as cm:
                load_secret()
            text = str(cm.exception)
            self.assertIn("PARAPILOT_SECRET_FILE", text)
            self.assertIn("PARAPILOT_SECRET ", text)
            self.assertIn("head -c 32 /dev/urandom", text)
            return text
        finally:
            for k in ("PARAPILOT_SECRET", "PARAPILOT_SECRET_FILE"):
                os.environ.pop(k, None)
                if saved[k] is not None:
                    os.environ[k] = saved[k]

    def test_none_set(self):
        self.assertIn("neither", self.check())

    def test_missing_file(self):
        self.check(PARAPILOT_SECRET_FILE="/nonexistent/secret")

    def test_too_short(self):
        self.check(PARAPILOT_SECRET="short")

    def test_file_open_to_others(self):
        secret = harness.SecretFile()
        try:
            os.chmod(secret.path, 0o644)
            text = self.check(PARAPILOT_SECRET_FILE=secret.path)
            self.assertIn(secret.path, text)
            self.assertIn("mode 0644", text)
            self.assertIn("chmod 600", text)
            os.chmod(secret.path, 0o640)  # its group may read it; others may not
            self.assertGreaterEqual(len(load_secret(secret.path)), 16)
        finally:
            secret.close()

    def test_good_secret_loads(self):
        saved = os.environ.pop("PARAPILOT_SECRET_FILE", None)
        os.environ["PARAPILOT_SECRET"] = "a-good-secret-of-enough-bytes"
        try:
            self.assertEqual(len(load_secret()), len("a-good-secret-of-enough-bytes"))
        finally:
            del os.environ["PARAPILOT_SECRET"]
            if saved is not None:
                os.environ["PARAPILOT_SECRET_FILE"] = saved


if __name__ == "__main__":
    unittest.main()
