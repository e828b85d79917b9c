"""One rank's link to the parapilot agent: the bus connection, the job's announcement on every
connection, and the rank's side of the switch protocol's messages. Framework-free (no torch, no
TensorFlow): every session (DDP, FSDP2, pipeline, TensorFlow) talks to the agent through it.

Contract:
* AgentLink(rank, job_info=..., check=..., stage=..., say=...) reads the agent's address
  (argument, else env PARAPILOT_AGENT; empty: no agent) and, when there is one, the bus secret
  (secret_file, else env PARAPILOT_SECRET_FILE, else the variable named by secret_env); a missing
  secret raises SecretError naming the agent. start() connects in the background; the client
  reconnects after an outage until close().
* On every connection job_info(max_frame_bytes) is sent first (the agent learns the job from it),
  then a line "connected to the agent at ADDR" (with how long the outage lasted, after one).
* Plans: `book` is the rank's PlanBook (plans.py) with the job's check(prepare) -> reason ("" to
  accept) and stage(prepare) -> staged config; they run on the client's I/O thread. A lost
  connection drops the plans the agent had not committed; PlanAbort and Shutdown are logged.
* Everything the link says goes to say(level, text), the bus client's own lines at "debug"
  (errors stay errors).
* announcement(...) builds the JobInfo a session announces (its layers truncated to one frame);
  summary_line(...) is every session's one-line summary at close().
Thread-safety: send() and the properties may be called from any thread; start() and close()
from the owner's.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Sequence

from . import wire
from .auth import SecretError, load_secret
from .client import Client
from .plans import PlanBook

Say = Callable[[str, str], None]  # (level, text)


def announcement(rank: int, world_size: int, global_batch: int, capabilities: int,
                 framework: str, layers: Sequence[wire.LayerInfo],
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> wire.JobInfo:
    """The JobInfo a rank announces: `framework` cut to the wire's name limit, and as many of
    `layers` (at most wire.MAX_LAYERS) as fit in one frame of max_frame_bytes (the list is
    informational: a truncated list is still valid)."""
    m = wire.JobInfo(rank, world_size, global_batch, capabilities,
                     framework.encode("utf-8")[:wire.MAX_NAME_BYTES].decode("utf-8", "ignore"),
                     [])
    room = (max_frame_bytes - wire.FRAME_HEADER_BYTES - len(wire.encode_payload(m))) // 16
    m.layers = list(layers[:max(0, room)])
    return m


def summary_line(steps: int, median_ms: float, applied: List[int], refused: int, tail: str,
                 agent: str) -> str:
    """A session's summary at close(): steps, median step, plans applied (the first and last
    three when more than 8), plans refused, what the kind of job adds (`tail`), the agent."""
    plans = (f"{applied}" if len(applied) <= 8 else
             f"[{', '.join(map(str, applied[:3]))}, ..., {', '.join(map(str, applied[-3:]))}] "
             f"({len(applied)} plans)")
    return (f"{steps} steps, median step {median_ms:.1f} ms, plans applied {plans}, refused "
            f"{refused}{', ' + tail if tail else ''}, agent: {agent}")


class AgentLink:
    """The rank's connection to `parapilot deploy`. See the module docstring."""

    def __init__(self, rank: int, *, job_info: Callable[[int], wire.JobInfo],
                 check: Callable[[wire.PlanPrepare], str],
                 stage: Callable[[wire.PlanPrepare], object], say: Say,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET", client_options: Optional[dict] = None):
        self.rank = rank
        self._job_info = job_info
        self._say = say
        self.book = PlanBook(rank, self.send, check=check, stage=stage)
        self.address = agent if agent is not None else os.environ.get("PARAPILOT_AGENT", "")
        self._configured = agent is not None
        self.state = "never connected"  # then "connected" / "lost"
        self._outage_since: Optional[float] = None  # monotonic time the current outage began
        self.client: Optional[Client] = None
        if not self.address:
            return
        try:
            secret = load_secret(secret_file, secret_env)
        except SecretError as e:
            raise SecretError(f"the agent at {self.address} needs the bus secret: {e}") from None
        opts = dict(client_options or {})
        user_connect = opts.pop("on_connect", None)
        user_disconnect = opts.pop("on_disconnect", None)
        opts.pop("autostart", None)
        opts.setdefault("logger", self._client_log)

        def on_connect(peer_id: int) -> None:
            self._on_connect(peer_id)
            if user_connect is not None:
                user_connect(peer_id)

        def on_disconnect(why: str) -> None:
            self._on_disconnect(why)
            if user_disconnect is not None:
                user_disconnect(why)
        self.client = Client(self.address, secret, name=f"worker-{rank}", rank=rank,
                             on_message=self._on_message, on_connect=on_connect,
                             on_disconnect=on_disconnect, autostart=False, **opts)

    def where(self) -> str:
        """Where the agent is, for the start line: "agent at ADDR" or why there is none."""
        if self.address:
            return f"agent at {self.address}"
        if self._configured:
            return 'no agent configured (agent="")'
        return "no agent configured (PARAPILOT_AGENT unset)"

    def describe(self) -> str:
        """The link's state for the summary line."""
        return self.state if self.address else "never connected (no agent configured)"

    def start(self) -> None:
        """Starts connecting (in the background); nothing without an agent."""
        if self.client is not None:
            self.client.start()

    def send(self, m: wire.Message) -> bool:
        """Queues m for the agent; False without a connection to queue on (or an invalid m)."""
        client = self.client
        return client.send(m) if client is not None else False

    def close(self, flush_timeout: float = 2.0) -> None:
        """Sends what is queued (up to flush_timeout s) and disconnects. Idempotent."""
        if self.client is not None:
            self.client.flush(flush_timeout)
            self.client.stop()
            self.client = None

    # ---- the client's I/O thread ----

    def _on_connect(self, peer_id: int) -> None:
        client = self.client
        if client is not None and not client.send(self._job_info(client.max_frame_bytes)):
            self._say("warn", "could not send the JobInfo (invalid for the wire format)")
        if self._outage_since is not None and self.state != "never connected":
            again = f" again after {time.monotonic() - self._outage_since:.1f} s without it"
        else:
            again = ""
        self.state = "connected"
        self._outage_since = None
        self._say("info", f"connected to the agent at {self.address}{again}")

    def _on_disconnect(self, why: str) -> None:
        """After each lost connection or failed attempt: one warning per outage."""
        self.book.drop_uncommitted(f"agent lost ({why})")
        if self.state == "connected":
            self.state = "lost"
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._say("warn", f"no agent at {self.address} ({why}); training continues on "
                              "the current plan, retrying in the background")

    def _on_message(self, m: wire.Message) -> None:
        if type(m) is wire.PlanAbort and m.plan_id == 0:
            # Not a plan: the agent says it will send this job no plan, and why.
            self._say("warn", f"the agent will send no plans: {m.reason or 'no reason given'}")
            return
        if type(m) is wire.PlanAbort:
            p = self.book.get(m.plan_id)
            if p is not None and p.committed:
                self._say("info", f"plan {m.plan_id}: abort ignored, it is already committed "
                                  f"({m.reason or 'no reason given'})")
            else:
                self._say("info", f"plan {m.plan_id} aborted by the agent: "
                                  f"{m.reason or 'no reason given'}")
        elif type(m) is wire.Shutdown:
            self._say("info", f"the agent asked the job to stop: {m.reason or 'no reason given'}")
        self.book.on_message(m)

    def _client_log(self, level: str, line: str) -> None:
        """The bus client's lines: its connects and disconnects are debug detail (the link
        reports them itself), its errors stay errors."""
        self._say("debug" if level in ("debug", "info", "warn") else level, line)
