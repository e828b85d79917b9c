"""FSDPSession: a model sharded with FSDP2 (`fully_shard`) on elastic per-rank batch shares, with
the same plans as a DDP job (Layout.dp_shares or the layout name's `sh=`; capability DP_SHARES;
no compression).

Contract:
* FSDPSession(model, optimizer, global_batch=...) needs `model` (the outermost module) wrapped
  with fully_shard, on one flat mesh of the whole world (no HSDP), with FSDP2's default gradient
  reduction (the average over the ranks: no set_gradient_divide_factor). It never changes the
  model, the optimizer, the global batch or the data order.
* The update equals the full-batch update when the script multiplies each rank's loss — the mean
  over its own samples — by `session.loss_scale` (= world size x this rank's samples / global
  batch; 1.0 on even shares), or calls `session.scale_loss(loss)`: FSDP2 averages the ranks'
  gradients, so rank r's gradient enters the update with weight loss_scale_r / world size =
  samples_r / global batch, the full-batch mean. loss_scale reads the plan in force for the
  step being run (read it inside `with session.step():`).
* FSDP2's collectives are timed through its custom-collective API (set_custom_all_gather /
  set_custom_reduce_scatter on every FSDP module, wrapping the collective each one had): the time
  the training thread is blocked in a parameter all-gather is a wait (wait/other, key
  all_gather/fsdp), in a gradient reduce-scatter a gradient wait (wait/dp, key
  reduce_scatter/fsdp); compute = cycle - every wait, as for DDP. An all-gather FSDP2 issues
  with async_op=True (explicit unshard(async_op=True) prefetching) is timed at its launch only.
* Raises FSDPUnavailable (a RuntimeError) where this torch has no FSDP2 with that API, and
  ValueError naming the problem for a model FSDPSession cannot weight exactly.
Thread-safety: as StepSession (step_session.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import telemetry_keys as keys, wire
from .hooks import _Clock, _StepRecord, _union_length
from .share_session import ShareSession


class FSDPUnavailable(RuntimeError):
    """This torch has no FSDP2 with the custom-collective API FSDPSession times it through."""


def _fsdp_api():
    """(FSDPModule, AllGather, ReduceScatter) of this torch, or FSDPUnavailable."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except Exception as e:  # ImportError; Debian's torch 1.13 fails on Python 3.11 (ValueError)
        raise FSDPUnavailable(
            f"FSDPSession needs FSDP2 (torch.distributed.fsdp.fully_shard) with its custom "
            f"collectives (set_custom_all_gather, set_custom_reduce_scatter); torch "
            f"{torch.__version__} has not ({type(e).__name__}: {str(e)[:200]})") from None
    if not hasattr(FSDPModule, "set_custom_all_gather"):
        raise FSDPUnavailable(f"FSDPSession: FSDP2 of torch {torch.__version__} has no "
                              "set_custom_all_gather / set_custom_reduce_scatter")
    return FSDPModule, AllGather, ReduceScatter


def _timed(base: type, key: str) -> type:
    """A subclass of FSDP2's AllGather or ReduceScatter that runs the collective it wraps and
    tells the session how long the training thread was blocked in it."""

    class Timed(base):
        def __init__(self, inner: Any, session: "FSDPSession"):
            self._inner, self._session = inner, session

        def allocate(self, *args, **kwargs):
            return self._inner.allocate(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            s = self._session
            if not s._timing or threading.get_ident() != s._thread:
                return self._inner(*args, **kwargs)
            inp = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
            nbytes = inp.numel() * inp.element_size() if isinstance(inp, torch.Tensor) else 0
            t0 = s._clock.mark()
            s._in_hook += 1  # collectives.py does not record it again as the script's
            try:
                return self._inner(*args, **kwargs)
            finally:
                s._in_hook -= 1
                s._note_fsdp(key, nbytes, t0, s._clock.mark())

    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed


def _param_groups(module) -> list:
    """FSDP2's parameter groups of one FSDP module ([] where this torch keeps them elsewhere)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    return list(getattr(state, "_fsdp_param_groups", []) or [])


def _model_problem(modules: list, world_size: int) -> str:
    """Why FSDPSession cannot weight this model's gradients exactly; "" when it can."""
    for m in modules:
        groups = _param_groups(m)
        if len(groups) > 1:
            return (f"{type(m).__name__} has {len(groups)} FSDP parameter groups (a per-"
                    "parameter mesh): FSDP2's custom collectives need one per module")
        for g in groups:
            factor = getattr(g, "gradient_divide_factor", None)
            if factor is not None:
                return (f"{type(m).__name__} sets a gradient divide factor ({factor}): "
                        "FSDPSession's loss_scale assumes FSDP2's default average over the "
                        "ranks (leave set_gradient_divide_factor unset)")
            mesh = getattr(getattr(g, "mesh_info", None), "mesh", None)
            if mesh is not None and (mesh.ndim != 1 or mesh.size() != world_size):
                return (f"{type(m).__name__} is sharded on a mesh of shape "
                        f"{tuple(mesh.shape)}: FSDPSession runs one flat mesh of all "
                        f"{world_size} ranks (no HSDP)")
    return ""


class FSDPSession(ShareSession):
    """Connects an FSDP2 training job to the parapilot agent. See the module docstring.

    model: the outermost module, wrapped with fully_shard (its submodules usually too).
    optimizer: the job's optimizer (timed, never changed); None to skip optimizer timing.
    global_batch, initial_shares, agent, secret_file, secret_env, layers, process_group,
    grad_stats_every, start_step, log, client_options, control_timeout_s: as Session (DDP).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 *, global_batch: int, agent: Optional[str] = None,
                 secret_file: Optional[str] = None, secret_env: str = "PARAPILOT_SECRET",
                 layers: Optional[Sequence[torch.nn.Module]] = None, process_group=None,
                 grad_stats_every: int = 10, start_step: int = 0,
                 initial_shares: Optional[Sequence[int]] = None, log=None,
                 client_options: Optional[dict] = None, control_timeout_s: float = 1800.0):
        if not torch.distributed.is_initialized():
            raise RuntimeError("parapilot: FSDPSession needs torch.distributed initialised "
                               "(init_process_group) first")
        fsdp_module, all_gather, reduce_scatter = _fsdp_api()
        if not isinstance(model, fsdp_module):
            raise ValueError(f"FSDPSession: the model ({type(model).__name__}) is not wrapped "
                             "with fully_shard; wrap its layers and then the model itself")
        modules = [m for m in model.modules() if isinstance(m, fsdp_module)]
        world = torch.distributed.get_world_size(process_group)
        why = _model_problem(modules, world)
        if why:
            raise ValueError(f"FSDPSession: {why}")
        self.model = model
        self._timing = False  # the timed collectives record only once the session is built
        super().__init__(model, optimizer, global_batch=global_batch,
                         framework=f"pytorch-fsdp2 {torch.__version__}",
                         capabilities=wire.Capability.DP_SHARES, initial_shares=initial_shares,
                         job_kind="FSDP2", agent=agent, secret_file=secret_file,
                         secret_env=secret_env, layers=layers, process_group=process_group,
                         grad_stats_every=grad_stats_every, start_step=start_step, log=log,
                         client_options=client_options, control_timeout_s=control_timeout_s)
        timed_ag = _timed(all_gather, keys.ALL_GATHER_FSDP)
        timed_rs = _timed(reduce_scatter, keys.REDUCE_SCATTER_FSDP)
        for m in modules:
            for g in _param_groups(m):
                m.set_custom_all_gather(timed_ag(g._all_gather_comm, self))
                m.set_custom_reduce_scatter(timed_rs(g._reduce_scatter_comm, self))
        self._timing = True

    # ---- public API ----

    @property
    def loss_scale(self) -> float:
        """What this rank multiplies its loss (the mean over its own samples) by, so that FSDP2's
        average of the ranks' gradients is the full-batch gradient: world size x this rank's
        samples / global batch, under the plan in force (1.0 on even shares)."""
        return self.world_size * self.local_batch / float(self.global_batch)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * loss_scale (see loss_scale)."""
        return loss * self.loss_scale

    def close(self, flush_timeout: float = 2.0) -> None:
        """As StepSession.close(); FSDP2's collectives stay wrapped but are no longer timed."""
        self._timing = False
        super().close(flush_timeout)

    # ---- StepSession's hooks ----

    def _note_fsdp(self, key: str, nbytes: int, t0: Any, t1: Any) -> None:
        """An FSDP2 collective the training thread was blocked in from t0 to t1: the step's
        (rec.comm), or between steps one of the next cycle's other waits."""
        rec = self._record
        if rec is not None:
            rec.comm.append((key, nbytes, t0, t1))
        else:
            self._between.append((key, nbytes, t0, t1))

    def _telemetry(self, rec: _StepRecord) -> wire.Telemetry:
        return _fsdp_step_telemetry(rec, self._clock, self.rank)


def _fsdp_step_telemetry(rec: _StepRecord, c: _Clock, rank: int) -> wire.Telemetry:
    """The step's Telemetry. Every duration is in [0, cycle], cycle = step_end - step_start (on
    CUDA the events' own cycle when shorter). wait/dp = the time blocked in the gradient
    reduce-scatters (the union of their intervals); wait/other = the time blocked in the
    parameter all-gathers and the cycle's other collectives (rec.waits) outside wait/dp;
    compute = cycle - wait/dp - wait/other; arrive/dp = cycle start -> the last reduce-scatter's
    start (the last gradient ready); per collective key: the union of its intervals."""
    wall = max(0.0, (rec.end_ns - rec.start_ns) / 1e6)
    cycle = wall if not c.cuda else min(wall, c.ms(rec.t_start, rec.t_end))

    def at(mark: Any) -> float:  # ms since the cycle start, within the cycle
        return min(max(c.ms(rec.t_start, mark), 0.0), cycle)

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
    gradient = spans.get(keys.REDUCE_SCATTER_FSDP, [])
    wait = min(_union_length(gradient), cycle)
    all_waits = min(_union_length([i for v in spans.values() for i in v]), cycle)
    other = max(all_waits - wait, 0.0)
    compute = min(max(cycle - all_waits, 0.0), cycle)
    end_of_grads = max((b for _, b in gradient), default=None)
    arrive = max((a for a, _ in gradient), default=at(rec.t_opt0 or rec.t_end))
    fwd_end = at(rec.t_fwd1) if rec.t_fwd1 is not None else at(rec.t_enter)
    backward_end = end_of_grads if end_of_grads is not None else at(rec.t_opt0 or rec.t_end)
    coll[keys.ALL_REDUCE_CONTROL] = wire.CollectiveStat(rec.control_ms, 16, 1)
    coll[keys.PHASE_FORWARD] = wire.CollectiveStat(c.ms(rec.t_fwd0, rec.t_fwd1), 0, 1)
    coll[keys.PHASE_BACKWARD] = wire.CollectiveStat(max(0.0, backward_end - fwd_end), 0, 1)
    coll[keys.PHASE_COMM_WAIT] = wire.CollectiveStat(wait, 0, 1)
    coll[keys.PHASE_OPTIMIZER] = wire.CollectiveStat(c.ms(rec.t_opt0, rec.t_opt1), 0, 1)
    coll[keys.WAIT_DP] = wire.CollectiveStat(wait, 0, 1)
    coll[keys.WAIT_OTHER] = wire.CollectiveStat(
        other, 0, sum(1 for k, *_ in rec.comm + rec.waits if k != keys.REDUCE_SCATTER_FSDP))
    coll[keys.ARRIVE_DP] = wire.CollectiveStat(arrive, 0, 1)
    for s in coll.values():
        s.ms = min(max(s.ms, 0.0), cycle, wire.MAX_DURATION_MS)
    t = wire.Telemetry(rank=rank, step=rec.step, step_start_ns=rec.start_ns,
                       step_end_ns=max(rec.end_ns, rec.start_ns),
                       send_time_ns=time.time_ns(), compute_ms=compute,
                       queue_depth=0, collectives=coll, layers=rec.layers)
    keys.set_info(t, keys.PLAN, rec.plan_id)
    keys.set_info(t, keys.SAMPLES, rec.samples)
    return t
