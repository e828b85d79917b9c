"""An FSDP2 training script with parapilot added (lines marked `# parapilot`): a residual MLP
classifier, every block and the model wrapped with fully_shard, CPU/Gloo.

    PYTHONPATH=python PARAPILOT_AGENT=127.0.0.1:7070 PARAPILOT_SECRET_FILE=secret \\
        /opt/parapilot/torch2/bin/python -m parapilot.launch --nproc 4 \\
        examples/pytorch_fsdp.py --steps 150 --slow-rank 2

Every rank runs on an emulated device whose time is slept (DEVICE_MS per sample); --slow-rank R's
is --slow-factor times slower, to have something for the agent to do. Rank 0 prints the final
samples per rank.
"""

import argparse
import logging
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import parapilot.pytorch  # parapilot

FEATURES, HIDDEN, CLASSES = 128, 512, 10
DEVICE_MS = 0.5  # the emulated device's time per sample


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU())

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    args = ap.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")  # parapilot: optional,
    logging.getLogger("parapilot").setLevel(logging.INFO)              # to see what it does
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN),
                                *[Block() for _ in range(4)], torch.nn.Linear(HIDDEN, CLASSES))
    for block in model[1:5]:
        fully_shard(block)
    fully_shard(model)
    # An emulated device (not part of the recipe): the time its kernels would take, slept in the
    # forward in proportion to the samples; --slow-rank's device is --slow-factor times slower.
    factor = args.slow_factor if rank == args.slow_rank else 1.0
    model.register_forward_pre_hook(
        lambda m, inputs: time.sleep(factor * DEVICE_MS * inputs[0].shape[0] / 1000.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = parapilot.pytorch.FSDPSession(model, optimizer,                  # parapilot
                                            global_batch=args.global_batch)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(args.global_batch * 20, FEATURES, generator=g),
                         torch.randint(0, CLASSES, (args.global_batch * 20,), generator=g))
    loader = session.data_loader(data)                                         # parapilot
    step, epoch = 0, 0
    while step < args.steps and not session.should_stop:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            with session.step():                                               # parapilot
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y) * session.loss_scale       # parapilot
                loss.backward()
                optimizer.step()
            step += 1
            if step >= args.steps or session.should_stop:                      # parapilot
                break
        epoch += 1
    shares = session.local_counts()
    session.close()                                                            # parapilot
    if rank == 0:
        print(f"final samples per rank: {shares}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
