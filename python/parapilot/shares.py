"""Per-rank batch shares and the data split: how many samples of each global batch every rank
takes, and where a plan says so.

Contract:
* split_batch(global_batch, shares) is the one rounding rule: proportional to the shares,
  largest remainder, every rank at least 1 sample, summing to the global batch. The sessions'
  gradient weights and their samplers all use its counts, so the share-weighted average
  of the gradients is exactly the full-batch average.
* plan_shares(PlanPrepare) reads a plan's shares (Layout.dp_shares, else the deploy layout name's
  `sh=`), per rank (a `g=` device map of a pure data-parallel layout is applied: a rank keeps
  its device). Malformed layout names raise ValueError (the session refuses such plans).
Pure functions; no framework import (the TensorFlow client uses them too). The torch sampler
that hands each rank its slice is share_sampler.py's ShareBatchSampler.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from . import plan_name, wire


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


def shares_from_layout_name(name: str) -> List[int]:
    """The `sh=` field of a deploy layout name ("dp2-tp1-pp1-mb1-z1;sc=1f1b;sh=3,1*2" -> [3, 1,
    1]): `parapilot deploy` carries elastic shares there when Layout.dp_shares is empty. []
    for a name without it (a label, an action text); ValueError (plan_name.PlanNameError)
    naming the field for a malformed name."""
    decoded = plan_name.decode(name)
    return list(decoded.dp_shares) if isinstance(decoded, plan_name.LayoutPlanName) else []


def _device_map_from_layout_name(name: str) -> Optional[List[int]]:
    """The `g=` field of a deploy layout name (replica i on GPU g[i]); None without one."""
    decoded = plan_name.decode(name)
    if isinstance(decoded, plan_name.LayoutPlanName) and decoded.gpus:
        return list(decoded.gpus)
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

