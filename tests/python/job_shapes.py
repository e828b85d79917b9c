"""DDP training scripts of the shapes real jobs have, with parapilot added as docs/pytorch.md
says, for the job-shape matrix (test_job_matrix.py). Launch with
`python3 -m parapilot.launch --nproc 4 tests/python/job_shapes.py --shape S
--runs healthy:none:120,healthy:agent,forward:none,... --agents HOST:PORT,...`: one process
group runs the listed jobs one after another (a fresh model, optimizer, Session and loader each),
each under its condition, with its own agent (`agent`: the next address of --agents) or none,
for the run's STEPS when given (else --steps with an agent, --baseline-steps without).

Shapes (--shape), each a plain MLP classifier plus one thing real scripts do:
  buffers     the model registers buffers (batch-norm statistics and a mask) and DDP
              broadcasts them at every forward (DDP's default broadcast_buffers=True)
  loss-log    a loss all-reduce every step, for logging
  barrier     a barrier every 5 steps
  accumulate  gradient accumulation: two micro-batches a step, the first under no_sync()
  eval        an evaluation pass between epochs (all-gathered accuracy), marked with
              session.outside_steps()
  clip        gradient clipping (clip_grad_norm_) before the optimizer step
  groups      two parameter groups with their own learning rates (AdamW)

Every rank trains the real model (real forward, backward, DDP collectives and optimizer step)
and also runs on an emulated device (Device): the time its kernels would take is slept, in the
forward, the backward (an identity after the first layer whose backward sleeps) and the
optimizer step. Sleeping, not computing, keeps a slow device from taking CPU from its peers on
a machine whose ranks share cores, and keeps the conditions the same from run to run.
Conditions: healthy; forward, backward, data or optimizer: rank SLOW_RANK is a 3x slower device
with the extra time in that part of its step (data: in the data loader's collate; optimizer:
the amount for an even share, once per step); mixed: devices 1, 1, 2, 3x slower through their
whole step, as generations differ; moving (the guardrail's wrong switch): rank SLOW_RANK is 2.5x
slower in its forward until the agent's first plan applies, rank SLOW_RANK + 1 3.5x from then on;
transient: rank SLOW_RANK is 3x slower in its forward for --transient-s seconds of wall time from
--transient-start-s after the run's first step, then healthy again.

Rank 0 writes --out: per run its condition, mode, per-step wall times (ms), final samples per
rank and the plans applied.
"""

import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import parapilot.pytorch  # parapilot

SHAPES = ["buffers", "loss-log", "barrier", "accumulate", "eval", "clip", "groups"]
CONDITIONS = ["healthy", "forward", "backward", "data", "optimizer", "mixed", "moving",
              "transient"]
SLOW_RANK = 2
FACTOR = 3.0
MIXED = [1.0, 1.0, 2.0, 3.0]
MOVING = (2.5, 3.5)  # the "moving" slowdown's factor before and after the first plan
DEVICE_MS = 1.0  # the emulated device's forward + backward time per sample
DEVICE_OPT_MS = 2.0  # ...and its optimizer step
FEATURES, CLASSES = 64, 8


class Device:
    """The emulated accelerator of one rank: the time its kernels take, slept (a device computes
    without taking the host's CPU, so ranks sharing cores do not slow each other through it).
    A healthy device takes DEVICE_MS per sample (a third in the forward, two in the backward)
    and DEVICE_OPT_MS per optimizer step. A rank `factor` times slower at `where` takes
    (factor - 1) x DEVICE_MS per sample more there (forward, backward or data loading), or
    (factor - 1) x DEVICE_MS x an even share more per optimizer step (it does not scale with
    the batch); `mixed` scales all of its device time by factor. `active` says whether the
    slowdown is on now."""

    def __init__(self, where: str = "healthy", factor: float = 1.0, even_share: int = 1,
                 active=lambda: True):
        self.where, self.factor, self.even_share, self.active = where, factor, even_share, active

    def at(self, where: str, samples: int) -> None:
        base = {"forward": DEVICE_MS / 3 * samples, "backward": 2 * DEVICE_MS / 3 * samples,
                "optimizer": DEVICE_OPT_MS}.get(where, 0.0)
        on = self.factor > 1 and self.active()
        if on and self.where == "mixed":
            ms = base * self.factor
        elif on and where == self.where:
            n = self.even_share if where == "optimizer" else samples
            ms = base + (self.factor - 1) * DEVICE_MS * n
        else:
            ms = base
        if ms > 0:
            time.sleep(ms / 1000.0)


class _DeviceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, device):
        ctx.device, ctx.n = device, x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.device.at("backward", ctx.n)
        return g, None


class Model(torch.nn.Module):
    def __init__(self, buffers: bool):
        super().__init__()
        self.inp = torch.nn.Linear(FEATURES, 256)
        self.hidden = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                          torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                          torch.nn.ReLU())
        self.out = torch.nn.Linear(256, CLASSES)
        self.norm = torch.nn.BatchNorm1d(256) if buffers else None
        if buffers:
            self.register_buffer("mask", torch.ones(256))
        self.device = Device()

    def forward(self, x):
        h = self.inp(x)
        if self.training:  # the backward through here runs before inp's gradients
            h = _DeviceBackward.apply(h, self.device)
        if self.norm is not None:
            h = self.norm(h) * self.mask
        y = self.out(self.hidden(h))
        if self.training:
            self.device.at("forward", x.shape[0])
        return y


def run_one(args, condition: str, mode: str, steps: int, agent: str, rank: int,
            world: int) -> dict:
    torch.manual_seed(0)
    model = Model(buffers=args.shape == "buffers")
    even = args.global_batch // world
    factor = MIXED[rank] if condition == "mixed" else (
        FACTOR if condition in ("forward", "backward", "data", "optimizer") and rank == SLOW_RANK
        else 1.0)
    applied = []  # the session's applied plans, once it exists
    first_step = []  # perf_counter() at the run's first step, once it began
    if condition == "transient" and rank == SLOW_RANK:
        start, length = args.transient_start_s, args.transient_s

        def slowed_now():
            at = time.perf_counter() - first_step[0] if first_step else -1.0
            return start <= at < start + length
        device = Device("forward", FACTOR, even, active=slowed_now)
    elif condition == "moving" and rank in (SLOW_RANK, SLOW_RANK + 1):
        # Rank SLOW_RANK is slow until the agent's first plan applies, rank SLOW_RANK + 1 after.
        first = rank == SLOW_RANK
        device = Device("forward", MOVING[0] if first else MOVING[1], even,
                        active=lambda: (len(applied) == 0) == first)
    else:
        device = Device(condition, factor, even)
    model.device = device
    n = args.global_batch * 32
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, FEATURES, generator=g),
                         torch.randint(0, CLASSES, (n,), generator=g))
    ddp = DDP(model)
    if args.shape == "groups":
        decay = [p for name, p in ddp.named_parameters() if name.endswith("weight")]
        rest = [p for name, p in ddp.named_parameters() if not name.endswith("weight")]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                       {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    inner = optimizer.step

    def device_step(*a, **kw):
        device.at("optimizer", 0)
        return inner(*a, **kw)
    optimizer.step = device_step
    session = parapilot.pytorch.Session(ddp, optimizer, global_batch=args.global_batch,  # parapilot
                                        agent=agent)
    applied = session.applied_plans

    def collate(batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        device.at("data", len(batch))
        return x, y
    loader = session.data_loader(data, collate_fn=collate)  # parapilot
    step_ms = []
    epoch = 0
    while len(step_ms) < steps and not session.should_stop:
        loader.sampler.set_epoch(epoch)  # parapilot: as with a DistributedSampler
        for x, y in loader:
            t0 = time.perf_counter()
            if not first_step:
                first_step.append(t0)
            with session.step():  # parapilot
                ddp.train()
                optimizer.zero_grad()
                if args.shape == "accumulate":
                    half = max(1, x.shape[0] // 2)
                    with ddp.no_sync():
                        (F.cross_entropy(ddp(x[:half]), y[:half]) * half / x.shape[0]).backward()
                    rest = x.shape[0] - half
                    if rest > 0:
                        (F.cross_entropy(ddp(x[half:]), y[half:]) * rest / x.shape[0]).backward()
                    loss = None
                else:
                    loss = F.cross_entropy(ddp(x), y)
                    loss.backward()
                if args.shape == "clip":
                    torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                optimizer.step()
                if args.shape == "loss-log" and loss is not None:
                    logged = loss.detach().clone()
                    dist.all_reduce(logged)
            if args.shape == "barrier" and len(step_ms) % 5 == 4:
                dist.barrier()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if session.should_stop or len(step_ms) >= steps:
                break
        epoch += 1
        if args.shape == "eval" and len(step_ms) < steps:
            with session.outside_steps():  # parapilot: evaluation is not a training step
                evaluate(ddp, data)
    counts = session.local_counts()
    applied = list(session.applied_plans)
    excluded = session.gaps_excluded
    session.close()  # parapilot
    return {"condition": condition, "mode": mode, "step_ms": step_ms, "final_counts": counts,
            "applied_plans": applied, "gaps_excluded": excluded}


def evaluate(ddp, data) -> float:
    ddp.eval()
    correct = torch.zeros(1)
    with torch.no_grad():
        for i in range(0, 2048, 256):
            x, y = data[i:i + 256]
            correct += (ddp.module(x).argmax(1) == y).sum()
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, correct)
    ddp.train()
    return float(sum(gathered)) / (2048 * len(gathered))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, required=True)
    ap.add_argument("--runs", default="healthy:none,healthy:agent",
                    help="comma-separated CONDITION:MODE[:STEPS], MODE none or agent")
    ap.add_argument("--agents", default="", help="comma-separated HOST:PORT, one per agent run")
    ap.add_argument("--steps", type=int, default=120, help="steps of an agent run")
    ap.add_argument("--baseline-steps", type=int, default=60, help="steps of a run without one")
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--transient-start-s", type=float, default=5.0,
                    help="transient: seconds from the run's first step to the slowdown")
    ap.add_argument("--transient-s", type=float, default=15.0,
                    help="transient: seconds the slowdown lasts")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("parapilot").setLevel(logging.INFO)  # parapilot's lines only
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    agents = [a for a in args.agents.split(",") if a]
    results = []
    for item in args.runs.split(","):
        condition, _, tail = item.partition(":")
        mode, _, steps_text = tail.partition(":")
        steps_ok = not steps_text or (steps_text.isdigit() and int(steps_text) > 0)
        if not steps_ok or condition not in CONDITIONS or mode not in ("none", "agent"):
            raise SystemExit(f"--runs: '{item}' is not CONDITION:MODE[:STEPS] with CONDITION "
                             f"one of {', '.join(CONDITIONS)}, MODE none or agent and STEPS a "
                             "positive integer")
        if mode == "agent" and not agents:
            raise SystemExit("--runs: more agent runs than --agents addresses")
        agent = agents.pop(0) if mode == "agent" else ""
        steps = (int(steps_text) if steps_text else
                 args.steps if mode == "agent" else args.baseline_steps)
        results.append(run_one(args, condition, mode, steps, agent, rank, world))
        dist.barrier()
    if rank == 0 and args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump({"shape": args.shape, "world": world,
                       "runs": results}, f)
        os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
