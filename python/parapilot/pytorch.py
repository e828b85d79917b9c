"""PyTorch DDP integration: per-step telemetry to the parapilot agent, and the agent's decisions
(per-rank batch shares, per-layer gradient compression) applied inside DistributedDataParallel.

Add to an existing DDP script (see docs/pytorch.md):

    session = parapilot.pytorch.Session(ddp_model, optimizer, global_batch=64)
    loader = session.data_loader(dataset)
    for x, y in loader:
        with session.step():
            loss = loss_fn(ddp_model(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
        if session.should_stop: break
    session.close()

What it does:
* Telemetry per step: the cycle (from the end of the previous step to the end of this one, so
  data loading between steps counts; work marked with session.outside_steps(), or a gap far
  longer than any recent step, is left out), the wait in the gradient collectives (last
  gradient bucket ready to the optimizer step), the time blocked in every other collective of
  the cycle (DDP's buffer broadcast, the script's own all_reduce, barrier, ...), compute =
  cycle - all those waits (everything the rank did itself: data, host work, forward, backward,
  optimizer), the phases, each collective's time, bytes and calls, and (every grad_stats_every
  steps) per-layer gradient norms. CPU timings use the monotonic clock; CUDA timings use CUDA events read back
  once they have completed (never a device sync).
* On every connection to the agent, a JobInfo: rank, world size, global batch, what this job can
  switch (batch shares, compression), per-layer parameter and gradient sizes.
* A DDP communication hook that averages gradients with the agent's per-rank batch shares as
  weights (each rank multiplies its gradient by share_r / sum(shares), then a SUM all-reduce) and
  applies per-layer compression: fp16, top-k with error feedback, PowerSGD (torch's own
  PowerSGDState for buckets that are PowerSGD throughout, a per-tensor PowerSGD otherwise).
* The two-phase switch: PlanPrepare is answered PlanReady once the new hook configuration is
  built (or refused when the layout is not a pure data-parallel layout of this job's size); a
  committed plan is applied at a step boundary that all ranks agree on through a tiny MAX
  all-reduce on a separate Gloo group (CPU), then acknowledged.
* The agent going away changes nothing: the job keeps training on its last plan while the client
  reconnects in the background.
* What happens (connection, outages, plans applied, refused or aborted, a summary at close) is
  logged, one line each, to logging.getLogger("parapilot"); no handler is configured here.

What it never changes: the model, the loss, the optimizer and its hyper-parameters, the global
batch size, the data order (only which rank reads which slice of each global batch).

Thread-safety: a Session belongs to the training thread. Bus messages are handled on the
client's I/O thread (staging only builds new objects; nothing the training thread uses is
modified until the step boundary).

Where it lives (this module is the public face; it imports and re-exports):
* session.py: Session, the DDP session (its comm hook, its telemetry); built on
  share_session.py (ShareSession: elastic batch shares of data-parallel jobs) and
  step_session.py (StepSession: the step context, the plan boundary, failures, close()), which
  use agent_link.py (the bus connection, JobInfo, the plan book) and boundary.py (the agreement).
* hooks.py: the DDP comm hook, PlanConfig, layer_map, the clocks and the step's timing.
* collectives.py: the waits in collectives outside the gradient hook (torch.distributed's
  collectives and DDP's buffer broadcast, wrapped while a session is open).
* compressors.py: fp16, top-k and PowerSGD gradient compression and its state.
* shares.py: split_batch, plan_shares, shares_from_layout_name (no torch);
  share_sampler.py: ShareBatchSampler.
* peer_failure.py: PeerLost (what step() raises when a collective fails among the ranks: a peer
  killed, a link cut, a timeout) and the census in the job's store that names what was lost.
"""

from __future__ import annotations

from .compressors import NONE, FP16, TOPK, POWERSGD  # noqa: F401
from .hooks import PlanConfig, layer_map  # noqa: F401
from .peer_failure import PeerLost  # noqa: F401
from .session import Session  # noqa: F401
from .share_sampler import ShareBatchSampler  # noqa: F401
from .shares import plan_shares, shares_from_layout_name, split_batch  # noqa: F401

__all__ = ["Session", "PeerLost", "ShareBatchSampler", "split_batch", "PlanConfig", "layer_map",
           "plan_shares", "shares_from_layout_name", "NONE", "FP16", "TOPK", "POWERSGD"]
