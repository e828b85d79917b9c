"""ShareSession: a StepSession (step_session.py) for data-parallel jobs whose plans move samples
between ranks — each rank takes its share of every global batch. DDP (session.py) and FSDP2
sessions build on it.

Contract:
* A plan is a pure data-parallel layout of this job's world size (Layout.dp == world size, tp =
  pp = 1) with optional per-rank shares (plan_shares: Layout.dp_shares or the name's `sh=`,
  a `g=` device map applied); anything else is refused with the reason.
* The active plan's config holds `counts` (split_batch of the shares: samples per rank, summing to
  the global batch) and `weight` (this rank's count over the global batch), which the subclass
  uses to make the update equal the full-batch one.
* batch_sampler()/data_loader() hand this rank its slice of every global batch under the shares
  in force when each batch is drawn.
Thread-safety: as StepSession.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from torch.utils.data import DataLoader

from . import plan_name, wire
from .hooks import PlanConfig
from .share_sampler import ShareBatchSampler
from .shares import plan_shares, split_batch
from .step_session import StepSession


class ShareSession(StepSession):
    """The base of data-parallel sessions with elastic batch shares. See the module docstring.

    initial_shares: the shares in force before any plan (default: even).
    job_kind: how refusals name the job ("PyTorch DDP", "FSDP2").
    Other arguments: StepSession's.
    """

    def __init__(self, module, optimizer, *, global_batch: int, framework: str,
                 capabilities: int, initial_shares: Optional[Sequence[int]] = None,
                 job_kind: str = "data-parallel", **kwargs):
        self._initial_shares = list(initial_shares or [])
        self.job_kind = job_kind
        super().__init__(module, optimizer, global_batch=global_batch, framework=framework,
                         capabilities=capabilities, **kwargs)

    # ---- public API ----

    @property
    def shares(self) -> List[int]:
        return list(self.config.shares)

    def local_counts(self) -> List[int]:
        """Samples per rank in the current step's global batch."""
        return list(self.config.counts)

    @property
    def local_batch(self) -> int:
        return self.config.counts[self.rank]

    def batch_sampler(self, dataset, shuffle: bool = True, seed: int = 0) -> ShareBatchSampler:
        """A batch sampler giving this rank its share of every global batch (pass it to
        DataLoader(dataset, batch_sampler=...))."""
        return ShareBatchSampler(len(dataset), self, shuffle=shuffle, seed=seed)

    def data_loader(self, dataset, shuffle: bool = True, seed: int = 0,
                    **kwargs) -> DataLoader:
        """DataLoader(dataset, batch_sampler=self.batch_sampler(dataset, shuffle, seed),
        **kwargs), whose `sampler` is that same ShareBatchSampler: `loader.sampler.set_epoch(e)`
        works as with a DistributedSampler. kwargs are DataLoader's (collate_fn, num_workers,
        pin_memory, ...); batch_size, shuffle, sampler, batch_sampler and drop_last are the
        session's to set and raise TypeError."""
        for key in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if key in kwargs:
                raise TypeError(f"{type(self).__name__}.data_loader: {key} is set by the session "
                                "(this rank's share of each global batch); leave it out")
        sampler = self.batch_sampler(dataset, shuffle=shuffle, seed=seed)
        loader = DataLoader(dataset, batch_sampler=sampler, **kwargs)
        # DataLoader makes its own SequentialSampler when given a batch sampler and refuses to
        # replace it afterwards; with a batch sampler it never iterates `sampler`, so pointing
        # it at the share sampler only makes set_epoch reachable where scripts call it.
        object.__setattr__(loader, "sampler", sampler)
        return loader

    # ---- StepSession's hooks ----

    def _initial_config(self) -> PlanConfig:
        return self._build_config(0, self._initial_shares, [], "initial")

    def _samples(self) -> int:
        return self.local_batch

    def _summary_tail(self) -> str:
        return f"final share {self.local_batch}/{self.global_batch}"

    def _layout_problem(self, p: wire.PlanPrepare) -> str:
        lay = p.layout
        if lay.tp != 1 or lay.pp != 1:
            return (f"layout tp={lay.tp} pp={lay.pp}: this {self.job_kind} job only runs pure "
                    "data parallel layouts")
        if lay.dp != self.world_size:
            w = self.world_size
            return (f"layout dp={lay.dp} but the job has {w} ranks: the agent planned for a "
                    f"world size of {lay.dp}, not this job's {w} (start parapilot deploy with "
                    f"--gpus {w}, or a scenario whose cluster has {w} GPUs)")
        try:
            name = plan_name.decode(p.layout_name)
            shares = plan_shares(p)
        except ValueError as e:
            return str(e)
        # The device map of a deploy layout name (replica i on GPU g[i]); none in other kinds.
        gpus = name.gpus if isinstance(name, plan_name.LayoutPlanName) and name.gpus else None
        if shares and len(shares) != self.world_size:
            return f"{len(shares)} shares for {self.world_size} ranks"
        if not shares and gpus is not None and gpus != list(range(len(gpus))):
            return ("device remapping without shares changes nothing here: a rank keeps its "
                    "device")
        return ""

    def _stage_plan(self, p: wire.PlanPrepare) -> PlanConfig:
        return self._build_config(p.plan_id, plan_shares(p), p.layout.compression,
                                  p.layout_name)

    def _build_config(self, plan_id: int, shares: List[int],
                      compression: Sequence[wire.LayerCompression], name: str) -> PlanConfig:
        """The config of a plan with these shares (and, where the subclass applies it,
        compression)."""
        cfg = PlanConfig(plan_id=plan_id, shares=shares, name=name)
        eff = shares or [1] * self.world_size
        if len(eff) != self.world_size:
            raise ValueError(f"{len(eff)} shares for {self.world_size} ranks")
        counts = split_batch(self.global_batch, eff)
        cfg.counts = counts
        # Weight by the samples each rank actually gets (the shares after rounding to the global
        # batch), so the weighted average is exactly the full-batch average.
        cfg.weight = counts[self.rank] / float(sum(counts))
        return cfg

    def _apply(self, cfg: PlanConfig) -> None:
        shares = ",".join(str(x) for x in cfg.shares) if cfg.shares else "even"
        self._say("info", f"plan {cfg.plan_id} applied at step {self.step_index}: this rank "
                          f"takes {cfg.counts[self.rank]} of {self.global_batch} samples (shares "
                          f"{shares}){self._apply_tail(cfg)}")

    def _apply_tail(self, cfg: PlanConfig) -> str:
        """What the applied-plan line adds for this kind of job (DDP: its compression)."""
        return ""
