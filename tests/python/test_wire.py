"""Wire format: CRC32C vectors, the worked example, and a byte-for-byte cross-check with the C++
codec (scripted_agent --dump-frames / --decode)."""

import os
import struct
import subprocess
import unittest

import harness  # noqa: F401  (sets sys.path)
from parapilot import wire
from parapilot.auth import client_proof, server_proof, Secret, load_secret_from_env, \
    load_secret_from_file, SecretError


class Crc32cTest(unittest.TestCase):
    def test_known_vectors(self):
        self.assertEqual(wire.crc32c(b"123456789"), 0xE3069283)
        self.assertEqual(wire.crc32c(bytes(32)), 0x8A9136AA)
        self.assertEqual(wire.crc32c(b"\xff" * 32), 0x62A8AB43)
        self.assertEqual(wire.crc32c(bytes(range(32))), 0x46DD794E)
        self.assertEqual(wire.crc32c(bytes(range(31, -1, -1))), 0x113FDB5C)
        self.assertEqual(wire.crc32c(b""), 0)

    def test_incremental(self):
        data = b"The quick brown fox jumps over the lazy dog, twice over."
        for cut in range(len(data) + 1):
            self.assertEqual(wire.crc32c(data[cut:], wire.crc32c(data[:cut])), wire.crc32c(data))


class WorkedExampleTest(unittest.TestCase):
    def test_plan_abort_frame(self):
        f = wire.encode_frame(wire.PlanAbort(7, "rank 3 not ready"))
        self.assertEqual(f.hex(), "50504c54020a000021000000f7f2e92f"
                         "010700000000000000100000000000000072616e6b2033206e6f74207265616479")
        self.assertEqual(wire.decode_frame(f), wire.PlanAbort(7, "rank 3 not ready"))


class RejectionTest(unittest.TestCase):
    def frame(self):
        return bytearray(wire.encode_frame(wire.PlanCommit(3, 9)))

    def test_bad_header_fields(self):
        for offset, value, words in ((0, 0x51, "magic"), (4, wire.WIRE_VERSION + 1, "version"), (5, 14, "type"),
                                     (6, 1, "flags"), (12, 0, "checksum")):
            f = self.frame()
            f[offset] = value
            with self.assertRaisesRegex(wire.WireError, words):
                wire.decode_frame(bytes(f))

    def test_oversized_header_rejected_before_payload(self):
        head = b"PPLT" + struct.pack("<BBHI", wire.WIRE_VERSION, 6, 0, 2 << 20) + b"\0\0\0\0"
        d = wire.FrameDecoder()
        d.feed(head)
        with self.assertRaisesRegex(wire.WireError, "oversized"):
            d.next()

    def test_payload_checks(self):
        def raw(t, payload):
            return wire.frame_raw(t, payload)
        cases = [
            (raw(9, b"\x02" + bytes(16)), "endianness"),
            (raw(9, b"\x01" + bytes(15)), "truncated"),
            (raw(9, b"\x01" + bytes(17)), "trailing"),
            (raw(8, b"\x01" + struct.pack("<QIB", 1, 0, 2) + bytes(8)), "boolean"),
            (raw(12, b"\x01" + struct.pack("<Q", 5000)), "exceeds limit"),
            (raw(12, b"\x01" + struct.pack("<Q", 1000)), "remaining payload"),
            (raw(6, b"\x01" + struct.pack("<IQQQQdI", 1, 0, 0, 0, 0, float("nan"), 0)
                 + bytes(32)), "NaN"),
            (raw(6, b"\x01" + struct.pack("<IQQQQdI", 1, 0, 0, 0, 0, 1.0, 0) + bytes(24)
                 + struct.pack("<Q", 1) + struct.pack("<Q", 9) + b"info/loss"
                 + struct.pack("<d", float("inf"))), "not finite"),
        ]
        for f, words in cases:
            with self.assertRaisesRegex(wire.WireError, words):
                wire.decode_frame(f)

    def test_validate_plan_prepare(self):
        good = wire.PlanPrepare(1, wire.Layout(dp=2, dp_shares=[1, 3]))
        self.assertEqual(wire.validate(good), "")
        self.assertIn("dp entries", wire.validate(wire.PlanPrepare(1, wire.Layout(dp=2, dp_shares=[1]))))
        bad_topk = wire.PlanPrepare(1, wire.Layout(compression=[wire.LayerCompression(0, 1, 2, 1.5)]))
        self.assertIn("topk", wire.validate(bad_topk))

    def test_validate_job_info(self):
        good = wire.JobInfo(3, 4, 64, wire.Capability.DP_SHARES, "pytorch-ddp",
                            [wire.LayerInfo(10, 40)])
        self.assertEqual(wire.validate(good), "")
        self.assertEqual(wire.decode_frame(wire.encode_frame(good)), good)
        for bad, words in ((wire.JobInfo(4, 4), "rank"), (wire.JobInfo(0, 0), "world_size"),
                           (wire.JobInfo(0, 4, capabilities=1 << 9), "unknown bits"),
                           (wire.JobInfo(0, 4, global_batch=(1 << 30) + 1), "too large")):
            self.assertIn(words, wire.validate(bad))
        # A frame the C++ would refuse is refused here too: trailing bytes after the layers.
        f = bytearray(wire.encode_frame(good))
        payload = bytes(f[16:]) + b"\x00"
        with self.assertRaisesRegex(wire.WireError, "trailing"):
            wire.decode_payload(wire.MessageType.JOB_INFO, payload)


class AuthTest(unittest.TestCase):
    def test_proofs_differ_by_direction(self):
        s = Secret(b"0123456789abcdef")
        a, b = bytes(range(32)), bytes(range(32, 64))
        self.assertNotEqual(server_proof(s, a, b), client_proof(s, b, a))
        self.assertEqual(len(server_proof(s, a, b)), 32)
        self.assertNotIn("0123", repr(s))

    def test_loaders(self):
        sf = harness.SecretFile(b"short")
        try:
            with self.assertRaisesRegex(SecretError, "shorter"):
                load_secret_from_file(sf.path)
        finally:
            sf.close()
        sf = harness.SecretFile()
        try:
            self.assertEqual(load_secret_from_file(sf.path).bytes, harness.SECRET)
        finally:
            sf.close()
        os.environ["PARAPILOT_TEST_SECRET_X"] = "abcdefghijklmnopq\r\n"
        self.assertEqual(load_secret_from_env("PARAPILOT_TEST_SECRET_X").bytes, b"abcdefghijklmnopq")
        with self.assertRaisesRegex(SecretError, "not set"):
            load_secret_from_env("PARAPILOT_TEST_SECRET_MISSING")


class CrossCheckTest(unittest.TestCase):
    """The C++ codec's frames decode here and re-encode to the same bytes, and vice versa."""

    def setUp(self):
        harness.require_agent(self)
        self.exe = harness.scripted_agent_path()

    def test_cpp_frames_round_trip_in_python(self):
        out = subprocess.run([self.exe, "--dump-frames"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.split("\n")
        seen = set()
        for line in filter(None, out):
            t, hx = line.split()
            frame = bytes.fromhex(hx)
            m = wire.decode_frame(frame)
            self.assertEqual(m.TYPE, int(t))
            self.assertEqual(wire.encode_frame(m).hex(), hx, f"type {t}")
            seen.add(m.TYPE)
        self.assertEqual(seen, set(range(1, 14)))
        # Spot checks of decoded values.
        prep = [wire.decode_frame(bytes.fromhex(l.split()[1])) for l in out if l.startswith("7 ")][0]
        self.assertEqual(prep.layout.dp_shares, [5, 1, 2])
        tel = [wire.decode_frame(bytes.fromhex(l.split()[1])) for l in out if l.startswith("6 ")][0]
        self.assertEqual(tel.counts, {"info/plan": 1800000000000000123})
        self.assertEqual(tel.measures, {"info/loss": -2.75})
        self.assertEqual([(c.first_layer, c.last_layer, c.method, c.parameter)
                          for c in prep.layout.compression],
                         [(0, 3, 1, 0.0), (4, 4, 2, 0.125), (5, 16383, 3, 4.0)])

    def test_python_frames_decode_in_cpp(self):
        msgs = [
            wire.Hello(1, 0, "worker-0", os.urandom(32)),
            wire.Telemetry(1, 5, 100, 200, 300, 1.5, 0,
                           {"b/x": wire.CollectiveStat(1.0, 10, 1),
                            "a/y": wire.CollectiveStat(2.0, 20, 2)},
                           [wire.LayerGradStat(0, 0.5, 0.25, 0)],
                           {"info/plan": 1800000000000000123, "info/samples": 48},
                           {"info/loss": -0.125}),
            wire.PlanReady(9, 1, False, "nope"),
            wire.Ack(9, 9, 1),
            wire.Shutdown("bye"),
            wire.JobInfo(2, 4, 256, wire.Capability.DP_SHARES | wire.Capability.COMPRESSION,
                         "pytorch-ddp 1.13", [wire.LayerInfo(66048, 264192)]),
            wire.PlanPrepare(4, wire.Layout(2, 1, 1, 1, [3, 1],
                                            [wire.LayerCompression(0, 2, 2, 0.25)]), "x", 10),
        ]
        lines = "\n".join(wire.encode_frame(m).hex() for m in msgs) + "\n"
        # A corrupted frame must be refused by the C++ decoder too.
        bad = bytearray(wire.encode_frame(wire.Shutdown("bye")))
        bad[-1] ^= 1
        lines += bytes(bad).hex() + "\n"
        out = subprocess.run([self.exe, "--decode"], input=lines, capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip().split("\n")
        self.assertEqual(len(out), len(msgs) + 1)
        for m, line in zip(msgs, out):
            self.assertEqual(line, f"ok {m.TYPE} same")
        self.assertTrue(out[-1].startswith("error bad checksum"), out[-1])


if __name__ == "__main__":
    unittest.main()
