"""Models for the pipeline tests and benchmarks, as ordered lists of blocks (the input
parapilot.pipeline takes), and their deterministic data.

mlp_blocks(n, width, seed): n blocks Linear -> LayerNorm -> GELU (floats in, floats out).
gpt_blocks(n_layers, width, vocab, seq, seed): a small GPT-like model: an embedding block (tokens
    and positions), n_layers pre-norm transformer blocks (causal self-attention, MLP), a head block
    (LayerNorm, Linear to the vocabulary); tokens in, logits out. gpt_loss is its loss.
batch(kind, step, ...): the step's (inputs, targets), the same on every rank for a step.
"""

import math

import torch
import torch.nn.functional as F


def mlp_blocks(n=8, width=32, seed=7):
    torch.manual_seed(seed)
    return [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width),
                                torch.nn.GELU()) for _ in range(n)]


class Embed(torch.nn.Module):
    def __init__(self, vocab, width, seq):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(seq, width) * 0.02)

    def forward(self, x):
        return self.tok(x) + self.pos[: x.shape[1]]


class TransformerBlock(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(torch.nn.Module):
    def __init__(self, width, vocab):
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.lm = torch.nn.Linear(width, vocab)

    def forward(self, x):
        return self.lm(self.ln(x))


def gpt_blocks(n_layers=6, width=64, vocab=128, seq=32, heads=4, seed=7):
    torch.manual_seed(seed)
    return ([Embed(vocab, width, seq)] + [TransformerBlock(width, heads) for _ in range(n_layers)]
            + [Head(width, vocab)])


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(kind, step, global_batch, width=32, vocab=128, seq=32):
    g = torch.Generator()
    g.manual_seed(1000 + step)
    if kind == "gpt":
        tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    x = torch.randn(global_batch, width, generator=g)
    return x, torch.tanh(x.flip(1))
