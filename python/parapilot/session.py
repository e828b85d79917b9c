"""The Session: one DDP rank's connection to the parapilot agent, and the step context that
times each step, reports it and applies the agent's plans at step boundaries. What is DDP's own
lives here (the comm hook that weights and compresses gradients, its telemetry); the batch
shares are share_session.py's, the step loop, the agent link and the boundary step_session.py's.

Contract:
* Session(ddp_model, optimizer, global_batch=...) registers the comm hook (hooks.py), forward
  timing hooks and a timing wrapper around optimizer.step; it never changes the model, the loss,
  the optimizer, the global batch or the data order.
* Every collective the training thread blocks in besides the gradient reduction (DDP's buffer
  broadcast, the script's own) is timed (collectives.py) and taken out of the step's compute.
  `with session.outside_steps():` marks work that is no training step; it and any gap between
  steps longer than OUTLIER_GAP median cycles are charged to no step.
* `with session.step():` wraps one training step. On exit the step's record is queued, the
  ranks agree on the plan for the next step (a MAX all-reduce on a separate CPU Gloo group,
  started one step ahead) and a committed plan is switched in; telemetry is sent once its marks
  have resolved (never a device sync, except in close()).
* Plans: PlanPrepare is checked (pure data-parallel layouts of this job's world size only) and
  staged into a PlanConfig on the bus client's I/O thread; the training thread swaps it in at a
  boundary and the PlanBook acknowledges it.
* Everything the session says goes, one line each prefixed "rank R: ", to `log` (default: the
  logging module's "parapilot" logger); the bus client's connect/disconnect lines at debug.
* close() sends what is pending, logs a one-line summary, disconnects and removes the timing
  hooks; the comm hook and the last plan stay.
* A collective that fails among the ranks inside a step or at its boundary (a peer process
  killed, a link between ranks cut, a collective timed out) makes step() raise PeerLost
  (peer_failure.py) naming what was lost, after a census of up to min(5, control_timeout_s)
  seconds in the job's store (its own process-group connections closed first, so that peers
  blocked on it fail at once; the store and the agent stay connected). No plan is applied
  after it, so a plan committed for a later step is never half applied. Nothing waits
  forever: the boundary agreement's group times out after control_timeout_s (default 1800 s,
  torch's default group timeout, as before), the gradient reduction after the timeout the job
  gave init_process_group.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from . import wire
from .compressors import _describe_methods, _methods_from, _powersgd_states
from .hooks import PlanConfig, _HookState, _StepRecord, _comm_hook, _step_telemetry
from .share_session import ShareSession
from .step_session import OUTLIER_GAP  # noqa: F401  (re-exported: part of the contract above)


class Session(ShareSession):
    """Connects a DDP training job to the parapilot agent. See the module docstring.

    ddp_model: the DistributedDataParallel module (its comm hook is registered here; the hook
        can only be registered once, before the first backward).
    optimizer: the job's optimizer (timed, never changed); None to skip optimizer timing.
    global_batch: samples per step over all ranks (what the shares split).
    agent: "host:port" of `parapilot deploy` (default: env PARAPILOT_AGENT; empty or unset: no
        agent, the hook still weights by the initial shares).
    secret_file / secret_env: the bus secret (default: env PARAPILOT_SECRET_FILE, else the
        variable named by secret_env, default PARAPILOT_SECRET).
    layers: modules that are the agent's layers 0..n-1 (default: every parameter-owning module).
    grad_stats_every: per-layer gradient norms every this many steps (0: never).
    log: a (level, line) callable for what the session says (default: the "parapilot" logger of
        the logging module); the bus client's own lines go to it at "debug".
    client_options: keyword arguments of parapilot.Client (its on_connect / on_disconnect run
        after the session's own).
    control_timeout_s: the boundary agreement's group timeout: an agreement a peer does not
        answer within it fails, and step() raises PeerLost (default 1800 s, torch's default
        process-group timeout; it must exceed the longest time one rank may reach a step
        boundary after another, e.g. rank 0 saving a checkpoint inside a step).
    """

    def __init__(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                 optimizer: Optional[torch.optim.Optimizer] = None, *, global_batch: int,
                 agent: Optional[str] = None, secret_file: Optional[str] = None,
                 secret_env: str = "PARAPILOT_SECRET",
                 layers: Optional[Sequence[torch.nn.Module]] = None,
                 process_group=None, grad_stats_every: int = 10, start_step: int = 0,
                 initial_shares: Optional[Sequence[int]] = None, log=None,
                 client_options: Optional[dict] = None, control_timeout_s: float = 1800.0):
        self.ddp_model = ddp_model
        self._hook: Optional[_HookState] = None
        super().__init__(ddp_model, optimizer, global_batch=global_batch,
                         framework=f"pytorch-ddp {torch.__version__}",
                         capabilities=wire.Capability.DP_SHARES | wire.Capability.COMPRESSION,
                         initial_shares=initial_shares, job_kind="PyTorch DDP", agent=agent,
                         secret_file=secret_file, secret_env=secret_env, layers=layers,
                         process_group=process_group, grad_stats_every=grad_stats_every,
                         start_step=start_step, log=log, client_options=client_options,
                         control_timeout_s=control_timeout_s)

    @property
    def compression(self):
        """Layer -> (method, parameter) of the active plan (uncompressed layers omitted)."""
        return dict(self.config.methods)

    # ---- ShareSession's hooks ----

    def _initial_config(self) -> PlanConfig:
        cfg = super()._initial_config()
        # The comm hook reads the active plan from its own state; it is registered once.
        self._hook = _HookState(self)
        self._hook.config = cfg
        self.ddp_model.register_comm_hook(self._hook, _comm_hook)
        return cfg

    def _build_config(self, plan_id: int, shares: List[int],
                      compression: Sequence[wire.LayerCompression], name: str) -> PlanConfig:
        cfg = super()._build_config(plan_id, shares, compression, name)
        cfg.methods = _methods_from(compression, self._n_layers)
        cfg.powersgd_states, cfg.uniform_powersgd = _powersgd_states(
            cfg.methods, self._n_layers, self.process_group)
        return cfg

    def _apply(self, cfg: PlanConfig) -> None:
        self._hook.config = cfg
        super()._apply(cfg)

    def _apply_tail(self, cfg: PlanConfig) -> str:
        return f", compression: {_describe_methods(cfg.methods)}"

    def _telemetry(self, rec: _StepRecord) -> wire.Telemetry:
        """The step's Telemetry (hooks._step_telemetry: every duration in [0, cycle]; wait = last
        gradient bucket ready -> optimizer step; compute = cycle - wait; arrive/dp = cycle start
        -> last bucket ready; per collective key the union of its [ready, done] intervals)."""
        return _step_telemetry(rec, self._clock, self.rank)
