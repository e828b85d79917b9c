"""Streams the blocks a pipeline plan moves to their new ranks ahead of its boundary, so that the
switch itself only installs them (the double buffering of the C++ workers' layout switches,
env/live/layout_switch.h, for pipeline jobs).

A stream's life, every rank of the job taking part at the same boundaries:
  1. BlockStream(runner, plan_id, new_split, step, group, ready) at the boundary before `step`
     (every rank, after agreeing to stream the plan): each rank holding a block the plan moves
     sends its new rank a snapshot of it (parameters, buffers, optimizer state:
     pipeline_state.collect, as of the end of step - 1). A rank that takes blocks starts a
     receiver thread: it receives the snapshots, installs them into its own copies of those
     blocks (which it does not run; they were on the meta device) with a second instance of the
     job's optimizer (runner.optimizer_factory over their parameters), then calls ready(). A rank
     that takes nothing calls ready() at once.
  2. after_backward(t), in every step t from `step` on, after the schedule and before the
     optimizer steps: the holders send the step's gradients of the moved blocks; the receiver
     thread receives them and steps its optimizer on its copies, so they follow the holder's
     blocks step by step (the same elementwise update on the same inputs, bit for bit).
  3. finish(boundary) at the boundary the plan is applied: waits until the receiver applied every
     step before `boundary` and every send completed; returns {block: its optimizer state per
     parameter} for StageRunner.switch(..., staged=...). Or drop() (the plan was dropped, or
     another one applied): the same wait, then the copies go back to the meta device.
Both sides post one message per (source, destination) pair per step for the same steps (every
rank streams during the same steps: the start and the end are agreed at boundaries), so every
send has its receive and nothing is left pending. Messages are tagged with their step and kind.

Errors: a failed send or receive raises from after_backward / finish / drop what torch raised
(the session turns a failed collective into PeerLost). A snapshot that cannot be installed
(BlockStateError) is reported through refuse(why); the thread keeps receiving (and discards)
the gradients so that the senders' messages are still matched.
Thread-safety: the constructor, after_backward, finish and drop are the training thread's; the
receiver thread touches only the blocks this rank takes (not run here until the switch).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.distributed import distributed_c10d as c10d

from . import pipeline_split, pipeline_state

__all__ = ["BlockStream"]

_KINDS = 3  # tags: (step % 2**28) * 3 + kind
_SIZE, _SNAPSHOT, _GRADS = 0, 1, 2


def _tag(step: int, kind: int) -> int:
    return (step % (1 << 28)) * _KINDS + kind


def _params(blocks: Sequence[torch.nn.Module]) -> List[torch.nn.Parameter]:
    return [p for b in blocks for _, p in b.named_parameters()]


def _grad_bytes(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """The step's gradients of `params` as bytes: each gradient's raw bytes (zeros when it has
    none), then one byte per parameter (1: it has a gradient)."""
    parts, mask = [], []
    for p in params:
        n = p.numel() * p.element_size()
        if p.grad is None:
            parts.append(torch.zeros(n, dtype=torch.uint8))
            mask.append(0)
        else:
            parts.append(p.grad.detach().contiguous().view(-1).view(torch.uint8))
            mask.append(1)
    parts.append(torch.tensor(mask, dtype=torch.uint8))
    return torch.cat(parts)  # a copy: the optimizer may change the gradients afterwards


def _set_grads(params: Sequence[torch.nn.Parameter], data: torch.Tensor) -> None:
    """The inverse of _grad_bytes, into the parameters' .grad."""
    mask = data[len(data) - len(params):].tolist()
    off = 0
    for p, has in zip(params, mask):
        n = p.numel() * p.element_size()
        p.grad = data[off:off + n].clone().view(p.dtype).view(p.shape) if has else None
        off += n


class BlockStream:
    """One plan's moved blocks, streamed ahead of its boundary. See the module docstring.

    runner: the rank's StageRunner (its split is the one the plan moves from).
    group: a process group of the job's ranks kept for streams (ranks = the runner's ranks).
    ready(): this rank's part is staged. refuse(why): it cannot be.
    """

    def __init__(self, runner, plan_id: int, new_split: Sequence[int], step: int, group,
                 ready: Callable[[], None], refuse: Callable[[str], None]):
        self.plan_id = plan_id
        self.start_step = step
        self._runner = runner
        self._group = group
        rank = runner.rank
        moves = pipeline_split.moves(runner.split, new_split)
        self._out: Dict[int, List[int]] = {}  # destination -> blocks it takes from here
        self._in: Dict[int, List[int]] = {}  # source -> blocks this rank takes from it
        for m in moves:
            if m.src == rank:
                self._out.setdefault(m.dst, []).append(m.block)
            if m.dst == rank:
                self._in.setdefault(m.src, []).append(m.block)
        self._sends: List = []  # (work, tensor): kept until complete
        self.bytes_sent = 0
        blocks = runner.blocks
        for dst, ids in sorted(self._out.items()):
            payload = pipeline_state.to_bytes(
                {i: pipeline_state.collect(blocks[i], runner.optimizer) for i in ids})
            self._send(torch.tensor([payload.numel()], dtype=torch.int64), dst, _tag(step, _SIZE))
            self._send(payload, dst, _tag(step, _SNAPSHOT))
        # The receiver's side, shared with its thread under _cv.
        self._cv = threading.Condition()
        self._released = step  # steps [start, released) have had their gradients sent
        self._end: Optional[int] = None  # the boundary the stream ends at
        self._error: Optional[BaseException] = None
        self._optimizer = None
        self._thread = None
        if self._in:
            self._thread = threading.Thread(target=self._receive, args=(ready, refuse),
                                            name=f"parapilot-stream-{plan_id}", daemon=True)
            self._thread.start()
        else:
            ready()

    # ---- the training thread ----

    def after_backward(self, step: int) -> None:
        """Step `step`'s gradients are complete (before the optimizer steps): sends the moved
        blocks' gradients and lets the receiver take the step's."""
        self._reap()
        for dst, ids in sorted(self._out.items()):
            self._send(_grad_bytes(_params([self._runner.blocks[i] for i in ids])), dst,
                       _tag(step, _GRADS))
        with self._cv:
            self._released = step + 1
            self._cv.notify_all()

    def finish(self, boundary: int) -> Dict[int, List[dict]]:
        """At the boundary before `boundary`, where the plan is applied: {block: optimizer state
        per parameter} of the blocks this rank takes (their parameters are installed)."""
        self._stop(boundary)
        if self._error is not None:
            raise self._error
        staged = {}
        for ids in self._in.values():
            for i in ids:
                staged[i] = [dict(self._optimizer.state.get(p, {}))
                             for p in self._runner.blocks[i].parameters()]
        return staged

    def drop(self, boundary: int) -> None:
        """The plan will not be applied: ends the stream at the boundary before `boundary` and
        frees the copies."""
        self._stop(boundary)
        for ids in self._in.values():
            for i in ids:
                if i not in self._runner.held:
                    pipeline_state.free_block(self._runner.blocks[i])

    def _stop(self, boundary: int) -> None:
        with self._cv:
            self._end = boundary
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        self._sends.append((c10d.isend(t, self._global(dst), group=self._group, tag=tag), t))
        self.bytes_sent += t.numel() * t.element_size()

    def _reap(self) -> None:
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _global(self, r: int) -> int:
        return c10d.get_global_rank(self._group, r) if self._group is not None else r

    # ---- the receiver thread ----

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        c10d.irecv(t, self._global(src), group=self._group, tag=tag).wait()
        return t

    def _receive(self, ready: Callable[[], None], refuse: Callable[[str], None]) -> None:
        runner = self._runner
        try:
            states: Dict[int, dict] = {}
            for src in sorted(self._in):
                size = self._recv(torch.zeros(1, dtype=torch.int64), src,
                                  _tag(self.start_step, _SIZE))
                data = self._recv(torch.empty(int(size[0]), dtype=torch.uint8), src,
                                  _tag(self.start_step, _SNAPSHOT))
                states.update(pipeline_state.from_bytes(data))
            installed = True
            try:
                optim = {i: pipeline_state.install(runner.blocks[i], states[i], i, runner.device)
                         for ids in self._in.values() for i in ids}
                params = _params([runner.blocks[i] for i in sorted(optim)])
                self._optimizer = runner.optimizer_factory(params)
                for i in sorted(optim):
                    pipeline_state.attach_optim_state(
                        self._optimizer, list(runner.blocks[i].parameters()), optim[i])
            except (pipeline_state.BlockStateError, KeyError) as e:
                installed = False
                refuse(f"plan {self.plan_id}: the streamed blocks cannot be installed: {e}")
            if installed:
                ready()
            self._follow(installed)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread at the end
            self._error = e

    def _follow(self, apply: bool) -> None:
        """Receives every released step's gradients until the end; applies them when `apply`."""
        runner = self._runner
        by_src = {src: _params([runner.blocks[i] for i in ids])
                  for src, ids in sorted(self._in.items())}
        sizes = {src: sum(p.numel() * p.element_size() for p in ps) + len(ps)
                 for src, ps in by_src.items()}
        step = self.start_step
        while True:
            with self._cv:
                while self._released <= step and self._end is None:
                    self._cv.wait()
                if self._released <= step:
                    return  # ended at `step`: no rank sent its gradients
            for src, ps in by_src.items():
                data = self._recv(torch.empty(sizes[src], dtype=torch.uint8), src,
                                  _tag(step, _GRADS))
                if apply:
                    _set_grads(ps, data)
            if apply:
                self._optimizer.step()
                self._optimizer.zero_grad(set_to_none=True)
            step += 1
