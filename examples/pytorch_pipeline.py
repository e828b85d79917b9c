"""A pipeline-parallel PyTorch training script on parapilot.pipeline: a small GPT-like model cut
into blocks, one stage per process, Gloo on the CPU (torch >= 2.4).

    /opt/parapilot/torch2/bin/python -m parapilot.launch --nproc 4 \\
        examples/pytorch_pipeline.py --steps 60

With an agent (`parapilot deploy --listen 127.0.0.1:7070 --secret-file secret`), which moves
blocks between the stages while the job trains:

    PARAPILOT_AGENT=127.0.0.1:7070 PARAPILOT_SECRET_FILE=secret \\
        /opt/parapilot/torch2/bin/python -m parapilot.launch --nproc 4 \\
        examples/pytorch_pipeline.py --steps 400 --slow-stage 2

Without PARAPILOT_AGENT it trains on its start split. --slow-stage S makes stage S's forward
--slow-factor times slower (a slow GPU to react to).
"""

import argparse
import logging
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parapilot.pipeline as pp


class Embed(torch.nn.Module):
    def __init__(self, vocab, width, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(seq, width) * 0.02)

    def forward(self, x):
        return self.tok(x) + self.pos[: x.shape[1]]


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.fc, self.out = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        x = x + self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(torch.nn.Module):
    def __init__(self, width, vocab):
        super().__init__()
        self.ln, self.lm = torch.nn.LayerNorm(width), torch.nn.Linear(width, vocab)

    def forward(self, x):
        return self.lm(self.ln(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--schedule", default="1f1b", choices=pp.SCHEDULES)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--slow-stage", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=3.0)
    a = ap.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
    logging.getLogger("parapilot").setLevel(logging.INFO)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    vocab, seq = 256, 32
    torch.manual_seed(0)  # every rank builds the same blocks
    blocks = ([Embed(vocab, a.width, seq)] + [Block(a.width, 4) for _ in range(a.layers)]
              + [Head(a.width, vocab)])
    session = pp.PipelineSession(
        blocks, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=3e-4),
        global_batch=16, micro_batches=a.micro_batches, schedule=a.schedule)
    if dist.get_rank() == a.slow_stage:  # slow this rank's forward, whichever blocks it holds
        for b in blocks:
            b.register_forward_pre_hook(lambda m, x: setattr(m, "_t0", time.perf_counter()))
            b.register_forward_hook(lambda m, x, y: time.sleep(
                (a.slow_factor - 1) * (time.perf_counter() - m._t0)))
    g = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    for step in range(a.steps):
        tokens = torch.randint(0, vocab, (16, seq + 1), generator=g)  # the same on every rank
        loss = session.step(tokens[:, :-1], tokens[:, 1:])
        if loss is not None and (step + 1) % 20 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}, split {session.split}, "
                  f"{(time.perf_counter() - start) / (step + 1) * 1e3:.0f} ms/step", flush=True)
        if session.should_stop:
            break
    session.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
