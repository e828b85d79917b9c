"""Streams moved pipeline blocks between ranks at a switch (torch.distributed point-to-point).

exchange(outgoing, incoming, group) runs on every rank of `group` at the same boundary: rank r
sends, for every destination d, the states of the blocks it gives d (pipeline_state.to_bytes of
{block: state}) and receives, from every source, the blocks it takes. Sizes go first (one int64
per pair), then the bytes; every send and receive is posted at once (isend / irecv), so no order
of pairs can deadlock. Returns {block: state} received and the bytes sent.

Errors: a failed send or receive raises what torch.distributed raised (the session turns it into
PeerLost, as for any collective that fails among the ranks).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
import torch.distributed as dist

from . import pipeline_state

__all__ = ["exchange"]


def exchange(outgoing: Mapping[int, Mapping[int, dict]], incoming: List[int], group,
             ) -> Tuple[Dict[int, dict], int]:
    """outgoing: {dst rank: {block: state}}; incoming: the source ranks this rank takes blocks
    from. Ranks are ranks of `group`. Returns ({block: state} received, bytes sent)."""
    payloads = {dst: pipeline_state.to_bytes(states) for dst, states in outgoing.items()}
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    sizes_out = {dst: torch.tensor([t.numel()], dtype=torch.int64) for dst, t in payloads.items()}
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    works = [dist.isend(t, to_global(dst), group=group) for dst, t in sizes_out.items()]
    works += [dist.irecv(t, to_global(src), group=group) for src, t in sizes_in.items()]
    for w in works:
        w.wait()
    bufs = {src: torch.empty(int(t[0]), dtype=torch.uint8) for src, t in sizes_in.items()}
    works = [dist.isend(t, to_global(dst), group=group) for dst, t in payloads.items()]
    works += [dist.irecv(b, to_global(src), group=group) for src, b in bufs.items()]
    for w in works:
        w.wait()
    received: Dict[int, dict] = {}
    for src in incoming:
        received.update(pipeline_state.from_bytes(bufs[src]))
    return received, sum(t.numel() for t in payloads.values())
