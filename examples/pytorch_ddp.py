"""A plain PyTorch DDP training script with parapilot added (the lines marked "parapilot").

Run on CPU with Gloo, two processes, with torchrun or with parapilot's tiny launcher (same
environment variables; Debian's torch 1.13 torchrun is broken on Python 3.11):

    torchrun --nproc_per_node=2 examples/pytorch_ddp.py --steps 200
    python3 -m parapilot.launch --nproc 2 examples/pytorch_ddp.py --steps 200

With an agent (`parapilot deploy --listen 127.0.0.1:7070 --secret-file secret ...`):

    PARAPILOT_AGENT=127.0.0.1:7070 PARAPILOT_SECRET_FILE=secret \
        python3 -m parapilot.launch --nproc 2 examples/pytorch_ddp.py --steps 2000 --slow-rank 1

Without PARAPILOT_AGENT the script trains exactly as before (uniform shares, no telemetry).
--slow-rank/--slow-ms make one rank slower (a straggler to react to); --no-parapilot runs the
script without the added lines.
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import parapilot.pytorch  # parapilot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-ms", type=float, default=20.0,
                    help="extra forward time of the slow rank at an even share of the batch")
    ap.add_argument("--no-parapilot", action="store_true")
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()

    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8192, 32, generator=g)
    y = (x @ torch.randn(32, 1, generator=g)).tanh() + 0.05 * torch.randn(8192, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)

    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    if rank == args.slow_rank:  # fault injection for the demo: this rank computes slower
        model = torch.nn.Sequential(SlowDown(args.slow_ms, args.global_batch // world), model)
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.MSELoss()

    if args.no_parapilot:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, drop_last=True)
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.global_batch // world,
                                             sampler=sampler, drop_last=True)
        session = None
    else:
        session = parapilot.pytorch.Session(ddp_model, optimizer,                # parapilot
                                            global_batch=args.global_batch)      # parapilot
        sampler = session.batch_sampler(dataset)                                 # parapilot
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)     # parapilot

    step, epoch, t0 = 0, 0, time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            with session.step() if session else _nothing():                      # parapilot
                loss = loss_fn(ddp_model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            step += 1
            if rank == 0 and step % args.log_every == 0:
                extra = f" plan {session.plan_id} shares {session.local_counts()}" if session else ""
                print(f"step {step} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / step * 1000:.1f} ms/step{extra}", flush=True)
            if step >= args.steps or (session and session.should_stop):          # parapilot
                break
        if session and session.should_stop:                                      # parapilot
            break
        epoch += 1
    if session:
        session.close()                                                          # parapilot
    dist.destroy_process_group()


class SlowDown(torch.nn.Module):
    """Fault injection: sleeps in forward as if this rank's device were slower (`ms` for an even
    share of the batch, in proportion to the samples it gets)."""

    def __init__(self, ms, even_batch):
        super().__init__()
        self.ms, self.even_batch = ms, even_batch

    def forward(self, x):
        time.sleep(self.ms / 1000 * x.shape[0] / self.even_batch)
        return x


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
