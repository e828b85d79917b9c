"""The DDP communication hook and the step's timing: what runs inside DistributedDataParallel's
gradient synchronisation, and how a step's marks become its Telemetry.

Contract:
* _comm_hook(state, bucket) is registered once per session (ddp_model.register_comm_hook). It
  averages gradients with the active plan's per-rank weights (each rank multiplies its gradient
  by share_r / sum(shares), then a SUM collective) and, per layer (layer_map), applies the
  plan's compression (compressors.py). It returns the future DDP waits on; the bucket's buffer
  holds the weighted average when that future completes.
* The active plan is state.config, a PlanConfig; the session replaces it (never mutates it) at a
  step boundary, on the training thread.
* Timing: every bucket's collective is recorded as (key, bytes, ready mark, done mark) in the
  session's current _StepRecord; the last bucket's ready mark is where the gradient wait
  starts. Marks come from a _Clock: monotonic CPU nanoseconds, or CUDA events that are read only
  once they have completed (never a device sync). _step_telemetry turns a finished record into
  the wire Telemetry: every duration clamped to [0, cycle], wait/dp = last bucket ready ->
  optimizer step, wait/other = the time blocked in the cycle's other collectives (DDP's buffer
  broadcast, the script's own; collectives.py) outside wait/dp, compute = cycle - wait/dp -
  wait/other, arrive/dp = cycle start -> last bucket ready, and per collective key the union
  of its intervals (_union_length).
Nothing here sends anything on the bus or logs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import telemetry_keys as keys, wire
from .compressors import (NONE, FP16, POWERSGD, _CompressorState, _allreduce_fut, _fp16_bucket,
                          _mixed_bucket, _torch_powersgd)

if TYPE_CHECKING:
    from .session import Session


# ---------------------------------------------------------------------------------------------
# Layers and the plan the hook runs


def layer_map(module: torch.nn.Module, layers: Optional[Sequence[torch.nn.Module]] = None
              ) -> Dict[torch.nn.Parameter, int]:
    """Parameter -> layer index. With `layers`, layer i is layers[i] (all its parameters);
    otherwise every module that owns parameters directly is one layer, in registration order.
    Parameters in no listed layer belong to the last layer index + 1."""
    out: Dict[torch.nn.Parameter, int] = {}
    if layers is not None:
        for i, m in enumerate(layers):
            for p in m.parameters():
                out.setdefault(p, i)
        extra = len(layers)
    else:
        i = 0
        for m in module.modules():
            own = list(m.parameters(recurse=False))
            if own:
                for p in own:
                    out.setdefault(p, i)
                i += 1
        extra = i
    for p in module.parameters():
        out.setdefault(p, extra)
    return out


@dataclass
class PlanConfig:
    """Everything the comm hook needs for one plan; built off the training thread, swapped in at
    a step boundary. Immutable after staging except the compressors' own state."""
    plan_id: int = 0
    shares: List[int] = field(default_factory=list)  # empty: uniform
    weight: float = 1.0  # this rank's share / total share
    methods: Dict[int, Tuple[int, float]] = field(default_factory=dict)  # layer -> (method, param)
    name: str = "initial"
    powersgd_states: Dict[int, Any] = field(default_factory=dict)  # rank r -> torch PowerSGDState
    uniform_powersgd: Optional[int] = None  # every layer PowerSGD with this rank
    counts: List[int] = field(default_factory=list)  # samples per rank (split_batch of shares)

    def method_of(self, layer: int) -> Tuple[int, float]:
        return self.methods.get(layer, (NONE, 0.0))


# ---------------------------------------------------------------------------------------------
# Timing


class _Clock:
    """Monotonic CPU timestamps, or CUDA events on GPU (resolved later without syncing)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter_ns()

    def ready(self, marks: Sequence[Any]) -> bool:
        if not self.cuda:
            return True
        return all(m is None or m.query() for m in marks)

    def ms(self, a: Any, b: Any) -> float:
        if a is None or b is None:
            return 0.0
        if self.cuda:
            return max(0.0, a.elapsed_time(b))
        return max(0.0, (b - a) / 1e6)


@dataclass
class _StepRecord:
    step: int
    plan_id: int
    samples: int
    start_ns: int = 0  # the cycle's start (the previous step's end_ns, or the entry)
    end_ns: int = 0
    t_start: Any = None  # mark of the cycle's start (the previous step's t_end, or t_enter)
    t_enter: Any = None  # entry into session.step()
    t_fwd0: Any = None
    t_fwd1: Any = None
    t_last_bucket: Any = None
    t_opt0: Any = None
    t_opt1: Any = None
    t_end: Any = None
    comm: List[Tuple[str, int, Any, Any]] = field(default_factory=list)  # (key, bytes, t0, t1)
    # Other collectives of the cycle (collectives.py): (key, bytes, blocked from, blocked to).
    waits: List[Tuple[str, int, Any, Any]] = field(default_factory=list)
    control_ms: float = 0.0
    layers: List[wire.LayerGradStat] = field(default_factory=list)


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    """Total length covered by [a, b] intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _step_telemetry(rec: _StepRecord, c: _Clock, rank: int) -> wire.Telemetry:
    """The step's Telemetry. Every duration is in [0, cycle], cycle = step_end - step_start
    (on CUDA the events' own cycle when shorter). wait/dp = last gradient bucket ready ->
    optimizer step (else the step's end); wait/other = the time blocked in the cycle's other
    collectives (rec.waits) outside wait/dp; compute = cycle - wait/dp - wait/other; arrive/dp
    = cycle start -> last bucket ready; per collective key: the union of its intervals."""
    wall = max(0.0, (rec.end_ns - rec.start_ns) / 1e6)
    cycle = wall if not c.cuda else min(wall, c.ms(rec.t_start, rec.t_end))

    def at(mark: Any) -> float:  # ms since the cycle start, within the cycle
        return min(max(c.ms(rec.t_start, mark), 0.0), cycle)

    def span(a: Any, b: Any) -> float:
        return min(c.ms(a, b), cycle)

    fwd = span(rec.t_fwd0, rec.t_fwd1)
    fwd_end = rec.t_fwd1 if rec.t_fwd1 is not None else rec.t_enter
    reduced = rec.t_opt0 if rec.t_opt0 is not None else rec.t_end
    last = rec.t_last_bucket if rec.t_last_bucket is not None else reduced
    bwd = span(fwd_end, last)
    wait = span(last, reduced)
    arrive = at(last)
    opt = span(rec.t_opt0, rec.t_opt1)
    # Every interval the rank was blocked in a collective: the gradient wait and the others.
    blocked = [(arrive, arrive + wait)] if wait > 0 else []
    blocked += [(at(t0), max(at(t0), at(t1))) for _, _, t0, t1 in rec.waits]
    all_waits = min(_union_length(blocked), cycle)
    other = max(all_waits - wait, 0.0)
    compute = min(max(cycle - all_waits, 0.0), cycle)
    spans: Dict[str, List[Tuple[float, float]]] = {}
    coll: Dict[str, wire.CollectiveStat] = {}
    for key, nbytes, t0, t1 in rec.comm + rec.waits:
        s = coll.setdefault(key, wire.CollectiveStat())
        a = at(t0)
        spans.setdefault(key, []).append((a, max(a, at(t1))))
        s.bytes += nbytes
        s.calls += 1
    for key, intervals in spans.items():
        coll[key].ms = _union_length(intervals)
    coll[keys.ALL_REDUCE_CONTROL] = wire.CollectiveStat(rec.control_ms, 16, 1)
    coll[keys.PHASE_FORWARD] = wire.CollectiveStat(fwd, 0, 1)
    coll[keys.PHASE_BACKWARD] = wire.CollectiveStat(bwd, 0, 1)
    coll[keys.PHASE_COMM_WAIT] = wire.CollectiveStat(wait, 0, 1)
    coll[keys.PHASE_OPTIMIZER] = wire.CollectiveStat(opt, 0, 1)
    coll[keys.WAIT_DP] = wire.CollectiveStat(wait, 0, 1)
    coll[keys.WAIT_OTHER] = wire.CollectiveStat(other, 0, len(rec.waits))
    coll[keys.ARRIVE_DP] = wire.CollectiveStat(arrive, 0, 1)
    for s in coll.values():
        s.ms = min(max(s.ms, 0.0), cycle, wire.MAX_DURATION_MS)
    t = wire.Telemetry(rank=rank, step=rec.step, step_start_ns=rec.start_ns,
                       step_end_ns=max(rec.end_ns, rec.start_ns),
                       send_time_ns=time.time_ns(), compute_ms=compute, queue_depth=0,
                       collectives=coll, layers=rec.layers)
    keys.set_info(t, keys.PLAN, rec.plan_id)
    keys.set_info(t, keys.SAMPLES, rec.samples)
    return t


# ---------------------------------------------------------------------------------------------
# The communication hook


class _HookState(_CompressorState):
    """State of the DDP comm hook: the active plan and per-parameter compressor state."""

    def __init__(self, session: "Session"):
        super().__init__(session.process_group, session.world_size)
        self.session = session
        self.config = PlanConfig()
        self.bytes_by_key: Dict[str, int] = {}


def _parameter_segments(bucket) -> List[Tuple[Any, torch.Tensor]]:
    buf = bucket.buffer()
    out = []
    off = 0
    for p in bucket.parameters():
        n = p.numel()
        out.append((p, buf.narrow(0, off, n).view(p.shape)))
        off += n
    return out


def _comm_hook(state: "_HookState", bucket):  # no return annotation: DDP checks it literally
    session = state.session
    session._in_hook += 1  # collectives issued from here are the gradient's, timed below
    try:
        return _hook_body(state, session, bucket)
    finally:
        session._in_hook -= 1


def _hook_body(state: "_HookState", session: "Session", bucket):
    cfg = state.config
    rec = session._record
    clock = session._clock
    t0 = clock.mark()
    if rec is not None and bucket.is_last():
        rec.t_last_bucket = t0
    buf = bucket.buffer()
    w = cfg.weight
    group = state.group

    def timed(fut: torch.futures.Future, key: str, nbytes: int) -> torch.futures.Future:
        if rec is None:
            return fut

        def done(f):
            rec.comm.append((key, nbytes, t0, clock.mark()))
            return f.value()
        return fut.then(done)

    # Group the bucket's parameters by compression method.
    groups: Dict[Tuple[int, float], List[Tuple[Any, torch.Tensor]]] = {}
    segments = _parameter_segments(bucket) if cfg.methods else None
    if segments is None:
        groups[(NONE, 0.0)] = []
    else:
        lmap = session._layer_of
        for p, seg in segments:
            groups.setdefault(cfg.method_of(lmap.get(p, -1)), []).append((p, seg))

    # Fast path: one method for the whole bucket.
    if len(groups) == 1:
        (method, param), = groups.keys()
        if method == NONE:
            buf.mul_(w)
            fut = _allreduce_fut(buf, group)
            if rec is None:
                return fut.then(lambda f: f.value()[0])
            nbytes = buf.numel() * buf.element_size()

            def done(f):  # one Python callback per bucket: timing and the result together
                rec.comm.append((keys.ALL_REDUCE_DP, nbytes, t0, clock.mark()))
                return f.value()[0]
            return fut.then(done)
        if method == FP16:
            return _fp16_bucket(buf, w, group, timed)
        if method == POWERSGD and int(param) in cfg.powersgd_states:
            return _torch_powersgd(state, bucket, int(param), timed)

    # General path: each method on its own slice, then write the results back.
    return _mixed_bucket(state, bucket, buf, groups, w, rec, clock, t0, timed)
