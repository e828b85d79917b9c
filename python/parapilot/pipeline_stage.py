"""One rank's pipeline stage: its blocks, its optimizer, torch's schedule over them, the step's
timing, and the switch to another split (torch.distributed.pipelining, torch >= 2.4).

StageRunner(blocks, loss_fn, optimizer_factory, ...) takes the model as an ordered list of
blocks (every rank passes the same list, built with the same seed); rank s runs stage s of
`split` (pipeline_split) and keeps only its own blocks: the others are freed to the meta device.
Its stage is a PipelineStage over nn.Sequential(the rank's blocks), its schedule ScheduleGPipe or
Schedule1F1B with `micro_batches` micro-batches and the loss on the last stage; its optimizer is
optimizer_factory(the rank's parameters), called again at every switch with the new parameters
(so it must be a pure function of them: hyper-parameters changed later, e.g. by an LR scheduler,
are not carried).

step(inputs, targets) runs one training step: zero_grad, the schedule (stage 0 feeds `inputs`,
the last stage computes the loss against `targets`; torch divides the gradients by the number
of micro-batches), the optimizer step. It returns the mean of the micro-batches' losses on the
last stage, None elsewhere. `timing` then holds the step's StepTiming.

switch(new_split) moves the blocks whose stage changes (parameters, buffers and optimizer state,
pipeline_move.exchange) and rebuilds the stage, the schedule and the optimizer; every rank calls
it at the same step boundary. switch(new_split, staged=...) takes the blocks this rank gains as
already installed ahead of the boundary (pipeline_stream.py) and moves nothing.
`after_backward()`, when set, is called in every step once the schedule finished (the
gradients are complete) and before the optimizer steps. block_states() / load(states) read and write the held blocks' state
(pipeline_state), for checkpoints.

Errors: ValueError subclasses naming the bad argument (a split, a schedule, a batch that does not
divide into the micro-batches); failures of the process group propagate from torch.
Thread-safety: one training thread.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import pipeline_move, pipeline_split, pipeline_state

__all__ = ["SCHEDULES", "PipelineError", "StepTiming", "StageRunner"]

SCHEDULES = ("gpipe", "1f1b")


class PipelineError(ValueError):
    """A pipeline job that cannot be built as asked; the message says why."""


@dataclass
class StepTiming:
    """One step on one stage (ms). compute = forward + backward (+ the loss) of its chunks;
    p2p = the rest of the schedule's wall time: blocked in its sends and receives."""
    schedule_ms: float = 0.0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    p2p_ms: float = 0.0
    p2p_bytes: int = 0
    p2p_calls: int = 0
    block_ms: Dict[int, float] = field(default_factory=dict)

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms + self.optimizer_ms


class _Stopwatch:
    """Accumulates ms per key between start(key) and stop(key) (nested keys allowed)."""

    def __init__(self):
        self.ms: Dict[object, float] = {}
        self._t0: Dict[object, int] = {}

    def start(self, key) -> None:
        self._t0[key] = time.perf_counter_ns()

    def stop(self, key) -> None:
        t0 = self._t0.pop(key, None)
        if t0 is not None:
            self.ms[key] = self.ms.get(key, 0.0) + (time.perf_counter_ns() - t0) / 1e6


class StageRunner:
    """One rank's stage of a pipeline over Gloo/CPU (or the device given). See the module
    docstring."""

    def __init__(self, blocks: Sequence[torch.nn.Module], loss_fn: Callable,
                 optimizer_factory: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer],
                 *, rank: int, n_stages: int, micro_batches: int, schedule: str = "gpipe",
                 split: Optional[Sequence[int]] = None, group=None,
                 move_group=None, device: Optional[torch.device] = None):
        from torch.distributed import pipelining  # noqa: F401 - torch >= 2.4, else ImportError
        if schedule not in SCHEDULES:
            raise PipelineError(f"schedule '{schedule}': one of {', '.join(SCHEDULES)}")
        if micro_batches < 1:
            raise PipelineError(f"micro_batches {micro_batches}: at least 1")
        if schedule == "1f1b" and micro_batches < n_stages:
            raise PipelineError(f"1f1b with {micro_batches} micro-batches over {n_stages} stages: "
                                "torch's Schedule1F1B needs at least one per stage")
        self.blocks = list(blocks)
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory
        self.rank = rank
        self.n_stages = n_stages
        self.micro_batches = micro_batches
        self.schedule_name = schedule
        self.group = group
        self.move_group = move_group
        self.device = device or torch.device("cpu")
        try:
            self.split = pipeline_split.check_split(
                split if split is not None else
                pipeline_split.even_split(len(self.blocks), n_stages), len(self.blocks), n_stages)
        except pipeline_split.SplitError as e:
            raise PipelineError(str(e)) from None
        self.timing = StepTiming()
        self.after_backward: Optional[Callable[[], None]] = None
        self._clock = _Stopwatch()
        self._hooks: list = []
        for i in range(len(self.blocks)):
            if i not in self.held:
                pipeline_state.free_block(self.blocks[i])
        self.optimizer = optimizer_factory(self._params())
        self.stage = None  # built at the first step, from the input's shape
        self._example = None
        self._shapes_for, self._shapes = None, []  # _activation's cache

    # ---- what this rank holds ----

    @property
    def held(self) -> range:
        return pipeline_split.blocks_of(self.split, self.rank)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.n_stages - 1

    def _params(self) -> List[torch.nn.Parameter]:
        return [p for i in self.held for p in self.blocks[i].parameters()]

    # ---- the stage and its schedule ----

    def _build(self, example: torch.Tensor) -> None:
        """The stage over the held blocks and its schedule; `example` is one micro-batch of the
        pipeline's input (its shape and dtype size the stage's buffers: torch's static mode)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i in self.held:
            self._time_block(i, self.blocks[i])
        self.module = torch.nn.Sequential(*[self.blocks[i] for i in self.held])
        stage_in = self._activation(self.held.start, example)
        stage_out = self._activation(self.held.stop, example)
        self._io_bytes = (_nbytes(stage_in), _nbytes(stage_out))  # per micro-batch
        self.stage = PipelineStage(self.module, self.rank, self.n_stages, self.device,
                                   input_args=_empty_like(stage_in, self.device,
                                                          grad=not self.is_first),
                                   output_args=_empty_like(stage_out, self.device, grad=True),
                                   input_grads=(None if self.is_first else
                                                _empty_like(stage_in, self.device)),
                                   output_grads=(None if self.is_last else
                                                 _empty_like(stage_out, self.device)),
                                   group=self.group)
        clock = self._clock
        fwd, bwd = self.stage.forward_one_chunk, self.stage.backward_one_chunk

        def forward_one_chunk(*args, **kwargs):
            clock.start("fwd")
            try:
                return fwd(*args, **kwargs)
            finally:
                clock.stop("fwd")

        def backward_one_chunk(*args, **kwargs):
            clock.start("bwd")
            try:
                return bwd(*args, **kwargs)
            finally:
                clock.stop("bwd")
        self.stage.forward_one_chunk = forward_one_chunk
        self.stage.backward_one_chunk = backward_one_chunk
        loss_fn = self.loss_fn

        def timed_loss(output, target):
            clock.start("loss")
            try:
                return loss_fn(output, target)
            finally:
                clock.stop("loss")
        cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
        # Every stage passes the loss: torch runs the backward only when the schedule has one.
        self.schedule = cls(self.stage, n_microbatches=self.micro_batches, loss_fn=timed_loss)
        self._example = example

    def _activation(self, n: int, example: torch.Tensor):
        """What the first n blocks make of `example` (meta tensors: shapes only), cached for the
        input's shape."""
        key = (tuple(example.shape), example.dtype)
        if self._shapes_for != key:
            self._shapes_for, self._shapes = key, [example]
        while len(self._shapes) <= n:
            i = len(self._shapes) - 1
            self._shapes.append(_meta_forward([self.blocks[i]], self._shapes[-1]))
        return self._shapes[n]

    def _time_block(self, index: int, block: torch.nn.Module) -> None:
        """Forward and backward time of one block (module hooks). Block 0 has no backward hooks:
        its input needs no gradient, so torch would fire them before its backward; its backward
        is what stage 0's backward leaves to it (step())."""
        clock = self._clock
        self._hooks += [
            block.register_forward_pre_hook(lambda m, a: clock.start(("f", index))),
            block.register_forward_hook(lambda m, a, o: clock.stop(("f", index))),
        ]
        if index > 0:
            self._hooks += [
                block.register_full_backward_pre_hook(lambda m, g: clock.start(("b", index))),
                block.register_full_backward_hook(lambda m, gi, go: clock.stop(("b", index))),
            ]

    # ---- one training step ----

    def step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor]
             ) -> Optional[torch.Tensor]:
        """One training step (see the module docstring)."""
        clock = self._clock
        clock.ms = {}
        self.optimizer.zero_grad(set_to_none=True)
        losses: List[torch.Tensor] = [] if self.is_last else None
        if inputs is None or inputs.shape[0] % self.micro_batches:
            raise PipelineError(f"inputs of {None if inputs is None else inputs.shape[0]} "
                                f"samples do not divide into {self.micro_batches} "
                                "micro-batches (every stage needs the step's inputs)")
        micro = inputs.shape[0] // self.micro_batches
        ex = self._example
        if self.stage is None or ex is None or ex.dtype != inputs.dtype or \
                ex.shape != (micro,) + tuple(inputs.shape[1:]):
            self._build(inputs[:micro].to("meta"))
        args = [inputs.to(self.device)] if self.is_first else []
        kwargs = {}
        if self.is_last:
            if targets is None:
                raise PipelineError("the last stage needs the step's targets")
            kwargs = {"target": targets.to(self.device), "losses": losses}
        t0 = time.perf_counter_ns()
        self.schedule.step(*args, **kwargs)
        if self.after_backward is not None:
            self.after_backward()
        t1 = time.perf_counter_ns()
        self.optimizer.step()
        t2 = time.perf_counter_ns()
        ms = clock.ms
        t = StepTiming(schedule_ms=(t1 - t0) / 1e6, optimizer_ms=(t2 - t1) / 1e6)
        t.forward_ms = ms.get("fwd", 0.0)
        t.backward_ms = ms.get("bwd", 0.0)
        t.forward_ms += ms.get("loss", 0.0)  # torch runs the loss outside forward_one_chunk
        t.p2p_ms = max(0.0, t.schedule_ms - t.forward_ms - t.backward_ms)
        t.block_ms = {i: ms.get(("f", i), 0.0) + ms.get(("b", i), 0.0) for i in self.held}
        if self.is_first:
            rest = sum(ms.get(("b", i), 0.0) for i in self.held if i > 0)
            t.block_ms[0] += max(0.0, ms.get("bwd", 0.0) - rest)
        t.p2p_bytes, t.p2p_calls = self._p2p_volume()
        self.timing = t
        if self.is_last:
            return torch.stack([l.detach() for l in losses]).mean()
        return None

    def _p2p_volume(self):
        """Bytes and calls of this stage's sends and receives in a step: each micro-batch's
        activation received (not stage 0) and its gradient sent back, its output sent (not the
        last stage) and that output's gradient received."""
        nbytes, calls = 0, 0
        inp, out = self._io_bytes
        if not self.is_first and inp:
            nbytes += 2 * inp * self.micro_batches
            calls += 2 * self.micro_batches
        if not self.is_last and out:
            nbytes += 2 * out * self.micro_batches
            calls += 2 * self.micro_batches
        return nbytes, calls

    # ---- switching ----

    def switch(self, new_split: Sequence[int],
               staged: Optional[Dict[int, List[dict]]] = None) -> int:
        """Moves to `new_split` (every rank at the same boundary); returns the bytes sent.
        `staged`: the blocks this rank gains, installed already, with their parameters'
        optimizer state (pipeline_stream.BlockStream.finish); nothing is sent then."""
        new = pipeline_split.check_split(new_split, len(self.blocks), self.n_stages)
        moves = pipeline_split.moves(self.split, new)
        received: Dict[int, dict] = {}
        sent = 0
        if staged is None:
            outgoing: Dict[int, Dict[int, dict]] = {}
            incoming = sorted({m.src for m in moves if m.dst == self.rank})
            for m in moves:
                if m.src == self.rank:
                    outgoing.setdefault(m.dst, {})[m.block] = pipeline_state.collect(
                        self.blocks[m.block], self.optimizer)
            received, sent = pipeline_move.exchange(outgoing, incoming, self.move_group)
        # Blocks that stay keep their tensors and their optimizer state objects as they are.
        keep = [i for i in self.held if i in pipeline_split.blocks_of(new, self.rank)]
        kept_optim = {i: [self.optimizer.state.get(p, {}) for p in self.blocks[i].parameters()]
                      for i in keep}
        for m in moves:
            if m.src == self.rank:
                pipeline_state.free_block(self.blocks[m.block])
        self.split = new
        if staged is not None:
            kept_optim.update(staged)
        self._install(received, kept_optim)
        return sent

    def _install(self, states: Dict[int, dict],
                 kept_optim: Optional[Dict[int, List[dict]]] = None) -> None:
        """Writes `states` into the held blocks that are not kept (`kept_optim`: the blocks whose
        tensors are in place already, with their parameters' optimizer state) and rebuilds the
        optimizer, the stage and the schedule."""
        kept_optim = kept_optim or {}
        missing = [i for i in self.held if i not in states and i not in kept_optim]
        if missing:
            raise pipeline_state.BlockStateError(f"no state for blocks {missing} of stage "
                                                 f"{self.rank}")
        optim = dict(kept_optim)
        for i in self.held:
            if i not in kept_optim:
                optim[i] = pipeline_state.install(self.blocks[i], states[i], i, self.device)
        self.optimizer = self.optimizer_factory(self._params())
        for i in self.held:
            pipeline_state.attach_optim_state(self.optimizer, list(self.blocks[i].parameters()),
                                              optim[i])
        self.stage = None
        if self._example is not None:
            self._build(self._example)  # the shapes of the last step's input

    # ---- checkpoints ----

    def block_states(self) -> Dict[int, dict]:
        """The held blocks' state (pipeline_state.collect)."""
        return {i: pipeline_state.collect(self.blocks[i], self.optimizer) for i in self.held}

    def load(self, states: Dict[int, dict]) -> None:
        """Installs the held blocks' state from `states` (may hold other blocks too)."""
        self._install({i: states[i] for i in self.held if i in states})

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _meta_forward(blocks: Sequence[torch.nn.Module], x):
    """What `blocks` make of `x` (a meta tensor): shapes only. On the meta device when the block
    runs there; a block that makes tensors of its own on the CPU (torch.ones(...) without
    device=) runs instead on zeros, as a copy materialised on the CPU, once per input shape."""
    from torch.func import functional_call
    with torch.no_grad():
        for b in blocks:
            state = {n: torch.empty_like(t, device="meta")
                     for n, t in list(b.named_parameters()) + list(b.named_buffers())}
            try:
                x = functional_call(b, state, (x,))
            except RuntimeError:
                probe = copy.deepcopy(b).to_empty(device="cpu")
                x = _to_meta(probe(_zeros_like(x)))
    return x


def _zeros_like(x):
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype)
    return tuple(_zeros_like(v) for v in x)


def _to_meta(x):
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    return tuple(_to_meta(v) for v in x)


def _empty_like(x, device, grad: bool = False):
    """Example tensors for torch's static stage metadata; `grad`: floating tensors require
    grad (torch reads from the examples whether activations carry a gradient)."""
    if isinstance(x, torch.Tensor):
        t = torch.empty(x.shape, dtype=x.dtype, device=device)
        return t.requires_grad_(grad and t.is_floating_point())
    return tuple(_empty_like(v, device, grad) for v in x)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 0
