"""python/parapilot/plan_name.py replays tests/data/plan_name/vectors.json, the same vectors
transport/plan_name.h replays (tests/transport/test_plan_name.cc): both sides read and write
every plan name the same way and refuse the same malformed ones."""

import dataclasses
import json
import os
import unittest

from parapilot import plan_name, wire

VECTORS = os.path.join(os.path.dirname(__file__), "..", "data", "plan_name", "vectors.json")
METHODS = {name: value for value, name in wire.CompressionMethod.NAMES.items()}


def load():
    with open(VECTORS) as f:
        return json.load(f)


def typed(kind, fields):
    if kind == "layout":
        return plan_name.LayoutPlanName(**fields)
    if kind == "action":
        f = dict(fields, compression=[METHODS[m] for m in fields["compression"]])
        return plan_name.ActionPlanName(**f)
    return plan_name.LabelPlanName(**fields)


class PlanNameTest(unittest.TestCase):
    def test_valid_texts_decode_to_their_fields_and_encode_back(self):
        valid = load()["valid"]
        self.assertGreaterEqual(len(valid), 10)
        for v in valid:
            with self.subTest(text=v["text"]):
                self.assertEqual(plan_name.kind(v["text"]), v["kind"])
                got = plan_name.decode(v["text"])
                want = typed(v["kind"], v["fields"])
                self.assertEqual(type(got), type(want))
                if isinstance(want, plan_name.ActionPlanName):
                    self.assertEqual(len(got.shares), len(want.shares))
                    for a, b in zip(got.shares, want.shares):
                        self.assertAlmostEqual(a, b, places=12)
                    got = dataclasses.replace(got, shares=want.shares)
                self.assertEqual(got, want)
                self.assertEqual(plan_name.encode(want), v.get("encoded", v["text"]))

    def test_invalid_texts_are_refused_naming_the_field(self):
        invalid = load()["invalid"]
        self.assertGreaterEqual(len(invalid), 20)
        for v in invalid:
            with self.subTest(text=v["text"]):
                with self.assertRaises(plan_name.PlanNameError) as caught:
                    plan_name.decode(v["text"])
                for word in v["error"]:
                    self.assertIn(word, str(caught.exception))

    def test_what_cannot_be_written_is_refused(self):
        with self.assertRaises(plan_name.PlanNameError):
            plan_name.encode(plan_name.ActionPlanName(layout="dp=1;pp=4"))
        with self.assertRaises(plan_name.PlanNameError):
            plan_name.encode(plan_name.ActionPlanName(shares=[0.1] * 40))
        with self.assertRaises(plan_name.PlanNameError):
            plan_name.encode(plan_name.LabelPlanName("dp4-anything"))


if __name__ == "__main__":
    unittest.main()
