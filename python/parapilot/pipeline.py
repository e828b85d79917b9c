"""Pipeline-parallel PyTorch jobs whose stage boundaries the parapilot agent moves while they
train (torch.distributed.pipelining, torch >= 2.4; docs/pytorch.md, "Pipeline jobs").

    import parapilot.pipeline as pp
    blocks = [Block() for _ in range(8)]             # every rank: the same list, the same seed
    session = pp.PipelineSession(
        blocks, loss_fn=F.cross_entropy,
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3),
        global_batch=64, micro_batches=8, schedule="1f1b")   # split: even unless given
    for x, y in batches:                             # every rank passes the whole batch
        loss = session.step(x, y)                    # the loss on the last stage, else None
        if session.should_stop: break
    session.close()

Contract:
* One rank per stage: rank s of the default process group (the whole job) runs stage s and
  holds the contiguous blocks of the split (pipeline_split); the blocks it does not hold are
  freed to the meta device. The stage is torch's PipelineStage over those blocks in order, the
  schedule ScheduleGPipe ("gpipe") or Schedule1F1B ("1f1b") with `micro_batches` micro-batches of
  global_batch / micro_batches samples each; the loss is loss_fn(output, target) per
  micro-batch, and torch divides the gradients by the number of micro-batches (the update is the
  mean loss's). The optimizer is optimizer_factory(the rank's parameters), made again with the
  new parameters at every switch (a pure function of them; LR schedules that change its
  param_groups are not carried).
* step(inputs, targets) runs one training step on every rank: zero_grad, the schedule, the
  optimizer step. Every rank passes the step's whole batch (stage 0 feeds the inputs, the last
  stage computes the loss against the targets, every stage sizes its buffers from the inputs'
  shape; after a switch any rank may be first or last). Returns the mean of the micro-batches'
  losses on the last stage, None elsewhere.
* The agent (PARAPILOT_AGENT, as for the DDP Session; none: the job trains on its split) gets a
  JobInfo on every connection (world size = stages, global batch, capability PIPELINE only,
  framework "pytorch-pipeline <torch version>", layers = the blocks in order) and one Telemetry
  per rank per step (pipeline_telemetry.py): compute without waits, the pipeline's sends and
  receives as p2p/pp, the stage's blocks and each block's compute.
* Plans: a PlanPrepare is accepted when it moves blocks between this job's stages
  (pipeline_plan.py: Layout dp=1 tp=1 pp=S micro_batches=M, named dp1-tp1-ppS-mb<samples per
  micro-batch> with ;st=<split>, and ;sc=<this job's schedule> when it names one) and refused
  with the reason otherwise.
  An accepted plan is streamed ahead of its boundary (pipeline_stream.py): the ranks agree at a
  step boundary to stream it (the newest plan every rank staged; boundary.py's extra values),
  the blocks it moves go, with their optimizer state, from their holders to their new ranks,
  which keep their copies in step with the holders' updates from the gradients streamed after
  every step; each rank answers PlanReady{ok} once its copies are in place. At the boundary the
  plan is committed for (step_session.py, boundary.py) the copies are installed, the stages,
  schedule and optimizers rebuilt, and the next step runs on the new split. A plan that could
  not be streamed (not staged on every rank when the others agreed, or another plan applied
  first) moves its blocks at its boundary instead (pipeline_move.py). Either way the result is
  bit-identical to stopping, saving the parameters and optimizer state, relaunching on the new
  split and loading them (tests/python/test_pipeline.py).
* save(path) / PipelineSession(..., resume_from=[paths]) are that checkpoint: each rank writes
  its blocks (pipeline_state.save_blocks); a job started on any split loads the blocks it holds.
* Errors: PipelineError (a ValueError) for a job that cannot be built as asked; PeerLost from
  step() when a collective among the ranks fails (peer_failure.py), as for DDP.
Thread-safety: the training thread's; plans arrive on the bus client's I/O thread and only build
a small config there.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import pipeline_split, pipeline_state, wire
from .boundary import Outcome
from .hooks import _StepRecord
from .pipeline_stream import BlockStream
from .plans import Deferred
from .pipeline_plan import PlanRefused, layout_name, plan_split
from .pipeline_stage import SCHEDULES, PipelineError, StageRunner, StepTiming
from .pipeline_telemetry import stage_telemetry
from .step_session import StepSession

__all__ = ["PipelineSession", "PipelineConfig", "Switch", "PipelineError", "PlanRefused", "SCHEDULES",
           "layout_name"]


@dataclass
class Switch:
    """One switch on this rank: at the boundary before `step`, to plan_id; the pause (ms from the
    agreement to the new stages being built), the bytes this rank sent at the boundary and the
    bytes it streamed ahead of it (from step `streamed_from`; None: not streamed)."""
    step: int
    plan_id: int
    pause_ms: float
    bytes_at_boundary: int
    bytes_streamed: int = 0
    streamed_from: Optional[int] = None


@dataclass
class PipelineConfig:
    """A plan of a pipeline job: the split it runs (plan 0: the start split)."""
    plan_id: int = 0
    split: List[int] = field(default_factory=list)
    name: str = ""


class PipelineSession(StepSession):
    """One rank's stage of a pipeline job, connected to the parapilot agent. See the module
    docstring.

    blocks: the model as an ordered list of modules (the same on every rank).
    loss_fn: loss_fn(output, target) -> scalar, on one micro-batch.
    optimizer_factory: params -> torch.optim.Optimizer.
    global_batch: samples per step; micro_batches: how many micro-batches it is cut into
        (global_batch % micro_batches == 0); schedule: "gpipe" or "1f1b" (1f1b: micro_batches
        >= stages).
    split: blocks per stage at the start (default: even).
    resume_from: checkpoint files of every rank (save()) to start from; the step continues
        from theirs.
    stream: stream a plan's moved blocks ahead of its boundary (default); False: move them at
        the boundary (the pause then grows with the bytes moved).
    agent, secret_file, secret_env, client_options, log, control_timeout_s: StepSession's.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], loss_fn: Callable,
                 optimizer_factory: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer],
                 *, global_batch: int, micro_batches: int, schedule: str = "gpipe",
                 split: Optional[Sequence[int]] = None,
                 resume_from: Optional[Sequence[str]] = None, stream: bool = True,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET", log=None,
                 client_options: Optional[dict] = None, control_timeout_s: float = 1800.0):
        if not dist.is_initialized():
            raise RuntimeError("parapilot.pipeline.PipelineSession needs torch.distributed "
                               "initialised (init_process_group) first")
        if global_batch % micro_batches:
            raise PipelineError(f"global_batch {global_batch} does not divide into "
                                f"{micro_batches} micro-batches")
        rank, world = dist.get_rank(), dist.get_world_size()
        self.runner = StageRunner(blocks, loss_fn, optimizer_factory, rank=rank,
                                  n_stages=world, micro_batches=micro_batches,
                                  schedule=schedule, split=split, group=None,
                                  move_group=dist.new_group(backend="gloo"))
        start = 0
        if resume_from:
            saved = pipeline_state.load_blocks(resume_from)
            self.runner.load(saved["blocks"])
            start = saved["step"]
        self.runner.after_backward = self._after_backward
        self._stream_plans = bool(stream)
        self._stream_group = dist.new_group(backend="gloo")
        self._stream: Optional[BlockStream] = None
        self._waiting: Dict[int, PipelineConfig] = {}  # staged, not streamed yet (I/O thread)
        self._waiting_lock = threading.Lock()
        self._settled = 0  # plans up to this id were streamed or left to move at the boundary
        self._timings: Dict[int, StepTiming] = {}
        self._switches: Dict[int, Tuple[float, int]] = {}  # step -> (pause ms, bytes sent)
        self.switches: List[Switch] = []  # every switch on this rank
        super().__init__(torch.nn.ModuleList(self.runner.blocks), None,
                         global_batch=global_batch,
                         framework=f"pytorch-pipeline {torch.__version__}",
                         capabilities=wire.Capability.PIPELINE, agent=agent,
                         secret_file=secret_file, secret_env=secret_env,
                         layers=self.runner.blocks,
                         grad_stats_every=0, start_step=start, log=log,
                         client_options=client_options, control_timeout_s=control_timeout_s)

    # ---- public API ----

    @property
    def split(self) -> List[int]:
        """Blocks per stage now."""
        return list(self.runner.split)

    @property
    def held(self) -> range:
        """The blocks this rank holds now."""
        return self.runner.held

    @property
    def schedule(self) -> str:
        return self.runner.schedule_name

    @property
    def micro_batches(self) -> int:
        return self.runner.micro_batches

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """One training step (see the module docstring); at its end the ranks agree on the plan
        for the next step and switch to it."""
        with StepSession.step(self):
            loss = self.runner.step(inputs, targets)
            self._timings[self.step_index] = self.runner.timing
        return loss

    def block_states(self) -> Dict[int, dict]:
        """The state of the blocks this rank holds (pipeline_state.collect)."""
        return self.runner.block_states()

    def save(self, path: str) -> None:
        """Writes this rank's blocks and the next step's index to `path` (resume_from)."""
        pipeline_state.save_blocks(path, self.runner.block_states(), self.step_index)

    def close(self, flush_timeout: float = 2.0) -> None:
        stream, self._stream = self._stream, None
        if stream is not None and self.failure is None:
            stream.drop(self.step_index)  # every rank ends it after the same steps
        super().close(flush_timeout)
        self.runner.close()

    # ---- StepSession's hooks ----

    def _initial_config(self) -> PipelineConfig:
        return PipelineConfig(0, list(self.runner.split), "")

    def _samples(self) -> int:
        return self.global_batch

    def _start_text(self) -> str:
        r = self.runner
        return (f"stage {self.rank} of {self.world_size}, blocks {_blocks(r.held)}, split "
                f"{_text(r.split)}, schedule {r.schedule_name}, {r.micro_batches} micro-batches "
                f"of {self.global_batch // r.micro_batches}")

    def _layout_problem(self, p: wire.PlanPrepare) -> str:
        try:
            self._plan_split(p)
        except PlanRefused as e:
            return str(e)
        return ""

    def _plan_split(self, p: wire.PlanPrepare) -> List[int]:
        r = self.runner
        return plan_split(p, n_blocks=len(r.blocks), n_stages=self.world_size,
                          micro_batches=r.micro_batches, global_batch=self.global_batch,
                          schedule=r.schedule_name)

    def _stage_plan(self, p: wire.PlanPrepare) -> Deferred:
        cfg = PipelineConfig(p.plan_id, self._plan_split(p), p.layout_name)
        if not self._stream_plans:
            return cfg
        with self._waiting_lock:
            self._waiting[p.plan_id] = cfg
        return Deferred(cfg)  # ready once streamed (_after_boundary)

    def _apply(self, cfg: PipelineConfig) -> None:
        old = self.runner.split
        t0 = time.perf_counter_ns()
        stream, self._stream = self._stream, None
        staged, streamed = None, 0
        if stream is not None:
            if stream.plan_id == cfg.plan_id:
                staged = stream.finish(self.step_index)
                streamed = stream.bytes_sent
            else:
                stream.drop(self.step_index)
        sent = self.runner.switch(cfg.split, staged)
        pause = (time.perf_counter_ns() - t0) / 1e6
        self._switches[self.step_index] = (pause, sent)
        self.switches.append(Switch(self.step_index, cfg.plan_id, pause, sent, streamed,
                                    stream.start_step if staged is not None else None))
        moved = pipeline_split.moves(old, cfg.split)
        how = (f"streamed ahead from step {stream.start_step}, {streamed:,} bytes sent from here"
               if staged is not None else f"moved at the boundary, {sent:,} bytes sent from here")
        self._say("info", f"plan {cfg.plan_id} applied at step {self.step_index}: split "
                          f"{_text(old)} -> {_text(cfg.split)}, this rank holds blocks "
                          f"{_blocks(self.runner.held)}; {_count(len(moved), 'block')} {how}, "
                          f"pause {pause:.1f} ms")

    # ---- streaming plans ahead of their boundary (pipeline_stream.py) ----

    def _after_backward(self) -> None:
        if self._stream is not None:
            self._stream.after_backward(self.step_index)

    def _boundary_extra(self) -> List[int]:
        """[the newest plan staged here and not streamed yet, the streamed plan when this rank's
        book dropped it (aborted, the agent lost)], agreed with MAX at the next boundary."""
        with self._waiting_lock:
            want = max((i for i in self._waiting if self.book.get(i) is not None), default=0)
        s = self._stream
        return [want, s.plan_id if s is not None and self.book.get(s.plan_id) is None else 0]

    def _after_boundary(self, out: Outcome) -> None:
        if not out.extra:
            return
        want, dropped = out.extra
        s = self._stream
        if s is not None and s.plan_id in (dropped, out.missed):
            self._stream = None
            s.drop(self.step_index)
            self._say("info", f"plan {s.plan_id}: stream ended at step {self.step_index} "
                              f"({'missed' if s.plan_id == out.missed else 'dropped by the agent'}"
                              "); its copies are freed")
        if want > self._settled and want > self.plan_id:
            with self._waiting_lock:
                mine = want in self._waiting and self.book.get(want) is not None
            # Every rank streams it, or none does (then it moves at its boundary).
            if self._reduce_min(1 if mine else 0):
                self._start_stream(want)
            self._settled = want
        with self._waiting_lock:
            late = [i for i in self._waiting if i <= self._settled]
            for i in late:
                del self._waiting[i]
        for i in late:
            self.book.ready(i)  # not streamed: moved at its boundary if committed

    def _start_stream(self, plan_id: int) -> None:
        with self._waiting_lock:
            cfg = self._waiting.pop(plan_id)
        if self._stream is not None:
            old, self._stream = self._stream, None
            old.drop(self.step_index)
        book = self.book
        self._stream = BlockStream(self.runner, plan_id, cfg.split, self.step_index,
                                   self._stream_group, ready=lambda: book.ready(plan_id),
                                   refuse=lambda why: book.refuse(plan_id, why))
        self._say("info", f"plan {plan_id}: streaming its blocks from step {self.step_index} "
                          f"(split {_text(self.runner.split)} -> {_text(cfg.split)})")

    def _telemetry(self, rec: _StepRecord) -> wire.Telemetry:
        # The blocks the step ran (a switch at its boundary changed runner.held since).
        timing = self._timings.pop(rec.step, None)
        if timing is None:  # a step whose schedule did not finish (it raised)
            timing = StepTiming(block_ms={i: 0.0 for i in self.runner.held})
        held = sorted(timing.block_ms)
        return stage_telemetry(rec, timing, stage=self.rank, first_block=held[0],
                               n_blocks=len(held), micro_batches=self.runner.micro_batches,
                               global_batch=self.global_batch, clock=self._clock,
                               switch=self._switches.pop(rec.step, None))

    def _summary_tail(self) -> str:
        pauses = [w.pause_ms for w in self.switches]
        tail = f"split {_text(self.runner.split)}"
        if pauses:
            tail += f", switch pauses {', '.join(f'{p:.1f}' for p in pauses)} ms"
        return tail


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _text(split: Sequence[int]) -> str:
    return ",".join(str(n) for n in split)


def _blocks(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}"
