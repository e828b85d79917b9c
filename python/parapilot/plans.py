"""The rank's side of the switch protocol (docs/architecture.md, "The switch protocol").

The same state machine as the C++ ranks' transport::PlanBook (transport/plan_book.h), method for
method; both replay the transcripts in tests/data/switch/ (tests/python/test_plans.py).

A plan is staging (stage()), staged (ready(): PlanReady{ok}), committed (PlanCommit), then
applied at a boundary (Ack) or dropped: refused (PlanReady{ok=false}), aborted before its commit,
the agent lost before its commit, or missed at the boundary.

The commit rule, at the boundary before step s, in two agreements over the job's ranks (see
pytorch.Session): committed_at(s, running) reduced with MAX gives P, the newest plan committed on
some rank (0: none); then holds(P) reduced with AND. Every rank then calls applied(P) and
switches, or, when some rank does not hold P, every rank calls missed(P) and nobody switches. A
rank that staged P but was not reached by the commit yet switches with the others: the agent
commits only once every rank answered PlanReady{ok}.

A PlanCommit for a plan this rank does not hold and a PlanAbort for a committed plan are ignored;
PlanAbort with plan id 0 (no plan will come) carries only its reason (no_plans_reason).

Thread-safety: every method may be called from any thread (one lock); messages are sent with
the lock released. on_message runs on the bus client's I/O thread; the optional check and stage
callbacks run there too, outside the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from . import wire


@dataclass
class Deferred:
    """What a stage callback returns for a plan whose staging goes on after it returns (see
    PlanBook): `staged` is the job's state for the plan."""
    staged: Any


@dataclass
class StagedPlan:
    prepare: Optional[wire.PlanPrepare]
    staged: Any = None  # what the job staged
    ready: bool = False
    committed: bool = False
    switch_at_step: int = 0


class PlanBook:
    """Plans prepared and committed by the agent, until a boundary applies or drops them.

    send(msg) queues a message to the agent. With `check` and `stage` given, on_message handles
    a PlanPrepare itself: check(prepare) returns "" when this job can run the layout, else the
    reason (refuse); stage(prepare) returns the staged state (or raises: refuse), then ready.
    A stage callback that returns Deferred(staged) stages the plan without PlanReady: the job
    calls ready(plan_id) or refuse(plan_id, why) once its staging finishes (a pipeline job
    streams the state a plan moves first, pipeline_stream.py).
    Without them the caller stages: on_message returns the PlanPrepare and the caller calls
    stage(), ready() or refuse().
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
        self._no_plans_reason: Optional[str] = None
        self.events: List[str] = []  # what happened, for logs and tests

    # ---- messages from the agent ----

    def on_message(self, m: wire.Message) -> Optional[wire.PlanPrepare]:
        t = type(m)
        if t is wire.PlanPrepare:
            if m.plan_id == 0:
                return None
            if self._check is not None or self._stage is not None:
                self._prepare_inline(m)
            return m
        with self._lock:
            if t is wire.PlanCommit:
                p = self._plans.get(m.plan_id)
                if p is not None:
                    p.committed = True
                    p.switch_at_step = m.switch_at_step
                self.events.append(f"commit {m.plan_id} at {m.switch_at_step}"
                                   + ("" if p else " (unknown plan)"))
            elif t is wire.PlanAbort:
                if m.plan_id == 0:
                    self._no_plans_reason = m.reason
                else:
                    p = self._plans.get(m.plan_id)
                    if p is not None and not p.committed:
                        del self._plans[m.plan_id]
                self.events.append(f"abort {m.plan_id}: {m.reason}")
            elif t is wire.Shutdown:
                self._stop_reason = m.reason or "the agent asked the job to stop"
                self.events.append(f"shutdown: {m.reason}")
        return None

    def _prepare_inline(self, m: wire.PlanPrepare) -> None:
        try:
            why = self._check(m) if self._check else ""
            if why:
                self.refuse(m.plan_id, why)
                return
            staged = self._stage(m) if self._stage else None
        except Exception as e:  # noqa: BLE001 - any staging failure is a refusal
            self.refuse(m.plan_id, f"{type(e).__name__}: {e}")
            return
        if isinstance(staged, Deferred):
            self.stage(m.plan_id, staged.staged, m)
            return
        self.stage(m.plan_id, staged, m)
        self.ready(m.plan_id)

    # ---- the job's staging ----

    def stage(self, plan_id: int, staged: Any, prepare: Optional[wire.PlanPrepare] = None) -> None:
        """The job is staging plan_id into `staged`; until ready() the plan is not held."""
        with self._lock:
            self._plans[plan_id] = StagedPlan(prepare, staged)

    def ready(self, plan_id: int) -> None:
        """Staging of plan_id is complete: PlanReady{ok}. Ignored for a plan no longer staging."""
        with self._lock:
            p = self._plans.get(plan_id)
            if p is None or p.ready:
                return
            p.ready = True
            self.events.append(f"prepare {plan_id} -> ready")
        self._send(wire.PlanReady(plan_id, self.rank, True, ""))

    def refuse(self, plan_id: int, why: str) -> None:
        """This rank cannot run plan_id: PlanReady{ok=false, detail=why}; the plan is dropped."""
        with self._lock:
            self._plans.pop(plan_id, None)
            self.events.append(f"prepare {plan_id} -> {why}")
        self._send(wire.PlanReady(plan_id, self.rank, False, why[:wire.MAX_TEXT_BYTES]))

    def drop_uncommitted(self, why: str = "agent lost") -> None:
        """The agent was lost: forget plans it prepared but never committed (a restarted agent
        starts its own plans; committed ones stay, the ranks may be switching to them)."""
        with self._lock:
            for pid in [pid for pid, p in self._plans.items() if not p.committed]:
                del self._plans[pid]
                self.events.append(f"dropped {pid}: {why}")

    # ---- the boundary ----

    def committed_at(self, step: int, after_id: int) -> int:
        """Agreement 1: the newest plan id > after_id committed here with switch_at_step <= step
        (0: none)."""
        with self._lock:
            best = 0
            for pid, p in self._plans.items():
                if pid > after_id and p.committed and p.switch_at_step <= step and pid > best:
                    best = pid
            return best

    def holds(self, plan_id: int) -> bool:
        """Agreement 2: plan_id is staged here (committed or not)."""
        with self._lock:
            p = self._plans.get(plan_id)
            return p is not None and p.ready

    def get(self, plan_id: int) -> Optional[StagedPlan]:
        with self._lock:
            return self._plans.get(plan_id)

    def applied(self, plan_id: int) -> Optional[StagedPlan]:
        """Every rank holds plan_id: returns it, forgets it and every older plan, and acks. None
        when this rank does not hold it."""
        with self._lock:
            p = self._plans.get(plan_id)
            if p is None or not p.ready:
                return None
            for pid in [q for q in self._plans if q <= plan_id]:
                del self._plans[pid]
            self.events.append(f"applied {plan_id}")
        self._send(wire.Ack(wire.MessageType.PLAN_COMMIT, plan_id, self.rank))
        return p

    def missed(self, plan_id: int, detail: str) -> None:
        """Some rank does not hold plan_id: nobody switches. Drops it here and answers
        PlanReady{ok=false, detail} so that the agent ends the plan."""
        with self._lock:
            self._plans.pop(plan_id, None)
            self.events.append(f"missed {plan_id}: {detail}")
        self._send(wire.PlanReady(plan_id, self.rank, False, detail[:wire.MAX_TEXT_BYTES]))

    @property
    def stop_reason(self) -> Optional[str]:
        with self._lock:
            return self._stop_reason

    @property
    def no_plans_reason(self) -> Optional[str]:
        with self._lock:
            return self._no_plans_reason
