"""PyTorch DDP integration: per-step telemetry to the parapilot agent, and the agent's decisions
(per-rank batch shares, per-layer gradient compression) applied inside DistributedDataParallel.

Add to an existing DDP script (see docs/pytorch.md):

    session = parapilot.pytorch.Session(ddp_model, optimizer, global_batch=64)
    loader = DataLoader(dataset, batch_sampler=session.batch_sampler(dataset))
    for x, y in loader:
        with session.step():
            loss = loss_fn(ddp_model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
        if session.should_stop: break
    session.close()

What it does:
* Telemetry per step: the cycle (from the end of the previous step to the end of this one, so
  data loading between steps counts), the wait in the gradient collectives (last gradient bucket
  ready to the optimizer step), compute = cycle - wait (everything the rank did itself: data,
  host work, forward, backward, optimizer), the phases, each collective's time (the union of
  its buckets' intervals), bytes and calls, and (every grad_stats_every steps) per-layer
  gradient norms. CPU timings use the monotonic clock; CUDA timings use CUDA events read back
  once they have completed (never a device sync).
* On every connection to the agent, a JobInfo: rank, world size, global batch, what this job can
  switch (batch shares, compression), per-layer parameter and gradient sizes.
* A DDP communication hook that averages gradients with the agent's per-rank batch shares as
  weights (each rank multiplies its gradient by share_r / sum(shares), then a SUM all-reduce) and
  applies per-layer compression: fp16, top-k with error feedback, PowerSGD (torch's own
  PowerSGDState for buckets that are PowerSGD throughout, a per-tensor PowerSGD otherwise).
* The two-phase switch: PlanPrepare is answered PlanReady once the new hook configuration is
  built (or refused when the layout is not a pure data-parallel layout of this job's size); a
  committed plan is applied at a step boundary that all ranks agree on through a tiny MAX
  all-reduce on a separate Gloo group (CPU), then acknowledged.
* The agent going away changes nothing: the job keeps training on its last plan while the client
  reconnects in the background.
* What happens (connection, outages, plans applied, refused or aborted, a summary at close) is
  logged, one line each, to logging.getLogger("parapilot"); no handler is configured here.

What it never changes: the model, the loss, the optimizer and its hyper-parameters, the global
batch size, the data order (only which rank reads which slice of each global batch).

Thread-safety: a Session belongs to the training thread. Bus messages are handled on the
client's I/O thread (staging only builds new objects; nothing the training thread uses is
modified until the step boundary).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from . import wire
from .auth import Secret, SecretError, load_secret
from .client import Client, logging_logger
from .plans import PlanBook

__all__ = ["Session", "ShareBatchSampler", "split_batch", "PlanConfig", "layer_map",
           "plan_shares", "shares_from_layout_name"]

NONE, FP16, TOPK, POWERSGD = (wire.CompressionMethod.NONE, wire.CompressionMethod.FP16,
                              wire.CompressionMethod.TOPK, wire.CompressionMethod.POWERSGD)


# ---------------------------------------------------------------------------------------------
# Shares and the data split


def split_batch(global_batch: int, shares: Sequence[int]) -> List[int]:
    """Samples per rank: global_batch split in proportion to `shares` (largest remainder, every
    rank at least 1, sums to global_batch). Empty shares: as even as possible."""
    n = len(shares)
    if n == 0:
        raise ValueError("no ranks")
    if global_batch < n:
        raise ValueError(f"global batch {global_batch} is smaller than the {n} ranks")
    total = float(sum(shares))
    exact = [global_batch * s / total for s in shares]
    counts = [max(1, int(math.floor(e))) for e in exact]
    # Largest remainders first, ties to the lower rank; then take back from the largest if the
    # minimum of 1 overshot.
    order = sorted(range(n), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    i = 0
    while sum(counts) < global_batch:
        counts[order[i % n]] += 1
        i += 1
    while sum(counts) > global_batch:
        j = max(range(n), key=lambda k: (counts[k], -k))
        counts[j] -= 1
    return counts


class ShareBatchSampler(Sampler):
    """Yields this rank's indices of each global batch, split by the session's current shares.

    Every rank walks the same permutation (seeded by seed + epoch) in global batches of
    `global_batch` samples (the last partial batch is dropped); rank r takes the slice that
    split_batch(global_batch, shares)[r] gives it. Shares are read when each batch is drawn, so a
    plan applied at a step boundary splits the next batch (with DataLoader worker processes the
    indices of prefetched batches were already drawn; use num_workers=0, or accept that a share
    change reaches the data a few steps after the gradient weights).
    """

    def __init__(self, dataset_len: int, session: "Session", shuffle: bool = True,
                 seed: int = 0):
        self.n = int(dataset_len)
        self.session = session
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n // self.session.global_batch

    def __iter__(self) -> Iterator[List[int]]:
        b = self.session.global_batch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        for start in range(0, self.n - b + 1, b):
            counts = self.session._hook.config.counts
            first = sum(counts[:self.session.rank])
            yield order[start + first:start + first + counts[self.session.rank]]


# ---------------------------------------------------------------------------------------------
# Layers and plan configuration


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


def shares_from_layout_name(name: str) -> List[int]:
    """The `sh=` field of a deploy layout name ("dp2-tp1-pp1-mb1-z1;sc=1f1b;sh=3,1*2" -> [3, 1,
    1]): `parapilot deploy` carries elastic shares there when Layout.dp_shares is empty."""
    for part in name.split(";")[1:]:
        if part.startswith("sh="):
            out: List[int] = []
            for item in part[3:].split(","):
                value, _, count = item.partition("*")
                n = int(count) if count else 1
                if n < 1 or n > wire.MAX_RANKS:
                    raise ValueError(f"layout name shares '{part}': bad repeat count")
                out.extend([int(value)] * n)
            if any(v < 1 for v in out):
                raise ValueError(f"layout name shares '{part}': shares must be >= 1")
            return out
    return []


def _device_map_from_layout_name(name: str) -> Optional[List[int]]:
    for part in name.split(";")[1:]:
        if part.startswith("g="):
            out: List[int] = []
            for item in part[2:].split(","):
                a, _, b = item.partition("-")
                out.extend(range(int(a), int(b or a) + 1))
            return out
    return None


def plan_shares(p: wire.PlanPrepare) -> List[int]:
    """Samples per rank of a PlanPrepare: Layout.dp_shares, else the layout name's `sh=`; both
    are per data-parallel replica in layout order. When the name also maps replicas to devices
    (`g=`, replica i on GPU g[i]) and the layout is pure data parallel, a rank keeps its device
    and takes the share of the replica placed there: share_of_rank[g[i]] = shares[i]."""
    shares = list(p.layout.dp_shares) or shares_from_layout_name(p.layout_name)
    gpus = _device_map_from_layout_name(p.layout_name)
    if not shares or gpus is None or gpus == list(range(len(gpus))):
        return shares
    if sorted(gpus) != list(range(len(shares))):
        raise ValueError(f"device map of {len(gpus)} entries is not a permutation of the "
                         f"{len(shares)} replicas")
    out = [0] * len(shares)
    for replica, gpu in enumerate(gpus):
        out[gpu] = shares[replica]
    return out


def _methods_from(compression: Sequence[wire.LayerCompression], n_layers: int
                  ) -> Dict[int, Tuple[int, float]]:
    out: Dict[int, Tuple[int, float]] = {}
    for c in compression:  # later entries override earlier ones
        for layer in range(c.first_layer, min(c.last_layer, n_layers - 1) + 1):
            out[layer] = (c.method, float(c.parameter))
    return {k: v for k, v in out.items() if v[0] != NONE}


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
    control_ms: float = 0.0
    layers: List[wire.LayerGradStat] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The communication hook


class _HookState:
    """State of the DDP comm hook: the active plan and per-parameter compressor state."""

    def __init__(self, session: "Session"):
        self.session = session
        self.config = PlanConfig()
        self.group = session.process_group
        self.world = session.world_size
        self.residual: Dict[Any, torch.Tensor] = {}  # top-k error feedback, per parameter
        self.psgd_q: Dict[Any, torch.Tensor] = {}  # per-tensor PowerSGD warm start
        self.psgd_err: Dict[Any, torch.Tensor] = {}  # per-tensor PowerSGD error feedback
        self.bytes_by_key: Dict[str, int] = {}


def _allreduce_fut(t: torch.Tensor, group) -> torch.futures.Future:
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


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
                rec.comm.append(("all_reduce/dp", nbytes, t0, clock.mark()))
                return f.value()[0]
            return fut.then(done)
        if method == FP16:
            half = buf.mul(w).to(torch.float16)
            fut = _allreduce_fut(half, group)

            def back(f):
                buf.copy_(f.value()[0])
                return buf
            return timed(fut.then(back), "all_reduce/dp", half.numel() * half.element_size())
        if method == POWERSGD and int(param) in cfg.powersgd_states:
            return _torch_powersgd(state, bucket, int(param), timed)

    # General path: each method on its own slice, then write the results back.
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
            fut = timed(_allreduce_fut(send, group), "all_reduce/dp",
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


def _topk(state: _HookState, items, flat: torch.Tensor, ratio: float, timed):
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
    work = dist.all_gather(gathered, packed, group=state.group, async_op=True)
    fut = work.get_future()
    dtype, device = flat.dtype, flat.device

    def densify(_):
        dense = torch.zeros(n, dtype=dtype, device=device)
        for g in gathered:
            dense.index_add_(0, g[k:].view(torch.int32).long(), g[:k].to(dtype))
        return dense
    return timed(fut.then(densify), "all_gather/dp", packed.numel() * packed.element_size())


def _psgd_worth(seg: torch.Tensor, rank: int) -> bool:
    n = seg.shape[0]
    m = seg.numel() // max(1, n)
    r = min(n, m, rank)
    return (n + m) * r * 2 < n * m  # torch's min_compression_rate = 2


def _own_powersgd(state: _HookState, p, seg: torch.Tensor, rank: int, w: float, rec, clock, t0):
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
    dist.all_reduce(pm, group=state.group)
    pm = _orthonormalize(pm)
    qn = mat.t() @ pm
    dist.all_reduce(qn, group=state.group)
    state.psgd_q[p] = qn
    state.psgd_err[p] = mat - pm @ (pm.t() @ mat)  # the part of this rank's gradient not sent
    seg.copy_((pm @ qn.t()).view_as(seg))
    if rec is not None:
        rec.comm.append(("all_reduce/dp", (pm.numel() + qn.numel()) * pm.element_size(), t0,
                         clock.mark()))


def _torch_powersgd(state: _HookState, bucket, rank: int, timed):
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
    return timed(fut, "all_reduce/dp", nbytes)


# ---------------------------------------------------------------------------------------------
# The session


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
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                 optimizer: Optional[torch.optim.Optimizer] = None, *, global_batch: int,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET",
                 layers: Optional[Sequence[torch.nn.Module]] = None,
                 process_group=None, grad_stats_every: int = 10, start_step: int = 0,
                 initial_shares: Optional[Sequence[int]] = None, log=None,
                 client_options: Optional[dict] = None):
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
        self._control_group = dist.new_group(backend="gloo")
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

    @contextlib.contextmanager
    def step(self):
        """Wraps one training step (forward, backward, optimizer step). On exit the step's
        telemetry is queued and, at this boundary, the ranks agree on a committed plan. The
        step's cycle runs from the end of the previous step (what runs between two steps, such
        as the DataLoader's next(), belongs to the later one) to the end of this one."""
        self._begin()
        try:
            yield self
        finally:
            self._end()

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
        if self._ctl_work is not None:  # every rank started it; finish it before leaving
            self._ctl_work.wait()
            self._ctl_work = None
            self._ctl_tensor = None
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
        if self._prev_end is not None:  # the cycle began where the previous step ended
            rec.start_ns, rec.t_start = self._prev_end
        else:
            rec.start_ns, rec.t_start = now_ns, rec.t_enter
        self._record = rec

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
        self._ctl_work = dist.all_reduce(self._ctl_tensor, op=dist.ReduceOp.MAX,
                                         group=self._control_group, async_op=True)

    def _switch(self, plan_id: int) -> None:
        current = self.plan_id
        staged = self.book.get(plan_id)
        missing = torch.tensor([0 if staged is not None else 1], dtype=torch.int64)
        dist.all_reduce(missing, op=dist.ReduceOp.MAX, group=self._control_group)
        if int(missing[0]):
            self._refused.append(plan_id)
            self._say("warn", f"plan {plan_id} refused: committed but not staged on every "
                              f"rank; staying on plan {current}")
            self.book.missed(plan_id, f"rank {self.rank}: plan {plan_id} was committed but "
                             f"not staged on every rank; staying on plan {current}")
            return
        cfg = staged.staged
        self._hook.config = cfg
        self.applied_plans.append(plan_id)
        self.book.applied(plan_id)
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
            shares = plan_shares(p)
            gpus = _device_map_from_layout_name(p.layout_name)
        except ValueError as e:
            return str(e)
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
        ranks = sorted({int(v[1]) for v in cfg.methods.values() if v[0] == POWERSGD})
        if ranks:
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            for r in ranks:
                cfg.powersgd_states[r] = psgd.PowerSGDState(
                    process_group=self.process_group, matrix_approximation_rank=r,
                    start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True,
                    warm_start=True, random_seed=0)
            if (len(ranks) == 1 and len(cfg.methods) == self._n_layers
                    and all(v[0] == POWERSGD for v in cfg.methods.values())):
                cfg.uniform_powersgd = ranks[0]
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
        """The step's Telemetry. Every duration is in [0, cycle], cycle = step_end - step_start
        (on CUDA the events' own cycle when shorter). wait = last gradient bucket ready ->
        optimizer step (else the step's end); compute = cycle - wait; arrive/dp = cycle start ->
        last bucket ready; per collective key: the union of its [ready, done] intervals."""
        c = self._clock
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
        compute = min(max(cycle - wait, 0.0), cycle)
        spans: Dict[str, List[Tuple[float, float]]] = {}
        coll: Dict[str, wire.CollectiveStat] = {}
        for key, nbytes, t0, t1 in rec.comm:
            s = coll.setdefault(key, wire.CollectiveStat())
            a = at(t0)
            spans.setdefault(key, []).append((a, max(a, at(t1))))
            s.bytes += nbytes
            s.calls += 1
        for key, intervals in spans.items():
            coll[key].ms = _union_length(intervals)
        coll["all_reduce/control"] = wire.CollectiveStat(rec.control_ms, 16, 1)
        coll["phase/forward"] = wire.CollectiveStat(fwd, 0, 1)
        coll["phase/backward"] = wire.CollectiveStat(bwd, 0, 1)
        coll["phase/comm_wait"] = wire.CollectiveStat(wait, 0, 1)
        coll["phase/optimizer"] = wire.CollectiveStat(opt, 0, 1)
        coll["wait/dp"] = wire.CollectiveStat(wait, 0, 1)
        coll["arrive/dp"] = wire.CollectiveStat(arrive, 0, 1)
        coll["info/plan"] = wire.CollectiveStat(0.0, rec.plan_id, 0)
        coll["info/samples"] = wire.CollectiveStat(0.0, rec.samples, 0)
        for s in coll.values():
            s.ms = min(max(s.ms, 0.0), cycle, wire.MAX_DURATION_MS)
        return wire.Telemetry(rank=self.rank, step=rec.step, step_start_ns=rec.start_ns,
                              step_end_ns=max(rec.end_ns, rec.start_ns),
                              send_time_ns=time.time_ns(), compute_ms=compute, queue_depth=0,
                              collectives=coll, layers=rec.layers)

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


def _union_length(intervals: List[Tuple[float, float]]) -> float:
    """Total length covered by [a, b] intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


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
