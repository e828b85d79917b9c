"""The Python client's PlanBook replays the switch-protocol transcripts in tests/data/switch/
(format in that folder's README.md), the same files the C++ transport::PlanBook replays
(tests/transport/test_plan_book.cc): both sides of the protocol follow one set of rules."""

import os
import unittest

from parapilot import wire
from parapilot.plans import PlanBook

TRANSCRIPTS = os.path.join(os.path.dirname(__file__), "..", "data", "switch")


def replay(test, path):
    sent = []
    book = PlanBook(3, lambda m: sent.append(m) or True)
    with open(path) as f:
        lines = f.read().splitlines()
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{os.path.basename(path)}:{number}: {line}"
        words = line.split()
        verb, args = words[0], words[1:]
        rest = lambda k: " ".join(args[k:])  # noqa: E731
        if verb == "recv":
            kind = args[0]
            if kind == "prepare":
                handed = book.on_message(wire.PlanPrepare(int(args[1]), wire.Layout()))
                test.assertIsNotNone(handed, where)
                test.assertEqual(handed.plan_id, int(args[1]), where)
            elif kind == "commit":
                test.assertIsNone(book.on_message(wire.PlanCommit(int(args[1]), int(args[2]))), where)
            elif kind == "abort":
                test.assertIsNone(book.on_message(wire.PlanAbort(int(args[1]), rest(2))), where)
            elif kind == "shutdown":
                test.assertIsNone(book.on_message(wire.Shutdown(rest(1))), where)
            else:
                test.fail(f"{where}: unknown message")
        elif verb == "stage":
            book.stage(int(args[0]), int(args[0]))
        elif verb == "ready":
            book.ready(int(args[0]))
        elif verb == "refuse":
            book.refuse(int(args[0]), rest(1))
        elif verb == "agent-lost":
            book.drop_uncommitted()
        elif verb == "committed-at":
            test.assertEqual(book.committed_at(int(args[0]), int(args[1])), int(args[3]), where)
        elif verb == "holds":
            test.assertEqual(book.holds(int(args[0])), args[2] == "yes", where)
        elif verb == "applied":
            p = book.applied(int(args[0]))
            test.assertEqual(p is not None, args[2] == "yes", where)
            if p is not None:
                test.assertEqual(p.staged, int(args[0]), where)
        elif verb == "missed":
            book.missed(int(args[0]), rest(1))
        elif verb == "sent":
            if args[0] == "none":
                test.assertEqual(sent, [], where)
                continue
            test.assertTrue(sent, f"{where}: nothing was sent")
            m = sent.pop(0)
            if args[0] == "ready":
                test.assertIs(type(m), wire.PlanReady, where)
                test.assertEqual((m.plan_id, m.rank, m.ok), (int(args[1]), 3, args[2] == "ok"), where)
                if not m.ok:
                    test.assertTrue(m.detail, where)
            elif args[0] == "ack":
                test.assertIs(type(m), wire.Ack, where)
                test.assertEqual((m.acked, m.id, m.rank),
                                 (wire.MessageType.PLAN_COMMIT, int(args[1]), 3), where)
            else:
                test.fail(f"{where}: unknown sent message")
        elif verb in ("stop", "no-plans"):
            expected = rest(1)
            reason = book.stop_reason if verb == "stop" else book.no_plans_reason
            test.assertEqual(reason, None if expected == "none" else expected, where)
        else:
            test.fail(f"{where}: unknown line")


class TranscriptTest(unittest.TestCase):
    def test_every_transcript(self):
        files = sorted(f for f in os.listdir(TRANSCRIPTS) if f.endswith(".txt"))
        self.assertGreaterEqual(len(files), 9)
        for name in files:
            with self.subTest(transcript=name):
                replay(self, os.path.join(TRANSCRIPTS, name))


if __name__ == "__main__":
    unittest.main()
