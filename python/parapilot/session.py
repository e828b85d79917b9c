"""The Session: one DDP rank's connection to the parapilot agent, and the step context that
times each step, reports it and applies the agent's plans at step boundaries.

Contract:
* Session(ddp_model, optimizer, global_batch=...) registers the comm hook (hooks.py), forward
  timing hooks and a timing wrapper around optimizer.step; it never changes the model, the loss,
  the optimizer, the global batch or the data order.
* Every collective the training thread blocks in besides the gradient reduction (DDP's buffer
  broadcast, the script's own) is timed (collectives.py) and taken out of the step's compute.
  `with session.outside_steps():` marks work that is no training step; it and any gap between
  steps longer than OUTLIER_GAP median cycles are charged to no step.
* `with session.step():` wraps one training step. On exit the step's record is queued, the
  ranks agree on the plan for the next step (a MAX all-reduce on a separate CPU Gloo group,
  started one step ahead) and a committed plan is switched in; telemetry is sent once its marks
  have resolved (never a device sync, except in close()).
* Plans: PlanPrepare is checked (pure data-parallel layouts of this job's world size only) and
  staged into a PlanConfig on the bus client's I/O thread; the training thread swaps it in at a
  boundary and the PlanBook acknowledges it.
* Everything the session says goes, one line each prefixed "rank R: ", to `log` (default: the
  logging module's "parapilot" logger); the bus client's connect/disconnect lines at debug.
* close() sends what is pending, logs a one-line summary, disconnects and removes the timing
  hooks; the comm hook and the last plan stay.
* A collective that fails among the ranks inside a step or at its boundary (a peer process
  killed, a link between ranks cut, a collective timed out) makes step() raise PeerLost
  (peer_failure.py) naming what was lost, after a census of up to min(5, control_timeout_s)
  seconds in the job's store (its own process-group connections closed first, so that peers
  blocked on it fail at once; the store and the agent stay connected). No plan is applied
  after it, so a plan committed for a later step is never half applied. Nothing waits
  forever: the boundary agreement's group times out after control_timeout_s (default 1800 s,
  torch's default group timeout, as before), the gradient reduction after the timeout the job
  gave init_process_group.
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
from torch.utils.data import DataLoader
from torch.distributed import distributed_c10d as c10d  # unwrapped: never timed as script waits

from . import collectives, plan_name, wire
from .auth import Secret, SecretError, load_secret
from .client import Client, logging_logger
from .compressors import _describe_methods, _methods_from, _powersgd_states
from .hooks import (PlanConfig, _Clock, _HookState, _StepRecord, _comm_hook, _step_telemetry,
                    layer_map)
from .peer_failure import PeerLost, census, cut_peer_links, is_collective_failure
from .plans import PlanBook
from .shares import ShareBatchSampler, plan_shares, split_batch


OUTLIER_GAP = 5.0  # a gap between steps this many median cycles long is not a step's work


class Session:
    """Connects a DDP training job to the parapilot agent. See the module docstring.

    ddp_model: the DistributedDataParallel module (its comm hook is registered here; the hook
        can only be registered once, before the first backward).
    optimizer: the job's optimizer (timed, never changed); None to skip optimizer timing.
    global_batch: samples per step over all ranks (what the shares split).
    agent: "host:port" of `parapilot deploy` (default: env PARAPILOT_AGENT; empty or unset: no
        agent, the hook still weights by the initial shares).
    secret_file / secret_env: the bus secret (default: env PARAPILOT_SECRET_FILE, else the
        variable named by secret_env, default PARAPILOT_SECRET).
    layers: modules that are the agent's layers 0..n-1 (default: every parameter-owning module).
    grad_stats_every: per-layer gradient norms every this many steps (0: never).
    log: a (level, line) callable for what the session says (default: the "parapilot" logger of
        the logging module); the bus client's own lines go to it at "debug".
    client_options: keyword arguments of parapilot.Client (its on_connect / on_disconnect run
        after the session's own).
    control_timeout_s: the boundary agreement's group timeout: an agreement a peer does not
        answer within it fails, and step() raises PeerLost (default 1800 s, torch's default
        process-group timeout; it must exceed the longest time one rank may reach a step
        boundary after another, e.g. rank 0 saving a checkpoint inside a step).
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                 optimizer: Optional[torch.optim.Optimizer] = None, *, global_batch: int,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET",
                 layers: Optional[Sequence[torch.nn.Module]] = None,
                 process_group=None, grad_stats_every: int = 10, start_step: int = 0,
                 initial_shares: Optional[Sequence[int]] = None, log=None,
                 client_options: Optional[dict] = None, control_timeout_s: float = 1800.0):
        if not dist.is_initialized():
            raise RuntimeError("parapilot.pytorch.Session needs torch.distributed initialised "
                               "(init_process_group) first")
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.global_batch = int(global_batch)
        if self.global_batch < self.world_size:
            raise ValueError(f"global_batch {global_batch} < world size {self.world_size}")
        self.grad_stats_every = grad_stats_every
        self.step_index = start_step
        self.should_stop = False
        self.stop_reason: Optional[str] = None
        self._log = log or logging_logger(logging.getLogger("parapilot"))
        module = ddp_model.module if hasattr(ddp_model, "module") else ddp_model
        self._layer_of = layer_map(module, layers)
        self._n_layers = max(self._layer_of.values()) + 1 if self._layer_of else 0
        self._params_by_layer: Dict[int, List[torch.nn.Parameter]] = {}
        for p, layer in self._layer_of.items():
            self._params_by_layer.setdefault(layer, []).append(p)
        first = next(module.parameters(), None)
        cuda = first is not None and first.is_cuda
        self._clock = _Clock(cuda)
        # The boundary agreement runs on its own CPU Gloo group: no device sync, no interference
        # with the gradient collectives.
        if not control_timeout_s > 0:
            raise ValueError(f"control_timeout_s must be > 0, not {control_timeout_s}")
        self.control_timeout_s = float(control_timeout_s)
        self._control_group = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.control_timeout_s))
        self.failure: Optional[PeerLost] = None  # set once a collective failed (step() raised it)
        # What this rank knows of a fault it suffered (fault injection sets it; peer_failure.py): told
        # to its peers in the census after a failed collective.
        self.fault_note = ""
        self._ctl_work = None
        self._ctl_tensor = None
        self._hook = _HookState(self)
        self._hook.config = self._build_config(0, list(initial_shares or []), [], "initial")
        ddp_model.register_comm_hook(self._hook, _comm_hook)
        self._record: Optional[_StepRecord] = None
        self._pending: List[_StepRecord] = []
        self._prev_end: Optional[Tuple[int, Any]] = None  # (end_ns, t_end) of the last step
        self._cycles_ms: collections.deque = collections.deque(maxlen=1 << 16)
        self._steps_run = 0
        self._summarised = False
        self._refused: List[int] = []
        self._hooks = [ddp_model.register_forward_pre_hook(self._on_forward_pre),
                       ddp_model.register_forward_hook(self._on_forward)]
        self._orig_step = None
        if optimizer is not None:
            self._wrap_optimizer(optimizer)
        # The cycle's waits in collectives other than the gradient reduction (collectives.py):
        # recorded on this thread, outside the comm hook; those between two steps belong to the
        # next step's cycle.
        self._thread = threading.get_ident()
        self._in_hook = 0
        self._between: List[Tuple[str, int, Any, Any]] = []
        self.gaps_excluded = 0  # gaps between steps not charged to a step (outliers, marked)
        self.last_telemetry: Optional[wire.Telemetry] = None
        self.applied_plans: List[int] = []
        self.framework = f"pytorch-ddp {torch.__version__}"
        self._layer_sizes = self._layer_infos()

        self.client: Optional[Client] = None
        self.book = PlanBook(self.rank, self._send, check=self._check, stage=self._stage)
        address = agent if agent is not None else os.environ.get("PARAPILOT_AGENT", "")
        self.agent_address = address
        self._agent_state = "never connected"  # then "connected" / "lost"
        self._outage_since: Optional[float] = None  # monotonic time the current outage began
        if address:
            try:
                secret = self._load_secret(secret_file, secret_env)
            except SecretError as e:
                raise SecretError(f"the agent at {address} needs the bus secret: {e}") from None
        if address:
            where = f"agent at {address}"
        elif agent is None:
            where = "no agent configured (PARAPILOT_AGENT unset)"
        else:
            where = 'no agent configured (agent="")'
        n_params = sum(l.params for l in self._layer_sizes)
        self._say("info", f"session started: world size {self.world_size}, global batch "
                          f"{self.global_batch}, {self._n_layers} layers ({n_params:,} "
                          f"parameters), {where}")
        if address:
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
            self.client = Client(address, secret, name=f"worker-{self.rank}", rank=self.rank,
                                 on_message=self._on_message, on_connect=on_connect,
                                 on_disconnect=on_disconnect, autostart=False, **opts)
            self.client.start()
        # Last: a constructor that raised above leaves torch.distributed unwrapped.
        collectives.install(self)

    # ---- public API ----

    @property
    def plan_id(self) -> int:
        return self._hook.config.plan_id

    @property
    def shares(self) -> List[int]:
        return list(self._hook.config.shares)

    @property
    def compression(self) -> Dict[int, Tuple[int, float]]:
        """Layer -> (method, parameter) of the active plan (uncompressed layers omitted)."""
        return dict(self._hook.config.methods)

    def local_counts(self) -> List[int]:
        """Samples per rank in the current step's global batch."""
        return list(self._hook.config.counts)

    @property
    def local_batch(self) -> int:
        return self._hook.config.counts[self.rank]

    def batch_sampler(self, dataset, shuffle: bool = True, seed: int = 0) -> ShareBatchSampler:
        """A batch sampler giving this rank its share of every global batch (pass it to
        DataLoader(dataset, batch_sampler=...))."""
        return ShareBatchSampler(len(dataset), self, shuffle=shuffle, seed=seed)

    def data_loader(self, dataset, shuffle: bool = True, seed: int = 0,
                    **kwargs) -> DataLoader:
        """DataLoader(dataset, batch_sampler=self.batch_sampler(dataset, shuffle, seed),
        **kwargs), whose `sampler` is that same ShareBatchSampler: `loader.sampler.set_epoch(e)`
        works as with a DistributedSampler. kwargs are DataLoader's (collate_fn, num_workers,
        pin_memory, ...); batch_size, shuffle, sampler, batch_sampler and drop_last are the
        session's to set and raise TypeError."""
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if key in kwargs:
                raise TypeError(f"Session.data_loader: {key} is set by the session (this rank's "
                                "share of each global batch); leave it out")
        sampler = self.batch_sampler(dataset, shuffle=shuffle, seed=seed)
        loader = DataLoader(dataset, batch_sampler=sampler, **kwargs)
        # DataLoader makes its own SequentialSampler when given a batch sampler and refuses to
        # replace it afterwards; with a batch sampler it never iterates `sampler`, so pointing
        # it at the share sampler only makes set_epoch reachable where scripts call it.
        object.__setattr__(loader, "sampler", sampler)
        return loader

    @contextlib.contextmanager
    def step(self):
        """Wraps one training step (forward, backward, optimizer step). On exit the step's
        telemetry is queued and, at this boundary, the ranks agree on a committed plan. The
        step's cycle runs from the end of the previous step (what runs between two steps, such
        as the DataLoader's next(), belongs to the later one) to the end of this one."""
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
        self._ctl_work = None  # on a broken group: never waited for
        self._ctl_tensor = None
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

    def _restart_cycle(self) -> None:
        """The next step's cycle starts now (not at the previous step's end)."""
        self._prev_end = None
        self._between = []

    def _note_collective(self, key: str, nbytes: int, t0: Any, t1: Any) -> None:
        """A collective the training thread was blocked in from t0 to t1 (collectives.py)."""
        rec = self._record
        (rec.waits if rec is not None else self._between).append((key, nbytes, t0, t1))

    def job_info(self, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES) -> wire.JobInfo:
        """The JobInfo this rank announces on each connection: per-layer sizes of layers
        0..n-1 (params: elements; grad_bytes: bytes of the gradients, parameters that require
        them), at most wire.MAX_LAYERS of them and as many as fit in one frame of
        max_frame_bytes (the list is informational: a truncated list is still valid)."""
        m = wire.JobInfo(self.rank, self.world_size, self.global_batch,
                         wire.Capability.DP_SHARES | wire.Capability.COMPRESSION,
                         self.framework.encode("utf-8")[:wire.MAX_NAME_BYTES].decode(
                             "utf-8", "ignore"), [])
        room = (max_frame_bytes - wire.FRAME_HEADER_BYTES - len(wire.encode_payload(m))) // 16
        m.layers = list(self._layer_sizes[:max(0, room)])
        return m

    def close(self, flush_timeout: float = 2.0) -> None:
        """Sends pending telemetry (up to flush_timeout s), logs a one-line summary and
        disconnects. Hooks stay (DDP does not allow unregistering a comm hook); the last plan
        stays in force. A step after close() starts a new cycle at its own entry."""
        self._emit(force=True)
        self._prev_end = None
        collectives.uninstall(self)
        if self._ctl_work is not None:  # every rank started it; finish it before leaving
            self._ctl_work.wait()
            self._ctl_work = None
            self._ctl_tensor = None
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
        if self.client is not None:
            self.client.flush(flush_timeout)
            self.client.stop()
            self.client = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._orig_step is not None and self.optimizer is not None:
            self.optimizer.step = self._orig_step
            self._orig_step = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- step boundary ----

    def _begin(self) -> None:
        rec = _StepRecord(self.step_index, self.plan_id, self.local_batch)
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

    def _boundary(self, next_step: int) -> None:
        """Step boundary before `next_step`. The ranks agree on the plan and on stopping with a
        MAX all-reduce on the control group that is started one step ahead and collected here
        (it has long finished: no waiting in the common case): the agreement for step t is
        started at the end of step t - 2 with the plans committed for t, and applied at the end
        of step t - 1. A rank that has not received the commit yet still switches when it has
        the plan staged (every rank answered PlanReady before the agent committed). After
        close() there is no agreement: the plan in force stays."""
        if self._control_group is None:
            return
        if self._ctl_work is not None:
            self._ctl_work.wait()
            agreed, stop_any = int(self._ctl_tensor[0]), int(self._ctl_tensor[1])
            self._ctl_work = None
            if stop_any and not self.should_stop:
                self.should_stop = True
                self.stop_reason = self.book.stop_reason or "another rank was asked to stop"
            if agreed > self.plan_id:
                self._switch(agreed)
        candidate = self.book.committed_at(next_step + 1, self.plan_id)
        stop = 1 if self.book.stop_reason is not None else 0
        self._ctl_tensor = torch.tensor([min(candidate, 2**63 - 1), stop], dtype=torch.int64)
        self._ctl_work = c10d.all_reduce(self._ctl_tensor, op=dist.ReduceOp.MAX,
                                         group=self._control_group, async_op=True)

    def _switch(self, plan_id: int) -> None:
        current = self.plan_id
        held = torch.tensor([1 if self.book.holds(plan_id) else 0], dtype=torch.int64)
        c10d.all_reduce(held, op=dist.ReduceOp.MIN, group=self._control_group)
        staged = self.book.applied(plan_id) if int(held[0]) else None
        if staged is None:
            self._refused.append(plan_id)
            self._say("warn", f"plan {plan_id} refused: committed but not staged on every "
                              f"rank; staying on plan {current}")
            self.book.missed(plan_id, f"rank {self.rank}: plan {plan_id} was committed but "
                             f"not staged on every rank; staying on plan {current}")
            return
        cfg = staged.staged
        self._hook.config = cfg
        self.applied_plans.append(plan_id)
        shares = ",".join(str(x) for x in cfg.shares) if cfg.shares else "even"
        self._say("info", f"plan {plan_id} applied at step {self.step_index}: this rank takes "
                          f"{cfg.counts[self.rank]} of {self.global_batch} samples (shares "
                          f"{shares}), compression: {_describe_methods(cfg.methods)}")

    # ---- plans ----

    def _check(self, p: wire.PlanPrepare) -> str:
        why = self._layout_problem(p)
        if why:
            self._refused.append(p.plan_id)
            self._say("warn", f"plan {p.plan_id} refused: {why}")
        return why

    def _layout_problem(self, p: wire.PlanPrepare) -> str:
        lay = p.layout
        if lay.tp != 1 or lay.pp != 1:
            return (f"layout tp={lay.tp} pp={lay.pp}: this PyTorch DDP job only runs pure data "
                    "parallel layouts")
        if lay.dp != self.world_size:
            w = self.world_size
            return (f"layout dp={lay.dp} but the job has {w} ranks: the agent planned for a "
                    f"world size of {lay.dp}, not this job's {w} (start parapilot deploy with "
                    f"--gpus {w}, or a scenario whose cluster has {w} GPUs)")
        try:
            name = plan_name.decode(p.layout_name)
            shares = plan_shares(p)
        except ValueError as e:
            return str(e)
        # The device map of a deploy layout name (replica i on GPU g[i]); none in other kinds.
        gpus = name.gpus if isinstance(name, plan_name.LayoutPlanName) and name.gpus else None
        if shares and len(shares) != self.world_size:
            return f"{len(shares)} shares for {self.world_size} ranks"
        if not shares and gpus is not None and gpus != list(range(len(gpus))):
            return "device remapping without shares changes nothing here: a DDP rank keeps its device"
        return ""

    def _stage(self, p: wire.PlanPrepare) -> PlanConfig:
        try:
            return self._build_config(p.plan_id, plan_shares(p), p.layout.compression,
                                      p.layout_name)
        except Exception as e:  # the book refuses the plan with the same text
            self._refused.append(p.plan_id)
            self._say("warn", f"plan {p.plan_id} refused: {type(e).__name__}: {e}")
            raise

    def _build_config(self, plan_id: int, shares: List[int],
                      compression: Sequence[wire.LayerCompression], name: str) -> PlanConfig:
        cfg = PlanConfig(plan_id=plan_id, shares=shares, name=name)
        eff = shares or [1] * self.world_size
        if len(eff) != self.world_size:
            raise ValueError(f"{len(eff)} shares for {self.world_size} ranks")
        counts = split_batch(self.global_batch, eff)
        cfg.counts = counts
        # Weight by the samples each rank actually gets (the shares after rounding to the global
        # batch), so the weighted average is exactly the full-batch average.
        cfg.weight = counts[self.rank] / float(sum(counts))
        cfg.methods = _methods_from(compression, self._n_layers)
        cfg.powersgd_states, cfg.uniform_powersgd = _powersgd_states(
            cfg.methods, self._n_layers, self.process_group)
        return cfg

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
            grads = [p.grad.detach().reshape(-1) for p in self._params_by_layer[layer]
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
            if self.client is not None:
                self.client.send(t)
        self._pending = keep[-64:]  # never hold more than a few steps of unresolved events

    def _telemetry(self, rec: _StepRecord) -> wire.Telemetry:
        """The step's Telemetry (hooks._step_telemetry: every duration in [0, cycle]; wait = last
        gradient bucket ready -> optimizer step; compute = cycle - wait; arrive/dp = cycle start
        -> last bucket ready; per collective key the union of its [ready, done] intervals)."""
        return _step_telemetry(rec, self._clock, self.rank)

    # ---- bus ----

    def _send(self, m: wire.Message) -> bool:
        return self.client.send(m) if self.client is not None else False

    @staticmethod
    def _load_secret(secret_file: Optional[str], secret_env: str) -> Secret:
        return load_secret(secret_file, secret_env)

    def _on_connect(self, peer_id: int) -> None:
        """After each handshake (I/O thread): announce the job, then say so."""
        client = self.client
        if client is not None and not client.send(self.job_info(client.max_frame_bytes)):
            self._say("warn", "could not send the JobInfo (invalid for the wire format)")
        if self._outage_since is not None and self._agent_state != "never connected":
            again = f" again after {time.monotonic() - self._outage_since:.1f} s without it"
        else:
            again = ""
        self._agent_state = "connected"
        self._outage_since = None
        self._say("info", f"connected to the agent at {self.agent_address}{again}")

    def _on_disconnect(self, why: str) -> None:
        """After each lost connection or failed attempt (I/O thread): one warning per outage."""
        self.book.drop_uncommitted(f"agent lost ({why})")
        if self._agent_state == "connected":
            self._agent_state = "lost"
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._say("warn", f"no agent at {self.agent_address} ({why}); training continues on "
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

    def _say(self, level: str, text: str) -> None:
        self._log(level, f"rank {self.rank}: {text}")

    def _client_log(self, level: str, line: str) -> None:
        """The bus client's lines: its connects and disconnects are debug detail (the session
        reports them itself), its errors stay errors."""
        self._say("debug" if level in ("debug", "info", "warn") else level, line)

    def _summary(self) -> str:
        cycles = list(self._cycles_ms)
        median = statistics.median(cycles) if cycles else 0.0
        if not self.agent_address:
            agent = "never connected (no agent configured)"
        else:
            agent = self._agent_state
        ids = self.applied_plans
        plans = (f"{ids}" if len(ids) <= 8 else
                 f"[{', '.join(map(str, ids[:3]))}, ..., {', '.join(map(str, ids[-3:]))}] "
                 f"({len(ids)} plans)")
        return (f"{self._steps_run} steps, median step {median:.1f} ms, plans applied "
                f"{plans}, refused {len(self._refused)}, final share "
                f"{self.local_batch}/{self.global_batch}, agent: {agent}")

    def _layer_infos(self) -> List[wire.LayerInfo]:
        out = [wire.LayerInfo() for _ in range(min(self._n_layers, wire.MAX_LAYERS))]
        for p, layer in self._layer_of.items():
            if layer < len(out):
                out[layer].params += p.numel()
                if p.requires_grad:
                    out[layer].grad_bytes += p.numel() * p.element_size()
        return out

