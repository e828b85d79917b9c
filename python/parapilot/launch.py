"""A minimal local launcher with torchrun's environment variables, for machines where torchrun
itself is unavailable or broken (Debian's torch 1.13 torchrun fails on Python 3.11):

    python3 -m parapilot.launch --nproc 2 train.py --steps 100

Starts `nproc` copies of `python3 train.py ...` with RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR (127.0.0.1) and MASTER_PORT (a free port unless --master-port);
with --tf-config, also TF_CONFIG naming the nproc processes as the workers of a
tf.distribute.MultiWorkerMirroredStrategy (127.0.0.1, free ports; the process's task index is
its RANK). If one exits with an error the others are stopped; the exit code is the first
failure's (0 when all succeed). --timeout stops everything after that many seconds (exit code 124).
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, avoid: int = 0) -> list:
    """n distinct free ports (all held open until each is known, so none repeats), not `avoid`."""
    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] == avoid:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m parapilot.launch")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--master-port", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=0)
    ap.add_argument("--tf-config", action="store_true",
                    help="set TF_CONFIG for a MultiWorkerMirroredStrategy of nproc workers")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("--nproc must be >= 1")
    port = a.master_port or free_port()
    workers = [f"127.0.0.1:{p}" for p in free_ports(a.nproc, avoid=port)] if a.tf_config else []
    procs = []
    for rank in range(a.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.nproc),
                   LOCAL_WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if workers:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                           "task": {"type": "worker", "index": rank}})
        procs.append(subprocess.Popen([sys.executable, a.script] + a.args, env=env))

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(143)))
    deadline = time.monotonic() + a.timeout if a.timeout > 0 else None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                stop_all()
                return failed[0] if failed[0] > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                print("parapilot.launch: timed out", file=sys.stderr)
                stop_all()
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        return 130


if __name__ == "__main__":
    sys.exit(main())
