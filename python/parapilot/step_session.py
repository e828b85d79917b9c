"""StepSession: what every torch job's session does, whatever its parallelism — the step loop's
timing, the agent link, the boundary where plans switch, failures among the ranks, telemetry and
the summary. DDP (session.py), FSDP2 and pipeline sessions are subclasses that say what a plan
is for their job and how a step's telemetry is built.

Contract:
* `with session.step():` wraps one training step. Its cycle runs from the end of the previous
  step to the end of this one (what runs between two steps, such as the DataLoader's next(),
  belongs to the later one); `with session.outside_steps():` marks work that is no training
  step, and a gap between steps longer than OUTLIER_GAP median cycles is charged to no step.
* Every collective the training thread blocks in outside the job's own gradient path is timed
  (collectives.py) and recorded in the step's record (rec.waits); the subclass's telemetry
  takes it out of the step's compute.
* On exit from a step its record is queued, the ranks agree on the plan for the next step
  (boundary.py: a MAX all-reduce on a separate CPU Gloo group, started one step ahead) and a
  committed plan is switched in with the subclass's _apply(); telemetry is sent once its marks
  have resolved (never a device sync, except in close()).
* A collective that fails among the ranks inside a step or at its boundary (a peer process
  killed, a link between ranks cut, a collective timed out) makes step() raise PeerLost
  (peer_failure.py) naming what was lost, after a census of up to min(5, control_timeout_s)
  seconds in the job's store (its own process-group connections closed first, so that peers
  blocked on it fail at once; the store and the agent stay connected). No plan is applied after
  it. Nothing waits forever: the agreement's group times out after control_timeout_s.
* close() sends what is pending, logs a one-line summary, disconnects and removes the timing
  hooks; the last plan stays.
* Everything the session says goes, one line each prefixed "rank R: ", to `log` (default: the
  logging module's "parapilot" logger).

A subclass sets, before calling StepSession.__init__, nothing; it passes its framework name and
JobInfo capabilities, and overrides:
  _initial_config() -> config          the plan in force at the start (config.plan_id == 0);
  _layout_problem(prepare) -> str      "" when this job can run the plan, else why not;
  _stage_plan(prepare) -> config       builds a plan's config (I/O thread; raise to refuse);
  _apply(config)                       switches to it at a boundary (training thread) and logs;
  _boundary_extra() -> [int]           its own values for the boundary's MAX (default none);
  _after_boundary(outcome)             what it does with the agreed outcome (boundary.Outcome),
                                       after any _apply (default nothing);
  _telemetry(record) -> wire.Telemetry the step's telemetry;
  _samples() -> int                    samples this rank processes in the coming step;
  _summary_tail() -> str               what the summary line adds for this kind of job.
Thread-safety: a session belongs to the training thread; bus messages are handled on the
client's I/O thread (staging only builds new objects).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import math
import os
import statistics
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # unwrapped: never timed as script waits

from . import collectives, wire
from .agent_link import AgentLink, announcement, summary_line
from .boundary import Boundary
from .client import logging_logger
from .hooks import _Clock, _StepRecord, layer_map
from .peer_failure import PeerLost, census, cut_peer_links, is_collective_failure


OUTLIER_GAP = 5.0  # a gap between steps this many median cycles long is not a step's work


class StepSession:
    """The base of the torch sessions. See the module docstring.

    module: the model the forward timing hooks go on (the job's outermost module).
    optimizer: the job's optimizer (its step() is timed, never changed); None to skip.
    global_batch: samples per step over all ranks.
    framework / capabilities: what the JobInfo announces.
    agent, secret_file, secret_env, client_options: the agent link (agent_link.py).
    layers: modules that are the agent's layers 0..n-1 (default: every parameter-owning module).
    grad_stats_every: per-layer gradient norms every this many steps (0: never).
    control_timeout_s: the boundary agreement's group timeout (default 1800 s, torch's default).
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], *,
                 global_batch: int, framework: str, capabilities: int,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET",
                 layers: Optional[Sequence[torch.nn.Module]] = None, process_group=None,
                 grad_stats_every: int = 10, start_step: int = 0, log=None,
                 client_options: Optional[dict] = None, control_timeout_s: float = 1800.0):
        if not dist.is_initialized():
            raise RuntimeError(f"parapilot: {type(self).__name__} needs torch.distributed "
                               "initialised (init_process_group) first")
        self.optimizer = optimizer
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.global_batch = int(global_batch)
        if self.global_batch < self.world_size:
            raise ValueError(f"global_batch {global_batch} < world size {self.world_size}")
        if not control_timeout_s > 0:
            raise ValueError(f"control_timeout_s must be > 0, not {control_timeout_s}")
        self.framework = framework
        self.capabilities = capabilities
        self.grad_stats_every = grad_stats_every
        self.step_index = start_step
        self.should_stop = False
        self.stop_reason: Optional[str] = None
        self._log = log or logging_logger(logging.getLogger("parapilot"))
        self._layer_of = layer_map(module, layers)
        self._n_layers = max(self._layer_of.values()) + 1 if self._layer_of else 0
        self._params_by_layer: Dict[int, List[torch.nn.Parameter]] = {}
        for p, layer in self._layer_of.items():
            self._params_by_layer.setdefault(layer, []).append(p)
        first = next(module.parameters(), None)
        self._clock = _Clock(first is not None and first.is_cuda)
        # The boundary agreement runs on its own CPU Gloo group: no device sync, no interference
        # with the job's collectives.
        self.control_timeout_s = float(control_timeout_s)
        self._control_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.control_timeout_s))
        self.failure: Optional[PeerLost] = None  # set once a collective failed (step() raised it)
        # What this rank knows of a fault it suffered (fault injection sets it; peer_failure.py):
        # told to its peers in the census after a failed collective.
        self.fault_note = ""
        self._record: Optional[_StepRecord] = None
        self._pending: List[_StepRecord] = []
        self._prev_end: Optional[Tuple[int, Any]] = None  # (end_ns, t_end) of the last step
        self._cycles_ms: collections.deque = collections.deque(maxlen=1 << 16)
        self._steps_run = 0
        self._summarised = False
        self._refused: List[int] = []
        self._hooks = [module.register_forward_pre_hook(self._on_forward_pre),
                       module.register_forward_hook(self._on_forward)]
        self._orig_step = None
        if optimizer is not None:
            self._wrap_optimizer(optimizer)
        # The cycle's waits in collectives outside the job's gradient path (collectives.py):
        # recorded on this thread; those between two steps belong to the next step's cycle.
        self._thread = threading.get_ident()
        self._in_hook = 0
        self._between: List[Tuple[str, int, Any, Any]] = []
        self.gaps_excluded = 0  # gaps between steps not charged to a step (outliers, marked)
        self.last_telemetry: Optional[wire.Telemetry] = None
        self.applied_plans: List[int] = []
        self._layer_sizes = self._layer_infos()
        self.config = self._initial_config()
        self.link = AgentLink(self.rank, job_info=self.job_info, check=self._check,
                              stage=self._stage, say=self._say, agent=agent,
                              secret_file=secret_file, secret_env=secret_env,
                              client_options=client_options)
        self.book = self.link.book
        self.agent_address = self.link.address
        self._boundary_agreement = Boundary(self.book, self._start_max, self._reduce_min)
        n_params = sum(l.params for l in self._layer_sizes)
        self._say("info", f"session started: {self._start_text()}, {self._n_layers} layers "
                          f"({n_params:,} parameters), {self.link.where()}")
        self.link.start()
        # Last: a constructor that raised above leaves torch.distributed unwrapped.
        collectives.install(self)

    # ---- what a subclass says about its job ----

    def _initial_config(self):
        raise NotImplementedError

    def _layout_problem(self, p: wire.PlanPrepare) -> str:
        raise NotImplementedError

    def _stage_plan(self, p: wire.PlanPrepare):
        raise NotImplementedError

    def _apply(self, config) -> None:
        raise NotImplementedError

    def _telemetry(self, rec: _StepRecord) -> wire.Telemetry:
        raise NotImplementedError

    def _boundary_extra(self) -> List[int]:
        return []

    def _after_boundary(self, out) -> None:
        pass

    def _samples(self) -> int:
        return 0

    def _start_text(self) -> str:
        return f"world size {self.world_size}, global batch {self.global_batch}"

    def _summary_tail(self) -> str:
        return ""

    # ---- public API ----

    @property
    def client(self):
        """The bus client (None without an agent or after close())."""
        return self.link.client

    @property
    def plan_id(self) -> int:
        return self.config.plan_id

    @contextlib.contextmanager
    def step(self):
        """Wraps one training step. On exit the step's telemetry is queued and, at this
        boundary, the ranks agree on a committed plan."""
        if self.failure is not None:
            raise self.failure
        self._begin()
        try:
            yield self
        except BaseException as e:
            if is_collective_failure(e):
                self._record = None
                raise self._peer_lost(e) from e
            self._end_or_raise()
            raise
        self._end_or_raise()

    @contextlib.contextmanager
    def outside_steps(self):
        """Wraps work between training steps that is not training (an evaluation pass, a
        checkpoint, logging that waits): the next step's cycle starts when it ends, so it is
        charged to no step, and its collectives are not counted as the next step's waits."""
        try:
            yield self
        finally:
            self._restart_cycle()
            self.gaps_excluded += 1

    def job_info(self, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> wire.JobInfo:
        """The JobInfo this rank announces on each connection (agent_link.announcement):
        per-layer sizes of layers 0..n-1 (params: elements; grad_bytes: bytes of the gradients,
        parameters that require them), as many as fit in one frame of max_frame_bytes."""
        return announcement(self.rank, self.world_size, self.global_batch, self.capabilities,
                            self.framework, self._layer_sizes, max_frame_bytes)

    def close(self, flush_timeout: float = 2.0) -> None:
        """Sends pending telemetry (up to flush_timeout s), logs a one-line summary and
        disconnects. The last plan stays in force. A step after close() starts a new cycle at
        its own entry."""
        self._emit(force=True)
        self._prev_end = None
        collectives.uninstall(self)
        if self.failure is None:
            self._boundary_agreement.finish()  # every rank started it; finish it before leaving
        self._boundary_agreement.abandon()
        if self._control_group is not None and self.failure is not None:
            self._control_group = None  # broken: left to the process exit, never waited on
        if self._control_group is not None:
            # Release the agreement's Gloo group now, while the interpreter is whole: left to
            # interpreter shutdown, its worker threads are torn down in an order that can abort
            # the process ("terminate called without an active exception").
            dist.destroy_process_group(self._control_group)
            self._control_group = None
        if not self._summarised:
            self._summarised = True
            self._say("info", self._summary())
        self.link.close(flush_timeout)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._orig_step is not None and self.optimizer is not None:
            self.optimizer.step = self._orig_step
            self._orig_step = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- failures ----

    def _end_or_raise(self) -> None:
        """_end(), with a collective failure at the boundary raised as PeerLost."""
        try:
            self._end()
        except RuntimeError as e:
            if is_collective_failure(e):
                raise self._peer_lost(e) from e
            raise

    def _peer_lost(self, e: BaseException) -> PeerLost:
        """After a collective failed in step self.step_index: the census, the log line and the
        PeerLost that step() raises (and raises again on every later step)."""
        self._boundary_agreement.abandon()  # on a broken group: never waited for
        # Close this rank's process-group connections (the store and the agent kept): a peer
        # blocked on it in a collective fails now, not at its timeout, and joins the census.
        keep = [int(p) for p in (os.environ.get("MASTER_PORT", ""),
                                 self.agent_address.rpartition(":")[2]) if p.isdigit()]
        if keep:
            cut_peer_links(keep)
        wait_s = min(5.0, self.control_timeout_s)
        lost, notes = census(c10d._get_default_store() if self.process_group is None else None,
                             self.rank, self.world_size, self.fault_note, wait_s)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        text = f"rank {self.rank}: stopped at step {self.step_index}: a collective failed ({first})"
        if self.fault_note:
            text += f" (this rank: {self.fault_note})"
        if lost:
            text += f"; lost: {lost}, no answer in the job's store within {wait_s:g} s"
        else:
            text += ("; no rank lost: every rank answered in the job's store, so a link between "
                     "ranks broke or a collective timed out") + (f"; {notes}" if notes else "")
        pending = self.book.committed_at(2**64 - 1, self.plan_id)
        if pending:
            p = self.book.get(pending)
            text += (f"; plan {pending}, committed for step {p.switch_at_step}, was not applied: "
                     f"the job stays on plan {self.plan_id}")
        self.failure = PeerLost(text, rank=self.rank, step=self.step_index, lost=lost,
                                plan_id=self.plan_id, pending_plan=pending)
        self._say("error", text)
        return self.failure

    # ---- the step's cycle ----

    def _restart_cycle(self) -> None:
        """The next step's cycle starts now (not at the previous step's end)."""
        self._prev_end = None
        self._between = []

    def _note_collective(self, key: str, nbytes: int, t0: Any, t1: Any) -> None:
        """A collective the training thread was blocked in from t0 to t1 (collectives.py)."""
        rec = self._record
        (rec.waits if rec is not None else self._between).append((key, nbytes, t0, t1))

    def _begin(self) -> None:
        rec = _StepRecord(self.step_index, self.plan_id, self._samples())
        now_ns = time.time_ns()
        rec.t_enter = self._clock.mark()
        if self._prev_end is not None and self._outlier_gap(now_ns - self._prev_end[0]):
            # Far longer than any recent step: work that is not training (an evaluation pass the
            # script did not mark), not a speed. The cycle starts at this step's entry.
            self._restart_cycle()
            self.gaps_excluded += 1
        rec.waits, self._between = self._between, []
        if self._prev_end is not None:  # the cycle began where the previous step ended
            rec.start_ns, rec.t_start = self._prev_end
        else:
            rec.start_ns, rec.t_start = now_ns, rec.t_enter
        self._record = rec

    def _outlier_gap(self, gap_ns: int) -> bool:
        """A gap between two steps longer than OUTLIER_GAP x the median of the last 20 cycles
        (which include their own gaps: a steadily slow data loader is in the median)."""
        n = len(self._cycles_ms)
        if n < 5:
            return False
        recent = [self._cycles_ms[i] for i in range(max(0, n - 20), n)]
        return gap_ns / 1e6 > OUTLIER_GAP * statistics.median(recent)

    def _end(self) -> None:
        rec = self._record
        if rec is None:
            return
        rec.t_end = self._clock.mark()
        rec.end_ns = time.time_ns()
        self._prev_end = (rec.end_ns, rec.t_end)
        self._cycles_ms.append(max(0.0, (rec.end_ns - rec.start_ns) / 1e6))
        self._steps_run += 1
        self._summarised = False
        if self.grad_stats_every and rec.step % self.grad_stats_every == 0:
            rec.layers = self._grad_stats()
        self._record = None
        self._pending.append(rec)
        self.step_index += 1
        t0 = time.perf_counter_ns()
        self._boundary(self.step_index)
        rec.control_ms = (time.perf_counter_ns() - t0) / 1e6
        self._emit()

    # ---- the boundary ----

    def _start_max(self, values: List[int]):
        t = torch.tensor(values, dtype=torch.int64)
        work = c10d.all_reduce(t, op=dist.ReduceOp.MAX, group=self._control_group, async_op=True)

        def result() -> List[int]:
            work.wait()
            return [int(x) for x in t.tolist()]
        return result

    def _reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        c10d.all_reduce(t, op=dist.ReduceOp.MIN, group=self._control_group)
        return int(t[0])

    def _boundary(self, next_step: int) -> None:
        """Step boundary before `next_step` (boundary.py): the plan every rank switches to, and
        whether to stop. After close() there is no agreement: the plan in force stays."""
        if self._control_group is None:
            return
        current = self.plan_id
        out = self._boundary_agreement.at(next_step, current, f"rank {self.rank}: ",
                                          self._boundary_extra())
        if out.stop and not self.should_stop:
            self.should_stop = True
            self.stop_reason = self.book.stop_reason or "another rank was asked to stop"
        if out.missed:
            self._refused.append(out.missed)
            self._say("warn", f"plan {out.missed} refused: committed but not staged on every "
                              f"rank; staying on plan {current}")
        if out.apply is not None:
            self.config = out.apply.staged
            self.applied_plans.append(out.apply_id)
            self._apply(self.config)
        self._after_boundary(out)

    # ---- plans (the bus client's I/O thread) ----

    def _check(self, p: wire.PlanPrepare) -> str:
        why = self._layout_problem(p)
        if why:
            self._refused.append(p.plan_id)
            self._say("warn", f"plan {p.plan_id} refused: {why}")
        return why

    def _stage(self, p: wire.PlanPrepare):
        try:
            return self._stage_plan(p)
        except Exception as e:  # the book refuses the plan with the same text
            self._refused.append(p.plan_id)
            self._say("warn", f"plan {p.plan_id} refused: {type(e).__name__}: {e}")
            raise

    # ---- timing hooks ----

    def _on_forward_pre(self, module, inputs) -> None:
        if self._record is not None and self._record.t_fwd0 is None:
            self._record.t_fwd0 = self._clock.mark()

    def _on_forward(self, module, inputs, output) -> None:
        if self._record is not None:
            self._record.t_fwd1 = self._clock.mark()

    def _wrap_optimizer(self, optimizer) -> None:
        orig = optimizer.step
        session = self

        def step(*args, **kwargs):
            rec = session._record
            if rec is not None:
                rec.t_opt0 = session._clock.mark()
            out = orig(*args, **kwargs)
            if rec is not None:
                rec.t_opt1 = session._clock.mark()
            return out
        self._orig_step = orig
        optimizer.step = step

    def _grad_stats(self) -> List[wire.LayerGradStat]:
        out = []
        norms, maxes, bad = [], [], []
        layers = sorted(self._params_by_layer)
        for layer in layers:
            grads = [_local(p.grad).detach().reshape(-1) for p in self._params_by_layer[layer]
                     if p.grad is not None]
            if not grads:
                norms.append(torch.zeros(())); maxes.append(torch.zeros(())); bad.append(torch.zeros(()))
                continue
            g = torch.cat(grads) if len(grads) > 1 else grads[0]
            finite = torch.isfinite(g)
            gz = torch.where(finite, g, torch.zeros_like(g))
            norms.append(gz.float().norm())
            maxes.append(gz.abs().max().float())
            bad.append((~finite).sum().float())
        if not layers:
            return out
        stats = torch.stack([torch.stack(norms), torch.stack(maxes), torch.stack(bad)])
        values = stats.cpu().tolist()  # one transfer every grad_stats_every steps
        for i, layer in enumerate(layers):
            n, mx, b = values[0][i], values[1][i], values[2][i]
            out.append(wire.LayerGradStat(layer, n if math.isfinite(n) else 0.0,
                                          mx if math.isfinite(mx) else 0.0, int(b)))
        return out

    # ---- telemetry ----

    def _emit(self, force: bool = False) -> None:
        keep = []
        for rec in self._pending:
            marks = [rec.t_end] + [c[3] for c in rec.comm]
            if not (force or self._clock.ready(marks)):
                keep.append(rec)
                continue
            if force and not self._clock.ready(marks):
                if self._clock.cuda:
                    torch.cuda.synchronize()
            t = self._telemetry(rec)
            self.last_telemetry = t
            self.link.send(t)
        self._pending = keep[-64:]  # never hold more than a few steps of unresolved events

    # ---- logging ----

    def _say(self, level: str, text: str) -> None:
        self._log(level, f"rank {self.rank}: {text}")

    def _summary(self) -> str:
        cycles = list(self._cycles_ms)
        return summary_line(self._steps_run, statistics.median(cycles) if cycles else 0.0,
                            self.applied_plans, len(self._refused), self._summary_tail(),
                            self.link.describe())

    def _layer_infos(self) -> List[wire.LayerInfo]:
        out = [wire.LayerInfo() for _ in range(min(self._n_layers, wire.MAX_LAYERS))]
        for p, layer in self._layer_of.items():
            if layer < len(out):
                out[layer].params += p.numel()
                if p.requires_grad:
                    out[layer].grad_bytes += p.numel() * p.element_size()
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local part (a DTensor's, under FSDP2); a plain tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
