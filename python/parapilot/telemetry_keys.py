"""The names of Telemetry.collectives entries and what each one holds, mirroring
transport/telemetry_keys.h; both replay tests/data/telemetry_keys/vectors.json.

Two kinds of entry share the dict:

* timings: a collective or a phase of the step; ms, bytes and calls mean what they say. A writer
  fills the CollectiveStat itself under one of the keys below.
* facts ("info/..."): one number about the step, not a collective. Read and write them only
  through set_info/info, set_loss/loss and set_replica_and_stage: an info entry stores its value
  in `bytes` (ms = 0, calls = 0), a loss as millionths.

Every function takes the collectives dict (Telemetry.collectives) and is pure apart from it.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

from .wire import CollectiveStat

__all__ = [
    "ALL_REDUCE_DP", "ALL_GATHER_DP", "ALL_REDUCE_DP_INTER", "ALL_REDUCE_TP", "P2P_PP",
    "ALL_REDUCE_CONTROL", "ARRIVE_DP", "BROADCAST_BUFFERS", "WAIT_DP", "WAIT_OTHER",
    "PHASE_FORWARD", "PHASE_BACKWARD", "PHASE_COMM_WAIT", "PHASE_OPTIMIZER", "SWITCH_LAYOUT",
    "PLAN", "SAMPLES", "MICROBATCHES", "MICROBATCHES_TOTAL", "LOSS", "REPLICA", "STAGE",
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
LOSS = "info/loss_x1e6"                         # global loss, millionths (set_loss, loss)
REPLICA = "info/replica"                        # data-parallel replica (hybrid layouts)
STAGE = "info/stage"                            # pipeline stage (hybrid layouts)


def script_key(op: str) -> str:
    """The key of the script's own `op` collectives ("all_reduce" -> "all_reduce/script")."""
    return f"{op}/script"


def is_info(key: str) -> bool:
    """True for a fact's key ("info/..."), whose entry is no collective."""
    return key.startswith("info/")


def set_info(coll: Collectives, key: str, value: int) -> None:
    """Sets the fact `key` (an info key above except LOSS) to the count `value` >= 0."""
    assert is_info(key) and key != LOSS, key
    coll[key] = CollectiveStat(0.0, int(value), 0)


def info(coll: Collectives, key: str) -> Optional[int]:
    """The fact `key`; None when the telemetry does not report it."""
    assert is_info(key), key
    entry = coll.get(key)
    return None if entry is None else entry.bytes


def set_loss(coll: Collectives, value: float) -> None:
    """The step's global loss (a negative or non-finite loss is sent as 0), to 1e-6."""
    sent = max(0.0, value) if math.isfinite(value) else 0.0
    coll[LOSS] = CollectiveStat(0.0, int(sent * 1e6), 0)


def loss(coll: Collectives) -> Optional[float]:
    """The loss set_loss sent; None when the telemetry does not report it."""
    entry = coll.get(LOSS)
    return None if entry is None else entry.bytes / 1e6


def set_replica_and_stage(coll: Collectives, replica: int, stage: int) -> None:
    """Where a rank sits in a hybrid layout: its data-parallel replica and pipeline stage."""
    set_info(coll, REPLICA, replica)
    set_info(coll, STAGE, stage)
