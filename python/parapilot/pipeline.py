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
  micro-batch> with ;st=<split> and this job's schedule) and refused with the reason otherwise. Accepted, it is staged at once (nothing is copied ahead) and answered
  PlanReady{ok}; at the boundary every rank agrees on (step_session.py, boundary.py), the blocks
  whose stage changes are streamed, with their optimizer state, from their old rank to their new
  one (pipeline_move.py), the stages, schedule and optimizers are rebuilt there, and the next
  step runs on the new split. The result is bit-identical to stopping, saving the parameters and
  optimizer state, relaunching on the new split and loading them (tests/python/test_pipeline.py).
* save(path) / PipelineSession(..., resume_from=[paths]) are that checkpoint: each rank writes
  its blocks (pipeline_state.save_blocks); a job started on any split loads the blocks it holds.
* Errors: PipelineError (a ValueError) for a job that cannot be built as asked; PeerLost from
  step() when a collective among the ranks fails (peer_failure.py), as for DDP.
Thread-safety: the training thread's; plans arrive on the bus client's I/O thread and only build
a small config there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import pipeline_split, pipeline_state, wire
from .hooks import _StepRecord
from .pipeline_plan import PlanRefused, layout_name, plan_split
from .pipeline_stage import SCHEDULES, PipelineError, StageRunner, StepTiming
from .pipeline_telemetry import stage_telemetry
from .step_session import StepSession

__all__ = ["PipelineSession", "PipelineConfig", "PipelineError", "PlanRefused", "SCHEDULES",
           "layout_name"]


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
    agent, secret_file, secret_env, client_options, log, control_timeout_s: StepSession's.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], loss_fn: Callable,
                 optimizer_factory: Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer],
                 *, global_batch: int, micro_batches: int, schedule: str = "gpipe",
                 split: Optional[Sequence[int]] = None,
                 resume_from: Optional[Sequence[str]] = None,
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
        self._timings: Dict[int, StepTiming] = {}
        self._switches: Dict[int, Tuple[float, int]] = {}  # step -> (pause ms, bytes sent)
        self.switch_pauses_ms: List[float] = []  # every switch's pause on this rank
        self.switch_bytes_sent: List[int] = []  # ... and the bytes it sent
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

    def _stage_plan(self, p: wire.PlanPrepare) -> PipelineConfig:
        return PipelineConfig(p.plan_id, self._plan_split(p), p.layout_name)

    def _apply(self, cfg: PipelineConfig) -> None:
        old = self.runner.split
        t0 = time.perf_counter_ns()
        sent = self.runner.switch(cfg.split)
        pause = (time.perf_counter_ns() - t0) / 1e6
        self._switches[self.step_index] = (pause, sent)
        self.switch_pauses_ms.append(pause)
        self.switch_bytes_sent.append(sent)
        moved = pipeline_split.moves(old, cfg.split)
        self._say("info", f"plan {cfg.plan_id} applied at step {self.step_index}: split "
                          f"{_text(old)} -> {_text(cfg.split)}, this rank holds blocks "
                          f"{_blocks(self.runner.held)}; {len(moved)} blocks moved, "
                          f"{sent:,} bytes sent from here, pause {pause:.1f} ms")

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
        pauses = self.switch_pauses_ms
        tail = f"split {_text(self.runner.split)}"
        if pauses:
            tail += f", switch pauses {', '.join(f'{p:.1f}' for p in pauses)} ms"
        return tail


def _text(split: Sequence[int]) -> str:
    return ",".join(str(n) for n in split)


def _blocks(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}"
