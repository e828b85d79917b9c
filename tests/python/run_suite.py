"""Runs one unittest module for ctest and says honestly what happened: exit 0 when every test ran
and passed, 1 on any failure or error, 77 (the suites' SKIP_RETURN_CODE) when nothing failed but
something was skipped; the skipped tests and their reasons are listed.

    python3 run_suite.py test_ddp            # or test_ddp.OfflineTest
"""

import sys
import unittest

SKIPPED = 77


def main(argv):
    if len(argv) != 2:
        print("usage: run_suite.py MODULE[.CLASS]", file=sys.stderr)
        return 2
    suite = unittest.defaultTestLoader.loadTestsFromName(argv[1])
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    if not result.wasSuccessful():
        return 1
    if result.testsRun == 0:
        print(f"{argv[1]}: no tests", file=sys.stderr)
        return 1
    if result.skipped:
        for test, reason in result.skipped:
            print(f"SKIPPED {test.id()}: {reason}", file=sys.stderr)
        return SKIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
