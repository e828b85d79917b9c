"""Helpers shared by the Python client tests: the scripted C++ agent, secrets, free ports."""

import json
import os
import queue
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

    def __init__(self, secret_path, port=0, heartbeat_ms=200):
        exe = scripted_agent_path()
        self.proc = subprocess.Popen(
            [exe, "--secret-file", secret_path, "--port", str(port), "--heartbeat-ms",
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
