"""scripts/run-results.py as a module, for the report envelope every measurement file shares
(its envelope() and finish()): the live benchmarks call run_results() instead of each loading
the script themselves. Import it after setting sys.dont_write_bytecode (no caches in the tree).
"""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_results():
    """scripts/run-results.py, loaded as a module."""
    spec = importlib.util.spec_from_file_location(
        "run_results", os.path.join(ROOT, "scripts", "run-results.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
