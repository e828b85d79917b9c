"""Gradient compression for the DDP comm hook: which layers a plan compresses and how, and the
collectives that carry the compressed gradients.

Contract:
* Methods (wire.CompressionMethod): NONE (a SUM all-reduce of the weighted gradient), FP16 (the
  same in float16, written back in the bucket's dtype), TOPK (the k = ratio * n largest entries
  of the weighted gradient, one all-gather of values and indices, error feedback: what is not
  sent is added to the next step's gradient), POWERSGD (torch's own PowerSGDState for buckets
  that are PowerSGD throughout, a per-tensor PowerSGD with error feedback otherwise; tensors it
  would not shrink are sent uncompressed).
* Every function here receives the gradients already grouped by the hook (hooks.py) and the
  rank's weight w = share / sum(shares); the result is the share-weighted sum over ranks, i.e.
  the weighted average, in the bucket's own buffer.
* Collectives are issued in the same order on every rank: a mixed bucket's per-tensor PowerSGD
  and torch's PowerSGD followed by other collectives complete synchronously.
* State (top-k residuals, PowerSGD warm starts and error feedback) lives in _CompressorState, one
  per comm hook, keyed per parameter (or per group of parameters); it is touched only inside
  the hook, on the thread running DDP's backward. torch's PowerSGDStates belong to the plan
  (PlanConfig.powersgd_states, built by _powersgd_states when a plan is staged).
* Timing is the caller's: `timed(future, key, nbytes)` wraps a future so that its completion is
  recorded; synchronous collectives append (key, nbytes, t0, mark) to the step record `rec`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d  # unwrapped: never timed as script waits

from . import wire
from .telemetry_keys import ALL_GATHER_DP, ALL_REDUCE_DP

NONE, FP16, TOPK, POWERSGD = (wire.CompressionMethod.NONE, wire.CompressionMethod.FP16,
                              wire.CompressionMethod.TOPK, wire.CompressionMethod.POWERSGD)


# ---------------------------------------------------------------------------------------------
# A plan's compression


def _methods_from(compression: Sequence[wire.LayerCompression], n_layers: int
                  ) -> Dict[int, Tuple[int, float]]:
    out: Dict[int, Tuple[int, float]] = {}
    for c in compression:  # later entries override earlier ones
        for layer in range(c.first_layer, min(c.last_layer, n_layers - 1) + 1):
            out[layer] = (c.method, float(c.parameter))
    return {k: v for k, v in out.items() if v[0] != NONE}


def _powersgd_states(methods: Dict[int, Tuple[int, float]], n_layers: int, process_group
                     ) -> Tuple[Dict[int, Any], Optional[int]]:
    """torch PowerSGDStates for a plan's methods, one per PowerSGD rank (rank r -> state), and
    the rank when every layer is PowerSGD with that one rank (else None)."""
    states: Dict[int, Any] = {}
    uniform: Optional[int] = None
    ranks = sorted({int(v[1]) for v in methods.values() if v[0] == POWERSGD})
    if ranks:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        for r in ranks:
            states[r] = psgd.PowerSGDState(
                process_group=process_group, matrix_approximation_rank=r,
                start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True,
                warm_start=True, random_seed=0)
        if (len(ranks) == 1 and len(methods) == n_layers
                and all(v[0] == POWERSGD for v in methods.values())):
            uniform = ranks[0]
    return states, uniform


def _describe_methods(methods: Dict[int, Tuple[int, float]]) -> str:
    """"none", or layer ranges with their method: "layers 0-2 fp16, layer 4 topk 0.05"."""
    if not methods:
        return "none"
    runs: List[List[Any]] = []  # [first, last, (method, parameter)]
    for layer in sorted(methods):
        if runs and runs[-1][1] == layer - 1 and runs[-1][2] == methods[layer]:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, methods[layer]])
    parts = []
    for first, last, (method, param) in runs:
        name = wire.CompressionMethod.NAMES.get(method, str(method))
        if method == TOPK:
            name += f" {param:g}"
        elif method == POWERSGD:
            name += f" rank {int(param)}"
        where = f"layer {first}" if first == last else f"layers {first}-{last}"
        parts.append(f"{where} {name}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# Compressor state


class _CompressorState:
    """The collectives' group and world size, and the compressors' per-parameter state."""

    def __init__(self, group, world: int):
        self.group = group
        self.world = world
        self.residual: Dict[Any, torch.Tensor] = {}  # top-k error feedback, per parameter
        self.psgd_q: Dict[Any, torch.Tensor] = {}  # per-tensor PowerSGD warm start
        self.psgd_err: Dict[Any, torch.Tensor] = {}  # per-tensor PowerSGD error feedback


# ---------------------------------------------------------------------------------------------
# The methods


def _allreduce_fut(t: torch.Tensor, group) -> torch.futures.Future:
    return c10d.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


def _fp16_bucket(buf: torch.Tensor, w: float, group, timed) -> torch.futures.Future:
    """A bucket that is FP16 throughout: the weighted gradient all-reduced in float16."""
    half = buf.mul(w).to(torch.float16)
    fut = _allreduce_fut(half, group)

    def back(f):
        buf.copy_(f.value()[0])
        return buf
    return timed(fut.then(back), ALL_REDUCE_DP, half.numel() * half.element_size())


def _mixed_bucket(state, bucket, buf: torch.Tensor,
                  groups: Dict[Tuple[int, float], List[Tuple[Any, torch.Tensor]]], w: float,
                  rec, clock, t0, timed) -> torch.futures.Future:
    """A bucket with several methods (`groups`: (method, parameter) -> [(parameter, its slice of
    the bucket buffer `buf`)]): each method on its own slice, then the results written back into
    `buf`. `state` is the hook's state (its .config is the active PlanConfig)."""
    cfg = state.config
    group = state.group
    futs: List[torch.futures.Future] = []
    finishers = []
    psgd_state = cfg.powersgd_states.get(next(iter(cfg.powersgd_states), -1))
    if psgd_state is not None and bucket.is_last():
        psgd_state.maybe_increase_iter(bucket)  # keep torch's iteration count moving
    for (method, param), items in sorted(groups.items()):
        if method == POWERSGD:
            plain = []
            for p, seg in items:
                if seg.dim() >= 2 and _psgd_worth(seg, int(param)):
                    _own_powersgd(state, p, seg, int(param), w, rec, clock, t0)
                else:
                    plain.append((p, seg))
            items, method = plain, NONE
            if not items:
                continue
        flat = torch.cat([seg.reshape(-1) for _, seg in items]) * w
        if method == NONE or method == FP16:
            send = flat if method == NONE else flat.to(torch.float16)
            fut = timed(_allreduce_fut(send, group), ALL_REDUCE_DP,
                        send.numel() * send.element_size())
            futs.append(fut)
            finishers.append((items, send))
        elif method == TOPK:
            futs.append(_topk(state, items, flat, param, timed))
            finishers.append((items, None))

    def finish(_):
        for (items, send), f in zip(finishers, futs):
            result = send if send is not None else f.value()
            off = 0
            for _, seg in items:
                n = seg.numel()
                seg.copy_(result.narrow(0, off, n).view_as(seg))
                off += n
        return buf

    if not futs:
        out = torch.futures.Future()
        out.set_result(buf)
        return out
    return torch.futures.collect_all(futs).then(finish)


def _topk(state: _CompressorState, items, flat: torch.Tensor, ratio: float, timed):
    key = tuple(id(p) for p, _ in items)
    resid = state.residual.get(key)
    if resid is not None and resid.numel() == flat.numel():
        flat.add_(resid)
    n = flat.numel()
    k = max(1, min(n, int(n * ratio)))
    _, idx = flat.abs().topk(k, sorted=False)
    vals = flat[idx]
    new_resid = flat  # what is not sent stays for the next step
    new_resid[idx] = 0
    state.residual[key] = new_resid
    # One all-gather of k values and k int32 indices (bit-cast into the same float tensor).
    packed = torch.cat([vals.to(torch.float32), idx.to(torch.int32).view(torch.float32)])
    gathered = [torch.empty_like(packed) for _ in range(state.world)]
    work = c10d.all_gather(gathered, packed, group=state.group, async_op=True)
    fut = work.get_future()
    dtype, device = flat.dtype, flat.device

    def densify(_):
        dense = torch.zeros(n, dtype=dtype, device=device)
        for g in gathered:
            dense.index_add_(0, g[k:].view(torch.int32).long(), g[:k].to(dtype))
        return dense
    return timed(fut.then(densify), ALL_GATHER_DP, packed.numel() * packed.element_size())


def _psgd_worth(seg: torch.Tensor, rank: int) -> bool:
    n = seg.shape[0]
    m = seg.numel() // max(1, n)
    r = min(n, m, rank)
    return (n + m) * r * 2 < n * m  # torch's min_compression_rate = 2


def _own_powersgd(state: _CompressorState, p, seg: torch.Tensor, rank: int, w: float, rec,
                  clock, t0):
    """Per-tensor PowerSGD with error feedback; synchronous so that collectives stay in the same
    order on every rank. Writes the weighted average's low-rank approximation into `seg`."""
    mat = seg.reshape(seg.shape[0], -1) * w
    n, m = mat.shape
    r = min(n, m, rank)
    err = state.psgd_err.get(p)
    if err is not None and err.shape == mat.shape:
        mat.add_(err)
    q = state.psgd_q.get(p)
    if q is None or q.shape != (m, r):
        g = torch.Generator()
        g.manual_seed(1000003 + rank)  # same on every rank
        q = torch.randn(m, r, generator=g).to(mat.device, mat.dtype)
    pm = mat @ q
    c10d.all_reduce(pm, group=state.group)
    pm = _orthonormalize(pm)
    qn = mat.t() @ pm
    c10d.all_reduce(qn, group=state.group)
    state.psgd_q[p] = qn
    state.psgd_err[p] = mat - pm @ (pm.t() @ mat)  # the part of this rank's gradient not sent
    seg.copy_((pm @ qn.t()).view_as(seg))
    if rec is not None:
        rec.comm.append((ALL_REDUCE_DP, (pm.numel() + qn.numel()) * pm.element_size(), t0,
                         clock.mark()))


def _torch_powersgd(state, bucket, rank: int, timed):
    """A bucket that is PowerSGD of one rank throughout, through torch's powerSGD_hook and the
    plan's PowerSGDState for that rank."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    ps = state.config.powersgd_states[rank]
    buf = bucket.buffer()
    # torch's hook averages (divides the SUM by world size); pre-scaling by weight * world turns
    # that mean into the share-weighted sum.
    buf.mul_(state.config.weight * state.world)
    nbytes = 0
    compressing = ps.iter >= ps.start_powerSGD_iter
    for g in bucket.gradients():
        rows = g.shape[0] if g.dim() > 0 else 1
        cols = g.numel() // max(1, rows)
        r = min(rows, cols, ps.matrix_approximation_rank)
        worth, full, small = psgd._should_compress(rows, cols, r, ps.min_compression_rate)
        nbytes += (small if worth and compressing else full) * buf.element_size()
    fut = psgd.powerSGD_hook(ps, bucket)
    if state.config.uniform_powersgd is None:
        fut.wait()  # other collectives follow: keep the order identical on every rank
    return timed(fut, ALL_REDUCE_DP, nbytes)
