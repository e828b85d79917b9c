"""What a rank says when a collective among the ranks fails: a peer process lost, or a link
between ranks broken (the mirror of the C++ worker's failure census, env/live/collectives.h).

Contract:
* is_collective_failure(e): whether an exception raised by torch.distributed (inside DDP's
  backward, the session's boundary agreement, a script's own collective) is a collective that
  failed among the ranks: a closed or reset connection, a timeout, a Gloo or NCCL error.
* census(store, rank, world_size, note, wait_s): after such a failure, says this rank's note
  (key "parapilot/note/<rank>") and marks it alive (counter "parapilot/alive/<rank>") in the
  job's store, and waits up to wait_s for every other rank's mark. Returns (lost, notes): the ranks whose mark did not come ("rank 2",
  "ranks 1, 3"; "" when all answered; "rank 0 (the job's store is unreachable)" when the store,
  which rank 0 hosts, cannot be reached), and the other ranks' notes ("rank 1: NOTE; ...").
  Rank 0, which hosts the store, returns only once every rank that answered has read the census
  (or wait_s more have passed), so that its exit does not cut the others' reads short.
* cut_peer_links(keep_ports): shuts down (both directions) every connected TCP socket of this
  process (Linux, /proc/self/fd) whose local or remote port is not in keep_ports. With the
  job's store (MASTER_PORT) and the agent's bus kept, that is every connection of the rank's
  process groups: its peers see them close, and its own next collective over them fails.
  Returns how many were cut. The session calls it after a failed collective, so that a peer
  blocked on this rank fails at once instead of at its timeout; tests call it to cut a link.
* PeerLost: what Session.step() raises instead (a RuntimeError; the original is its __cause__).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Iterable, Optional, Tuple

# Substrings of the errors torch.distributed raises when a collective fails among the ranks.
_MARKERS = ("connection closed", "connection reset", "broken pipe", "timed out", "gloo", "nccl")


def is_collective_failure(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, RuntimeError) and not isinstance(e, PeerLost) and \
        any(m in text for m in _MARKERS)


def census(store: Optional[Any], rank: int, world_size: int, note: str,
           wait_s: float) -> Tuple[str, str]:
    if store is None:
        return "", ""
    alive = lambda r: f"parapilot/alive/{r}"
    said = lambda r: f"parapilot/note/{r}"
    missing = []
    notes = []
    try:
        store.set(said(rank), note)  # before the mark: a rank seen alive has said its note
        store.add(alive(rank), 1)
        deadline = time.monotonic() + wait_s
        while True:  # add(key, 0) reads a counter without waiting (no check() on every store)
            missing = [r for r in range(world_size) if r != rank and store.add(alive(r), 0) == 0]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for r in range(world_size):
            if r == rank or r in missing:
                continue
            text = store.get(said(r)).decode("utf-8", "replace")
            if text:
                notes.append(f"rank {r}: {text}")
        # Rank 0 hosts the store: it stays until every rank that answered has read it.
        read = store.add("parapilot/census_read", 1)
        while rank == 0 and read < world_size - len(missing) and time.monotonic() < deadline + wait_s:
            time.sleep(0.05)
            read = store.add("parapilot/census_read", 0)
    except RuntimeError:
        return "rank 0 (the job's store is unreachable)", ""
    lost = ""
    if missing:
        lost = ("rank " if len(missing) == 1 else "ranks ") + ", ".join(map(str, missing))
    return lost, "; ".join(notes)


def cut_peer_links(keep_ports: Iterable[int]) -> int:
    keep = set(int(p) for p in keep_ports)
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(name))
        except (ValueError, OSError):
            continue  # gone (the listing's own descriptor)
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue  # not a socket
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            local, remote = s.getsockname()[1], s.getpeername()[1]
            if local in keep or remote in keep:
                continue
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            continue  # a listening socket, or not connected
        finally:
            s.close()
    return cut


class PeerLost(RuntimeError):
    """A collective among the ranks failed: a peer process is gone or a link between ranks
    broke. The session applies no plan after it; its message names what was lost (the ranks
    with no answer in the job's store, or what the ranks said of the broken link) and the plan
    committed but not applied, if any.

    rank: this rank. step: the step that failed. lost: the ranks with no answer ("" when every
    rank answered). plan_id: the plan in force (unchanged). pending_plan: a plan committed on
    this rank but not applied (0: none)."""

    def __init__(self, message: str, *, rank: int, step: int, lost: str, plan_id: int,
                 pending_plan: int):
        super().__init__(message)
        self.rank, self.step, self.lost = rank, step, lost
        self.plan_id, self.pending_plan = plan_id, pending_plan
