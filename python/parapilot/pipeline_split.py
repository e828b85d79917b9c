"""Splits of a pipeline's blocks over its stages, and what moves between two splits (no torch).

A split of B blocks over S stages is a list of S block counts [n_0, ..., n_{S-1}], each >= 1,
summing to B: stage s holds the contiguous blocks [first_s, first_s + n_s) with
first_s = n_0 + ... + n_{s-1}. It is the `stage_layers` of a pipeline plan's layout name
(plan_name.LayoutPlanName, ";st=..."). One rank runs each stage (rank s runs stage s).

Every function is pure; invalid input raises SplitError (a ValueError) naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

__all__ = ["SplitError", "Move", "even_split", "check_split", "first_blocks", "blocks_of",
           "stage_of_block", "moves", "pairs"]


class SplitError(ValueError):
    """A split that does not describe this pipeline; the message says why."""


@dataclass(frozen=True)
class Move:
    """Block `block` goes from stage `src` to stage `dst` at a switch."""
    block: int
    src: int
    dst: int


def even_split(n_blocks: int, n_stages: int) -> List[int]:
    """The even split: n_blocks // n_stages each, the first n_blocks % n_stages stages one more."""
    if n_stages < 1:
        raise SplitError(f"{n_stages} stages: a pipeline has at least one")
    if n_blocks < n_stages:
        raise SplitError(f"{n_blocks} blocks cannot fill {n_stages} stages (each holds >= 1)")
    base, extra = divmod(n_blocks, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def check_split(split: Sequence[int], n_blocks: int, n_stages: int) -> List[int]:
    """`split` as a list when it is a split of n_blocks over n_stages; SplitError otherwise."""
    out = [int(v) for v in split]
    if len(out) != n_stages:
        raise SplitError(f"split {out} has {len(out)} stages, the job runs {n_stages}")
    if any(v < 1 for v in out):
        raise SplitError(f"split {out} leaves a stage without blocks (each holds >= 1)")
    if sum(out) != n_blocks:
        raise SplitError(f"split {out} covers {sum(out)} blocks, the model has {n_blocks}")
    return out


def first_blocks(split: Sequence[int]) -> List[int]:
    """first_s of every stage."""
    out, at = [], 0
    for n in split:
        out.append(at)
        at += n
    return out


def blocks_of(split: Sequence[int], stage: int) -> range:
    """The blocks stage `stage` holds."""
    first = sum(split[:stage])
    return range(first, first + split[stage])


def stage_of_block(split: Sequence[int]) -> List[int]:
    """The stage of every block, in block order."""
    return [s for s, n in enumerate(split) for _ in range(n)]


def moves(old: Sequence[int], new: Sequence[int]) -> List[Move]:
    """The blocks whose stage differs between two splits of the same blocks, in block order."""
    if sum(old) != sum(new) or len(old) != len(new):
        raise SplitError(f"splits {list(old)} and {list(new)} are not of the same pipeline")
    a, b = stage_of_block(old), stage_of_block(new)
    return [Move(i, s, d) for i, (s, d) in enumerate(zip(a, b)) if s != d]


def pairs(move_list: Sequence[Move]) -> Dict[Tuple[int, int], List[int]]:
    """The moved blocks grouped by (src, dst), each list in block order."""
    out: Dict[Tuple[int, int], List[int]] = {}
    for m in move_list:
        out.setdefault((m.src, m.dst), []).append(m.block)
    return out
