"""The boundary agreement: at a step boundary, which committed plan every rank switches to, and
whether the job stops. Framework-free: the framework supplies the two reductions over its ranks.

The rule (plans.py states it for the book): the agreement for the boundary before step t is
started at the boundary before step t - 1 with [the newest plan committed on this rank for a step
<= t, 1 if the agent asked this rank to stop] and reduced with MAX over the ranks; it is collected
at the boundary before t (started a step ahead, it has long finished in the common case). When
the agreed plan P is newer than the running one, a second reduction (MIN over the ranks of "this
rank holds P staged") decides: every rank applies P, or every rank drops it and stays.

Contract:
* Boundary(book, start_max, reduce_min): start_max(values) starts the MAX reduction of a list of
  non-negative ints over every rank and returns a callable that waits for and returns the reduced
  list; reduce_min(value) reduces one int with MIN and returns it. Both raise what the framework
  raises when a peer fails (the session turns that into PeerLost).
* at(next_step, running_plan, extra=...) collects the pending agreement (if any), decides, and
  starts the next one; every rank calls it at every boundary, in the same order. It returns an
  Outcome: `apply` (the StagedPlan every rank switches to now; the book has acknowledged it),
  `missed` (a plan id every rank dropped because some rank did not hold it), `stop` (some rank
  was asked to stop), `extra` (the MAX over the ranks of the `extra` values each passed at the
  previous boundary, [] at the first: a job's own agreements ride on the same reduction; every
  rank passes as many at every boundary).
* finish() waits for a pending agreement (every rank started it) so that the job can leave.
Thread-safety: the training thread's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from .plans import PlanBook, StagedPlan

MAX_PLAN_ID = 2**63 - 1


@dataclass
class Outcome:
    apply: Optional[StagedPlan] = None
    apply_id: int = 0
    missed: int = 0
    stop: bool = False
    extra: List[int] = field(default_factory=list)


class Boundary:
    """The agreement at each step boundary. See the module docstring."""

    def __init__(self, book: PlanBook, start_max: Callable[[List[int]], Callable[[], List[int]]],
                 reduce_min: Callable[[int], int]):
        self._book = book
        self._start_max = start_max
        self._reduce_min = reduce_min
        self._pending: Optional[Callable[[], List[int]]] = None

    def at(self, next_step: int, running_plan: int, detail: str = "",
           extra: Sequence[int] = ()) -> Outcome:
        """The boundary before next_step while running_plan runs. `detail` names this rank and
        what it runs, for the agent's log of a missed plan; `extra`: non-negative ints agreed
        with MAX at the next boundary (Outcome.extra)."""
        out = Outcome()
        if self._pending is not None:
            agreed, stop, *out.extra = self._pending()
            self._pending = None
            out.stop = bool(stop)
            if agreed > running_plan:
                held = self._reduce_min(1 if self._book.holds(agreed) else 0)
                staged = self._book.applied(agreed) if held else None
                if staged is None:
                    out.missed = agreed
                    self._book.missed(agreed, f"{detail}plan {agreed} was committed but not "
                                      f"staged on every rank; staying on plan {running_plan}")
                else:
                    out.apply, out.apply_id = staged, agreed
                    running_plan = agreed
        candidate = self._book.committed_at(next_step + 1, running_plan)
        stop = 1 if self._book.stop_reason is not None else 0
        self._pending = self._start_max([min(candidate, MAX_PLAN_ID), stop, *extra])
        return out

    def abandon(self) -> None:
        """Forgets a pending agreement without waiting (its group is broken)."""
        self._pending = None

    def finish(self) -> None:
        """Waits for the pending agreement, if any (every rank started it)."""
        if self._pending is not None:
            self._pending()
            self._pending = None

    @property
    def pending(self) -> bool:
        return self._pending is not None
