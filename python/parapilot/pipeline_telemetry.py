"""A pipeline stage's Telemetry for one step (the pipeline contract with deploy).

stage_telemetry(rec, timing, ...) fills, for rank `stage`:
  compute_ms              forward + backward of the stage's chunks (the loss on the last stage)
                          + its optimizer step; no waits;
  collectives[P2P_PP]     the schedule's time not spent computing: blocked in its sends and
                          receives (ms), the activations and gradients it sent and received
                          (bytes), and how many (calls);
  collectives[PHASE_FORWARD] / [PHASE_BACKWARD] / [PHASE_OPTIMIZER]  the phases (calls = 1);
  collectives[WAIT_OTHER] the script's own collectives in the cycle (collectives.py), if any;
  collectives[SWITCH_LAYOUT] on the first step after a switch: the pause (ms), the bytes this
                          rank sent (calls = 1);
  counts                  STAGE, MICROBATCHES, FIRST_BLOCK, BLOCKS, PLAN, SAMPLES (the global
                          batch: every stage sees every sample);
  measures                block_ms of each block the stage holds (at most
                          MAX_BLOCKS_REPORTED; a stage with more reports none).
Pure apart from building the message.
"""

from __future__ import annotations

from typing import Optional, Tuple

from . import telemetry_keys as keys
from . import wire
from .hooks import _StepRecord, _union_length
from .pipeline_stage import StepTiming

__all__ = ["MAX_BLOCKS_REPORTED", "stage_telemetry"]

MAX_BLOCKS_REPORTED = 60


def stage_telemetry(rec: _StepRecord, timing: StepTiming, *, stage: int, first_block: int,
                    n_blocks: int, micro_batches: int, global_batch: int, clock,
                    switch: Optional[Tuple[float, int]] = None) -> wire.Telemetry:
    """The step's Telemetry; `clock` turns the record's waits into ms (hooks._Clock);
    `switch`: (pause ms, bytes sent) when this step follows a switch."""
    t = wire.Telemetry(rank=stage, step=rec.step, step_start_ns=rec.start_ns,
                       step_end_ns=rec.end_ns, compute_ms=timing.compute_ms)
    c = t.collectives
    c[keys.P2P_PP] = wire.CollectiveStat(timing.p2p_ms, timing.p2p_bytes, timing.p2p_calls)
    c[keys.PHASE_FORWARD] = wire.CollectiveStat(timing.forward_ms, 0, 1)
    c[keys.PHASE_BACKWARD] = wire.CollectiveStat(timing.backward_ms, 0, 1)
    c[keys.PHASE_OPTIMIZER] = wire.CollectiveStat(timing.optimizer_ms, 0, 1)
    if rec.waits:
        spans = [(clock.ms(rec.t_start, a), clock.ms(rec.t_start, b))
                 for _, _, a, b in rec.waits]
        c[keys.WAIT_OTHER] = wire.CollectiveStat(_union_length(spans),
                                                 sum(w[1] for w in rec.waits), len(rec.waits))
    if switch is not None:
        c[keys.SWITCH_LAYOUT] = wire.CollectiveStat(switch[0], switch[1], 1)
    keys.set_info(t, keys.STAGE, stage)
    keys.set_info(t, keys.MICROBATCHES, micro_batches)
    keys.set_info(t, keys.FIRST_BLOCK, first_block)
    keys.set_info(t, keys.BLOCKS, n_blocks)
    keys.set_info(t, keys.PLAN, rec.plan_id)
    keys.set_info(t, keys.SAMPLES, global_batch)
    if n_blocks <= MAX_BLOCKS_REPORTED:
        for block, ms in timing.block_ms.items():
            keys.set_block_ms(t, block, ms)
    return t
