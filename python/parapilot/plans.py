"""The worker's side of the two-phase layout switch (docs/architecture.md, "The switch protocol").

PlanPrepare{plan_id, layout} -> the job's `check` says whether it can run the layout and its
`stage` builds what the layout needs (off the training thread) -> PlanReady{ok, detail} ->
PlanCommit{plan_id, switch_at_step} -> the training loop asks committed_at(step) at each step
boundary, the ranks agree (see pytorch.Session) and switch at the same step -> Ack{plan_commit}.
PlanAbort drops a staged plan that was not committed. Shutdown asks the job to stop.

Thread-safety: every method may be called from any thread (one lock). on_message runs on the bus
client's I/O thread; check and stage run there too, outside the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from . import wire


@dataclass
class StagedPlan:
    prepare: wire.PlanPrepare
    staged: Any = None  # what `stage` returned
    committed: bool = False
    switch_at_step: int = 0


class PlanBook:
    """Plans prepared and committed by the agent, until the training loop applies them.

    send(msg) queues a message to the agent. check(prepare) returns "" when this job can run
    the layout, else the reason. stage(prepare) returns the staged state (or raises).
    """

    def __init__(self, rank: int, send: Callable[[wire.Message], bool],
                 check: Optional[Callable[[wire.PlanPrepare], str]] = None,
                 stage: Optional[Callable[[wire.PlanPrepare], Any]] = None):
        self.rank = rank
        self._send = send
        self._check = check
        self._stage = stage
        self._lock = threading.Lock()
        self._plans: Dict[int, StagedPlan] = {}
        self._stop_reason: Optional[str] = None
        self.events: List[str] = []  # what happened, for logs and tests

    def on_message(self, m: wire.Message) -> None:
        t = type(m)
        if t is wire.PlanPrepare:
            self._on_prepare(m)
        elif t is wire.PlanCommit:
            with self._lock:
                p = self._plans.get(m.plan_id)
                if p is not None:
                    p.committed = True
                    p.switch_at_step = m.switch_at_step
                self.events.append(f"commit {m.plan_id} at {m.switch_at_step}"
                                   + ("" if p else " (unknown plan)"))
        elif t is wire.PlanAbort:
            with self._lock:
                p = self._plans.get(m.plan_id)
                if p is not None and not p.committed:
                    del self._plans[m.plan_id]
                self.events.append(f"abort {m.plan_id}: {m.reason}")
        elif t is wire.Shutdown:
            with self._lock:
                self._stop_reason = m.reason or "agent asked the job to stop"
                self.events.append(f"shutdown: {m.reason}")

    def _on_prepare(self, m: wire.PlanPrepare) -> None:
        ready = wire.PlanReady(m.plan_id, self.rank, True, "")
        try:
            why = self._check(m) if self._check else ""
            if why:
                ready.ok, ready.detail = False, why[:wire.MAX_TEXT_BYTES]
            else:
                staged = self._stage(m) if self._stage else None
                with self._lock:
                    self._plans[m.plan_id] = StagedPlan(m, staged)
        except Exception as e:  # noqa: BLE001 - any staging failure is a refusal
            ready.ok = False
            ready.detail = f"{type(e).__name__}: {e}"[:wire.MAX_TEXT_BYTES]
        with self._lock:
            self.events.append(f"prepare {m.plan_id} -> {'ready' if ready.ok else ready.detail}")
        self._send(ready)

    def committed_at(self, step: int, after_id: int) -> int:
        """The newest committed plan with switch_at_step <= step and id > after_id (0: none)."""
        with self._lock:
            best = 0
            for pid, p in self._plans.items():
                if pid > after_id and p.committed and p.switch_at_step <= step and pid > best:
                    best = pid
            return best

    def get(self, plan_id: int) -> Optional[StagedPlan]:
        with self._lock:
            return self._plans.get(plan_id)

    def applied(self, plan_id: int) -> None:
        """The job switched to plan_id: Ack it and forget older plans."""
        with self._lock:
            for pid in [p for p in self._plans if p < plan_id]:
                del self._plans[pid]
            self.events.append(f"applied {plan_id}")
        self._send(wire.Ack(wire.MessageType.PLAN_COMMIT, plan_id, self.rank))

    def missed(self, plan_id: int, detail: str) -> None:
        """The ranks could not all switch to plan_id: tell the agent (it ends the plan)."""
        with self._lock:
            self._plans.pop(plan_id, None)
            self.events.append(f"missed {plan_id}: {detail}")
        self._send(wire.PlanReady(plan_id, self.rank, False, detail[:wire.MAX_TEXT_BYTES]))

    def drop_uncommitted(self, why: str) -> None:
        """The agent was lost: forget plans it prepared but never committed (a restarted agent
        starts its own plans; committed ones stay, the ranks may be switching to them)."""
        with self._lock:
            for pid in [pid for pid, p in self._plans.items() if not p.committed]:
                del self._plans[pid]
                self.events.append(f"dropped {pid}: {why}")

    @property
    def stop_reason(self) -> Optional[str]:
        with self._lock:
            return self._stop_reason
