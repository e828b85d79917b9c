"""The names of Telemetry's entries and what each one holds, mirroring
transport/telemetry_keys.h; both replay tests/data/telemetry_keys/vectors.json.

Two kinds of entry:

* timings, in Telemetry.collectives: a collective or a phase of the step; ms, bytes and calls
  mean what they say. A writer fills the CollectiveStat itself under one of the keys below.
* facts ("info/..."): one number about the step, not a collective. Whole numbers live in
  Telemetry.counts, real numbers (the loss, a pipeline block's compute) in Telemetry.measures;
  set_info/info, set_loss/loss, set_block_ms/block_ms and set_replica_and_stage read and write
  them.

Every accessor takes the Telemetry and is pure apart from it.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

from .wire import CollectiveStat, Telemetry

__all__ = [
    "ALL_REDUCE_DP", "ALL_GATHER_DP", "ALL_REDUCE_DP_INTER", "ALL_REDUCE_TP", "P2P_PP",
    "ALL_REDUCE_CONTROL", "ARRIVE_DP", "BROADCAST_BUFFERS", "WAIT_DP", "WAIT_OTHER",
    "PHASE_FORWARD", "PHASE_BACKWARD", "PHASE_COMM_WAIT", "PHASE_OPTIMIZER", "SWITCH_LAYOUT",
    "PLAN", "SAMPLES", "MICROBATCHES", "MICROBATCHES_TOTAL", "LOSS", "REPLICA", "STAGE",
    "FIRST_BLOCK", "BLOCKS", "BLOCK_MS_PREFIX", "block_ms_key", "set_block_ms", "block_ms",
    "script_key", "is_info", "set_info", "info", "set_loss", "loss", "set_replica_and_stage",
]

Collectives = Dict[str, CollectiveStat]

# Timings of collectives: "<collective>/<group>".
ALL_REDUCE_DP = "all_reduce/dp"              # gradient all-reduce
ALL_GATHER_DP = "all_gather/dp"              # gradient all-gather (top-k)
ALL_REDUCE_DP_INTER = "all_reduce/dp/inter"  # its inter-node part
ALL_REDUCE_TP = "all_reduce/tp"              # tensor-parallel all-reduces
P2P_PP = "p2p/pp"                            # pipeline sends and receives
ALL_REDUCE_CONTROL = "all_reduce/control"    # control and loss
ARRIVE_DP = "arrive/dp"                      # cycle start -> last gradient bucket ready
BROADCAST_BUFFERS = "broadcast/buffers"      # DDP's buffer broadcast
# Waits: time the rank was blocked for its peers.
WAIT_DP = "wait/dp"        # in the gradient collectives
WAIT_OTHER = "wait/other"  # in the step's other collectives
# Phases of the step (ms; calls = 1).
PHASE_FORWARD = "phase/forward"
PHASE_BACKWARD = "phase/backward"
PHASE_COMM_WAIT = "phase/comm_wait"
PHASE_OPTIMIZER = "phase/optimizer"  # the part not scaling with samples
SWITCH_LAYOUT = "switch/layout"      # the switching step: pause ms, bytes sent, calls 1

# Facts about the step.
PLAN = "info/plan"                              # plan id the step ran
SAMPLES = "info/samples"                        # samples this rank processed
MICROBATCHES = "info/microbatches"              # microbatches this rank ran
MICROBATCHES_TOTAL = "info/microbatches_total"  # ... all ranks ran
LOSS = "info/loss"                              # global loss, a measure (set_loss, loss)
REPLICA = "info/replica"                        # data-parallel replica (hybrid layouts)
STAGE = "info/stage"                            # pipeline stage (hybrid layouts)
# A pipeline stage's first block and how many blocks it holds (blocks are numbered 0..B-1 in the
# JobInfo's layers order; the stage holds [first, first + blocks)).
FIRST_BLOCK = "info/first_block"
BLOCKS = "info/blocks"
BLOCK_MS_PREFIX = "info/block_ms/"  # + block index: that block's compute (a measure, ms)


def script_key(op: str) -> str:
    """The key of the script's own `op` collectives ("all_reduce" -> "all_reduce/script")."""
    return f"{op}/script"


def is_info(key: str) -> bool:
    """True for a fact's key ("info/..."), whose entry is no collective."""
    return key.startswith("info/")


def set_info(t: Telemetry, key: str, value: int) -> None:
    """Sets the whole-number fact `key` (an info key above except LOSS) to `value` >= 0."""
    assert is_info(key) and key != LOSS, key
    t.counts[key] = int(value)


def info(t: Telemetry, key: str) -> Optional[int]:
    """The whole-number fact `key`; None when the telemetry does not report it."""
    assert is_info(key), key
    return t.counts.get(key)


def set_loss(t: Telemetry, value: float) -> None:
    """The step's global loss, exactly; a non-finite loss (a diverged step) is not reported."""
    if math.isfinite(value):
        t.measures[LOSS] = float(value)
    else:
        t.measures.pop(LOSS, None)


def loss(t: Telemetry) -> Optional[float]:
    """The loss set_loss sent; None when the telemetry does not report it."""
    return t.measures.get(LOSS)


def block_ms_key(block: int) -> str:
    """The key of block `block`'s compute in the step: "info/block_ms/<block>"."""
    return f"{BLOCK_MS_PREFIX}{int(block)}"


def set_block_ms(t: Telemetry, block: int, ms: float) -> None:
    """Block `block`'s compute in the step (forward and backward over all micro-batches), in ms;
    a non-finite or negative value is not reported."""
    if math.isfinite(ms) and ms >= 0.0:
        t.measures[block_ms_key(block)] = float(ms)
    else:
        t.measures.pop(block_ms_key(block), None)


def block_ms(t: Telemetry, block: int) -> Optional[float]:
    """The compute set_block_ms sent for `block`; None when the telemetry does not report it."""
    return t.measures.get(block_ms_key(block))


def set_replica_and_stage(t: Telemetry, replica: int, stage: int) -> None:
    """Where a rank sits in a hybrid layout: its data-parallel replica and pipeline stage."""
    set_info(t, REPLICA, replica)
    set_info(t, STAGE, stage)
