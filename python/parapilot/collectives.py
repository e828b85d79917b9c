"""Waits in the collectives a step runs besides the gradient reduction: DDP's buffer broadcast
and whatever the script calls itself (a loss all-reduce for logging, a barrier, an all-gather).

A rank blocked in a collective is waiting for its peers, not working. Counting that time as the
rank's own work makes a healthy rank that waits for a slow one look slow (DDP broadcasts its
buffers down a tree at every forward: the ranks that relay to a late rank wait inside their
forward). So every collective's blocked time is measured and taken out of the rank's compute.

Contract:
* install(session) wraps torch.distributed's public collectives (the names in _OPS),
  torch.distributed._broadcast_coalesced (DDP's buffer and state broadcast) and, where torch has
  them (2.x), the waits of the functional collectives (torch.distributed._functional_collectives'
  wait_tensor and wait_tensors: what a funcol.all_reduce's result, DTensor's redistributions and
  scripts that log through funcol block in), once per process; uninstall(session) restores them
  when the last session is gone. Scripts that call
  `dist.all_reduce(...)` (the module attribute) are seen; a function imported by name before the
  Session existed (`from torch.distributed import all_reduce`) is not.
* A wrapped call records (key, bytes, t0, t1) with session._note_collective only when it runs on
  the session's training thread, outside the session's own gradient hook, while the session is
  open. t0..t1 is the time the thread was blocked: the call itself for a synchronous call; for
  async_op=True, the returned work's wait() (the returned object forwards everything else to
  torch's work); for a functional collective, its wait (the collective runs from its call to
  then, the rank blocked only in the wait). Keys: "broadcast/buffers" for DDP's broadcast,
  "<op>/script" for the rest (op: all_reduce, broadcast, barrier, all_gather, reduce_scatter,
  reduce, gather, scatter, all_to_all, functional). Nothing is recorded while torch.compile
  traces.
* Calls from other threads (Gloo's callbacks, PowerSGD's future chains) and the session's own
  collectives (it calls torch.distributed.distributed_c10d directly) are never recorded.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .telemetry_keys import BROADCAST_BUFFERS, script_key

# torch.distributed attribute -> the op it is reported as. Missing attributes (older or newer
# torch) are skipped.
_OPS: Dict[str, str] = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "broadcast": "broadcast", "broadcast_object_list": "broadcast",
    "barrier": "barrier", "monitored_barrier": "barrier",
    "all_gather": "all_gather", "all_gather_object": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_coalesced": "all_gather",
    "_all_gather_base": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce": "reduce", "gather": "gather", "gather_object": "gather",
    "scatter": "scatter", "scatter_object_list": "scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
}

# torch.distributed._functional_collectives attribute -> the op it is reported as (torch 2.x).
_FUNCTIONAL_WAITS: Dict[str, str] = {"wait_tensor": "functional", "wait_tensors": "functional"}

_lock = threading.Lock()
_sessions: List[Any] = []  # open sessions, newest last; the newest records
_originals: Dict[Tuple[Any, str], Callable] = {}  # (module, attribute) -> torch's own


def _nbytes(args: tuple, kwargs: dict) -> int:
    """Bytes of the tensors among the first two arguments (the data a collective moves)."""
    total = 0
    for a in list(args[:2]) + [kwargs.get("tensor"), kwargs.get("tensors")]:
        if isinstance(a, torch.Tensor):
            total += a.numel() * a.element_size()
        elif isinstance(a, (list, tuple)):
            total += sum(t.numel() * t.element_size() for t in a if isinstance(t, torch.Tensor))
    return total


def _recorder() -> Optional[Any]:
    s = _sessions[-1] if _sessions else None
    if s is None or s._in_hook or threading.get_ident() != s._thread or _compiling():
        return None
    return s


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _functional_module() -> Optional[Any]:
    """torch.distributed._functional_collectives, where torch has it."""
    try:
        from torch.distributed import _functional_collectives as funcol
    except ImportError:
        return None
    return funcol


class _TimedWork:
    """An async collective's work: wait() is timed as the rank's blocked time."""

    def __init__(self, work: Any, session: Any, key: str, nbytes: int):
        self._work, self._session, self._key, self._nbytes = work, session, key, nbytes

    def wait(self, *args, **kwargs):
        t0 = self._session._clock.mark()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._session._note_collective(self._key, self._nbytes, t0, self._session._clock.mark())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _wrap(name: str, key: str, original: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        s = _recorder()
        if s is None:
            return original(*args, **kwargs)
        nbytes = _nbytes(args, kwargs)
        if kwargs.get("async_op"):
            work = original(*args, **kwargs)
            return _TimedWork(work, s, key, nbytes) if work is not None else work
        t0 = s._clock.mark()
        try:
            return original(*args, **kwargs)
        finally:
            s._note_collective(key, nbytes, t0, s._clock.mark())
    wrapper.__name__ = name
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original
    return wrapper


def install(session: Any) -> None:
    """Starts recording `session`'s collectives (wraps torch.distributed on first use)."""
    with _lock:
        if not _originals:
            names = {(dist, n): script_key(op) for n, op in _OPS.items()}
            names[(dist, "_broadcast_coalesced")] = BROADCAST_BUFFERS
            funcol = _functional_module()
            if funcol is not None:
                names.update({(funcol, n): script_key(op) for n, op in _FUNCTIONAL_WAITS.items()})
            for (module, name), key in names.items():
                original = getattr(module, name, None)
                if original is None:
                    continue
                _originals[(module, name)] = original
                setattr(module, name, _wrap(name, key, original))
        _sessions.append(session)


def uninstall(session: Any) -> None:
    """Stops recording `session`'s collectives; restores torch.distributed after the last."""
    with _lock:
        if session in _sessions:
            _sessions.remove(session)
        if not _sessions:
            for (module, name), original in _originals.items():
                setattr(module, name, original)
            _originals.clear()
