"""python/parapilot/telemetry_keys.py replays tests/data/telemetry_keys/vectors.json, the same
vectors transport/telemetry_keys.h replays (tests/transport/test_telemetry_keys.cc): both sides
spell each key and store each fact the same way."""

import json
import os
import unittest

from parapilot import telemetry_keys as keys, wire

VECTORS = os.path.join(os.path.dirname(__file__), "..", "data", "telemetry_keys", "vectors.json")


def load():
    with open(VECTORS) as f:
        return json.load(f)


class TelemetryKeysTest(unittest.TestCase):
    def test_every_key_is_spelled_as_the_vectors_spell_it(self):
        v = load()
        constants = {n for n in keys.__all__ if n.isupper()}
        self.assertEqual(set(v["keys"]), constants)
        for name, key in v["keys"].items():
            self.assertEqual(getattr(keys, name), key, name)
            self.assertEqual(keys.is_info(getattr(keys, name)), key.startswith("info/"), name)
        for op, key in v["script_keys_python_only"].items():
            self.assertEqual(keys.script_key(op), key)
        self.assertGreaterEqual(len(v["block_ms_keys"]), 2)
        for block, key in v["block_ms_keys"].items():
            self.assertEqual(keys.block_ms_key(int(block)), key, block)

    def test_each_fact_is_stored_and_read_back_as_the_vectors_say(self):
        facts = load()["facts"]
        self.assertGreaterEqual(len(facts), 8)
        for f in facts:
            with self.subTest(f=f):
                t = wire.Telemetry()
                if f["set"] == "info":
                    keys.set_info(t, f["key"], f["value"])
                    self.assertEqual(keys.info(t, f["key"]), f["read"])
                elif f["set"] == "loss":
                    keys.set_loss(t, f["value"])
                    self.assertEqual(keys.loss(t), f["read"])
                elif f["set"] == "block_ms":
                    keys.set_block_ms(t, f["block"], f["value"])
                    self.assertEqual(keys.block_ms(t, f["block"]), f["read"])
                else:
                    self.assertEqual(f["set"], "replica_and_stage")
                    keys.set_replica_and_stage(t, *f["value"])
                    self.assertEqual([keys.info(t, keys.REPLICA), keys.info(t, keys.STAGE)],
                                     f["read"])
                self.assertEqual(t.counts, f["counts"])
                self.assertEqual(t.measures, f["measures"])
                self.assertEqual(t.collectives, {})
                # What was set survives the wire unchanged.
                self.assertEqual(wire.decode_frame(wire.encode_frame(t)), t)

    def test_a_diverged_steps_loss_is_not_reported(self):
        t = wire.Telemetry()
        keys.set_loss(t, 1.5)
        keys.set_loss(t, float("nan"))
        self.assertIsNone(keys.loss(t))
        keys.set_loss(t, float("inf"))
        self.assertEqual(t.measures, {})
        keys.set_loss(t, -0.5)
        self.assertEqual(keys.loss(t), -0.5)

    def test_a_blocks_non_finite_or_negative_compute_is_not_reported(self):
        t = wire.Telemetry()
        keys.set_block_ms(t, 3, 2.0)
        keys.set_block_ms(t, 3, float("nan"))
        self.assertIsNone(keys.block_ms(t, 3))
        keys.set_block_ms(t, 4, -1.0)
        self.assertEqual(t.measures, {})
        keys.set_block_ms(t, 4, 1.0)
        self.assertIsNone(keys.block_ms(t, 3))
        self.assertEqual(keys.block_ms(t, 4), 1.0)

    def test_a_fact_the_telemetry_does_not_carry_reads_as_absent(self):
        t = wire.Telemetry(collectives={keys.WAIT_DP: wire.CollectiveStat(1.5, 0, 1)})
        self.assertIsNone(keys.info(t, keys.SAMPLES))
        self.assertIsNone(keys.loss(t))


if __name__ == "__main__":
    unittest.main()
