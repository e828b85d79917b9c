"""What a pipeline job accepts as a plan (no torch): the rule of docs/pytorch.md, "Pipeline
jobs", and of the pipeline contract with deploy.

A plan for a pipeline job of S stages over B blocks with M micro-batches of m = global batch / M
samples each and schedule `sc` is a PlanPrepare whose Layout is {dp=1, tp=1, pp=S,
micro_batches=M} and whose layout_name is a layout plan name (plan_name.LayoutPlanName)
"dp1-tp1-ppS-mbm" (the name's mb is the plan-name codec's: samples per micro-batch) with
stage_layers (";st=") a split of the B blocks (pipeline_split.check_split) and, when it names
one, the job's schedule (";sc="). Deploy names none: the job keeps the schedule it runs (JobInfo
does not carry it, and no plan changes it), so a gpipe job and a 1f1b job take the same plan.

plan_split(prepare, ...) returns the plan's split, or raises PlanRefused (a ValueError) whose
message is the reason the rank sends back in PlanReady{ok=false}.
"""

from __future__ import annotations

from typing import List, Optional

from . import pipeline_split, plan_name, wire

__all__ = ["PlanRefused", "plan_split", "layout_name"]


class PlanRefused(ValueError):
    """A plan this pipeline job cannot run; the message says why (sent to the agent)."""


def plan_split(p: wire.PlanPrepare, *, n_blocks: int, n_stages: int, micro_batches: int,
               global_batch: int, schedule: str) -> List[int]:
    """The split plan `p` asks for; PlanRefused naming what does not fit this job."""
    size = global_batch // micro_batches
    lay = p.layout
    if lay.dp != 1 or lay.tp != 1 or lay.pp != n_stages:
        raise PlanRefused(f"layout dp={lay.dp} tp={lay.tp} pp={lay.pp}: this pipeline job runs "
                          f"dp=1 tp=1 pp={n_stages} (one rank per stage); it moves blocks "
                          "between its stages, never changes the degrees")
    if lay.micro_batches != micro_batches:
        raise PlanRefused(f"layout micro_batches={lay.micro_batches}: this pipeline job runs "
                          f"{micro_batches} micro-batches per step and does not switch them")
    try:
        name = plan_name.decode(p.layout_name)
    except plan_name.PlanNameError as e:
        raise PlanRefused(str(e)) from None
    if not isinstance(name, plan_name.LayoutPlanName):
        raise PlanRefused(f"layout name '{p.layout_name}': a pipeline plan is a layout name "
                          f"(dp1-tp1-pp{n_stages}-mb{micro_batches};st=...)")
    if (name.dp, name.tp, name.pp, name.microbatch) != (1, 1, n_stages, size):
        raise PlanRefused(f"layout name '{p.layout_name}' says dp{name.dp}-tp{name.tp}-"
                          f"pp{name.pp}-mb{name.microbatch}, this job dp1-tp1-pp{n_stages}-"
                          f"mb{size} ({micro_batches} micro-batches of {size} samples)")
    if name.schedule is not None and name.schedule != schedule:
        raise PlanRefused(f"schedule '{name.schedule}': this job runs '{schedule}' and does not "
                          "switch schedules")
    if not name.stage_layers:
        raise PlanRefused(f"layout name '{p.layout_name}' has no stage_layers (;st=...): "
                          "nothing to move")
    try:
        return pipeline_split.check_split(name.stage_layers, n_blocks, n_stages)
    except pipeline_split.SplitError as e:
        raise PlanRefused(str(e)) from None


def layout_name(split: List[int], micro_batch_size: int,
                schedule: Optional[str] = None) -> str:
    """The layout name of a pipeline plan with `split` and micro-batches of micro_batch_size
    samples, naming `schedule` when given (without one: what deploy sends; for tests and
    tools)."""
    return plan_name.encode(plan_name.LayoutPlanName(
        dp=1, tp=1, pp=len(split), microbatch=micro_batch_size, schedule=schedule,
        stage_layers=list(split)))
