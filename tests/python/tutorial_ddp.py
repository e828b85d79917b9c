"""A DDP training script shaped like PyTorch's multi-GPU tutorial (a Trainer class around a
DistributedDataParallel model), with parapilot added as docs/pytorch.md says: the lines marked
`# parapilot`. Launch with `python3 -m parapilot.launch --nproc N tests/python/tutorial_ddp.py`.

Test knobs (not part of the recipe): --slow-rank R slows one rank by --slow-factor, with the extra
time placed in its data loading (`data`), inside its forward (`forward`) or in its optimizer step
(`optimizer`). In data loading and the forward the extra time is (factor - 1) x the rank's own
forward + backward time per sample (measured while it has an even share, so under the machine's
load of the moment) times its samples: the rank behaves as a device `factor` times slower. In the optimizer step it is the same amount for an even
share, paid once per step however many samples the rank has (an optimizer step does not scale
with the batch). The extra time is slept, not computed: a slow device does not take compute from
its peers, while on a machine whose ranks share cores extra computation would. --out writes
rank 0's per-step wall times and final shares as JSON. --tokens T makes each sample T vectors
that the model reads one by one and averages (default 1): T times the compute per sample with the
same parameters, so that a torch build with faster kernels can be given a step as long as a slower
one's (test_pytorch_job.py's tokens_per_sample).
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


class Slowdown:
    """Makes one rank `factor` times slower at one place in its step: it sleeps factor - 1 times
    its own forward + backward time per sample (learnt while it has an even share) times its
    samples, or in the optimizer step the same for an even share, once per step."""

    def __init__(self, where: str, factor: float, even_share: int):
        self.where = where
        self.factor = factor
        self.even_share = even_share
        self.per_sample_s = None  # smoothed forward + backward time per sample, without sleeps
        self.slept = 0.0
        self._t0 = self._slept0 = 0.0

    def at(self, where: str, samples: int) -> None:
        if where != self.where or self.per_sample_s is None:
            return
        n = self.even_share if where == "optimizer" else samples
        t0 = time.perf_counter()
        time.sleep((self.factor - 1) * self.per_sample_s * n)
        self.slept += time.perf_counter() - t0

    def work_begun(self) -> None:
        self._t0, self._slept0 = time.perf_counter(), self.slept

    def work_done(self, samples: int) -> None:
        # Learnt at the even share only: with fewer samples the per-step overheads would count
        # as per-sample time, and the rank would get slower the more work it gives away.
        if samples != self.even_share:
            return
        own = (time.perf_counter() - self._t0 - (self.slept - self._slept0)) / samples
        self.per_sample_s = own if self.per_sample_s is None else 0.8 * self.per_sample_s + 0.2 * own


class Model(torch.nn.Module):
    def __init__(self, slowdown=None):
        super().__init__()
        # Batch norm registers buffers (running statistics): DDP broadcasts them from rank 0 at
        # every forward, as it does for most real models.
        self.net = torch.nn.Sequential(
            torch.nn.Linear(128, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(),
            torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 16))
        self.slowdown = slowdown

    def forward(self, x):  # x: (samples, tokens, 128) -> logits (samples, 16), tokens averaged
        if self.slowdown is not None:
            self.slowdown.at("forward", x.shape[0])
        n, t, f = x.shape
        return self.net(x.reshape(n * t, f)).view(n, t, -1).mean(dim=1)


class Trainer:
    def __init__(self, model, train_data, optimizer, session, slowdown, gpu_id=0):
        self.gpu_id = gpu_id
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.session = session  # parapilot
        self.slowdown = slowdown
        self.step_ms = []

    def _run_batch(self, source, targets):
        slow = self.slowdown
        if slow is not None:
            slow.at("data", source.shape[0])
            slow.work_begun()
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        if slow is not None:
            slow.work_done(source.shape[0])
        self.optimizer.step()

    def _run_epoch(self, epoch, max_steps):
        self.train_data.sampler.set_epoch(epoch)  # as with a DistributedSampler
        for source, targets in self.train_data:
            t0 = time.perf_counter()
            with self.session.step():  # parapilot
                self._run_batch(source, targets)
            self.step_ms.append((time.perf_counter() - t0) * 1e3)
            if self.session.should_stop or len(self.step_ms) >= max_steps:  # parapilot
                return False
        return True

    def train(self, max_steps):
        epoch = 0
        while self._run_epoch(epoch, max_steps):
            epoch += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-where", choices=["data", "forward", "optimizer"], default="forward")
    ap.add_argument("--slow-factor", type=float, default=3.0)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("parapilot").setLevel(logging.INFO)  # parapilot: optional, its lines only
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Model()
    slowdown = None
    if rank == args.slow_rank:
        slowdown = Slowdown(args.slow_where, args.slow_factor, args.global_batch // world)
        model.slowdown = slowdown
    dataset = TensorDataset(torch.randn(args.global_batch * 64, args.tokens, 128),
                            torch.randint(0, 16, (args.global_batch * 64,)))
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    if slowdown is not None and slowdown.where == "optimizer":
        inner = optimizer.step

        def slow_step(*a, **kw):
            slowdown.at("optimizer", 0)
            return inner(*a, **kw)
        optimizer.step = slow_step
    session = parapilot.pytorch.Session(ddp_model, optimizer,  # parapilot
                                        global_batch=args.global_batch)
    train_data = session.data_loader(dataset)  # parapilot
    trainer = Trainer(ddp_model, train_data, optimizer, session, slowdown)
    trainer.train(args.steps)
    shares = session.local_counts()
    applied = list(session.applied_plans)
    session.close()  # parapilot
    if rank == 0 and args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump({"step_ms": trainer.step_ms, "final_counts": shares,
                       "applied_plans": applied, "world": world}, f)
        os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
