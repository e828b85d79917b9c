#!/usr/bin/env python3
"""Checks that each top-level module includes only the modules below it (docs/architecture.md,
"Modules"): an #include "DIR/..." from a file under FOLDER must name a DIR the table allows.

    scripts/check-layering.py [ROOT]

Prints each violation as FILE:LINE: FOLDER may not include DIR ("...") and exits 1; exits 0
when there are none.
"""

import os
import re
import sys

# Lowest first. A module may include itself and what is listed for it.
ALLOWED = {
    "core": set(),
    "strategy": {"core"},
    "transport": {"core"},
    "env": {"core", "strategy", "transport"},
    "policy": {"core", "strategy", "transport", "env", "checkpoints"},
    "checkpoints": {"core", "policy"},  # the feature schema and normaliser (policy/features.h)
    "agent": {"core", "strategy", "transport", "env", "policy", "checkpoints"},
    "experiments": {"core", "strategy", "transport", "env", "policy", "checkpoints", "agent"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]*"')


def violations(root):
    for folder, allowed in ALLOWED.items():
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in sorted(files):
                if not name.endswith((".h", ".cc")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = m.group(1)
                        if target != folder and target in ALLOWED and target not in allowed:
                            yield "%s:%d: %s may not include %s (%s)" % (
                                os.path.relpath(path, root), number, folder, target, line.strip())


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    found = list(violations(root))
    for v in found:
        print(v)
    if found:
        print("check-layering: %d include(s) against the module order" % len(found))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
