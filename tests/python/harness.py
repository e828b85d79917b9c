"""Helpers shared by the Python client tests: the scripted C++ agent, secrets, free ports."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "python"))

SECRET = b"parapilot-test-secret-0123456789"


def scripted_agent_path():
    path = os.environ.get("PARAPILOT_SCRIPTED_AGENT")
    if path and os.path.exists(path):
        return path
    for build in ("build-py", "build"):
        cand = os.path.join(ROOT, build, "tests", "python", "scripted_agent")
        if os.path.exists(cand):
            return cand
    return None


def require_agent(test):
    if scripted_agent_path() is None:
        raise unittest.SkipTest("scripted_agent is not built (cmake --build ... --target scripted_agent)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SecretFile:
    """A temporary secret file (removed with the object)."""

    def __init__(self, secret=SECRET):
        self.dir = tempfile.mkdtemp(prefix="parapilot-test-")
        self.path = os.path.join(self.dir, "secret")
        with open(self.path, "wb") as f:
            f.write(secret + b"\n")
        os.chmod(self.path, 0o600)

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class ScriptedAgent:
    """Runs scripted_agent; events() yields its JSON lines, command() writes one stdin line."""

    def __init__(self, secret_path, port=0, heartbeat_ms=200, wrap=()):
        """wrap: an argv prefix (e.g. netns_hosts.Hosts.exec_argv(i): run it on a test host)."""
        exe = scripted_agent_path()
        self.proc = subprocess.Popen(
            list(wrap) + [exe, "--secret-file", secret_path, "--port", str(port), "--heartbeat-ms",
             str(heartbeat_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            bufsize=1)
        self.log = []
        self._taken = set()
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ev = self.wait_for(lambda e: e["event"] == "listening", timeout=10)
        self.port = ev["port"]
        self.address = f"127.0.0.1:{self.port}"

    def _read(self):
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                ev = {"event": "unparsable", "line": line}
            with self._cond:
                self.log.append(ev)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def command(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.wait_for(lambda e: e["event"] in ("sent", "error"), timeout=10)

    def wait_for(self, pred, timeout=10.0):
        """The oldest event not yet taken by a wait_for that matches pred (events may arrive in
        any order relative to the commands)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for i, ev in enumerate(self.log):
                    if i not in self._taken and pred(ev):
                        self._taken.add(i)
                        return ev
                left = deadline - time.monotonic()
                if self._eof:
                    raise AssertionError(f"agent exited; last events: {self.log[-5:]}")
                if left <= 0:
                    raise AssertionError(f"timed out waiting for an agent event; last: {self.log[-5:]}")
                self._cond.wait(left)

    def events_of(self, kind):
        with self._cond:
            return [e for e in self.log if e["event"] == kind]

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            try:
                f.close()
            except (OSError, ValueError):
                pass


def launch(world, cfg, env_extra=None, timeout=60, worker="ddp_worker.py", wrap=None,
           master_addr="127.0.0.1"):
    """Runs `worker` (a script beside this file: ddp_worker.py, fsdp_worker.py) on `world` local
    processes with torchrun's environment variables, its JSON config in argv[1]; returns a Job
    whose wait() gives the per-rank results (raises with the workers' stderr on failure or
    timeout). wrap(rank), when given, is an argv prefix for that rank's process (e.g.
    netns_hosts.Hosts.exec_argv: each rank on its own host, rank 0's at master_addr)."""
    out_dir = tempfile.mkdtemp(prefix="parapilot-ddp-")
    cfg = dict(cfg, out=os.path.join(out_dir, "result"))
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
                    "PYTHONPATH": os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": "1"})
        env.update(env_extra or {})
        prefix = list(wrap(rank)) if wrap is not None else []
        procs.append(subprocess.Popen(prefix + [sys.executable, os.path.join(HERE, worker),
                                       json.dumps(cfg)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return Job(procs, out_dir, world, timeout)


class Job:
    def __init__(self, procs, out_dir, world, timeout):
        self.procs, self.out_dir, self.world = procs, out_dir, world
        self.deadline = time.monotonic() + timeout

    def running(self):
        return any(p.poll() is None for p in self.procs)

    def wait(self):
        errors = []
        for rank, p in enumerate(self.procs):
            try:
                _, err = p.communicate(timeout=max(1, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    if q.poll() is None:
                        q.kill()
                _, err = p.communicate(timeout=10)
                errors.append(f"rank {rank} timed out:\n{err[-3000:]}")
                continue
            if p.returncode != 0:
                errors.append(f"rank {rank} exited {p.returncode}:\n{err[-3000:]}")
        if errors:
            raise AssertionError("\n".join(errors))
        results = []
        for rank in range(self.world):
            with open(os.path.join(self.out_dir, f"result.{rank}.json")) as f:
                results.append(json.load(f))
        shutil.rmtree(self.out_dir, ignore_errors=True)
        return results

    def outcomes(self):
        """Waits (up to the job's deadline) for every rank, whatever its exit: per rank
        (returncode, result or None, stderr); returncode None for a rank killed here at the
        deadline."""
        out = []
        for rank, p in enumerate(self.procs):
            code = None
            try:
                _, err = p.communicate(timeout=max(1, self.deadline - time.monotonic()))
                code = p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate(timeout=10)
            path = os.path.join(self.out_dir, f"result.{rank}.json")
            result = None
            if os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
            out.append((code, result, err))
        shutil.rmtree(self.out_dir, ignore_errors=True)
        return out

    def kill_rank(self, rank):
        self.procs[rank].kill()

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
