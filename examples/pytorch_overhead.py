"""Per-step overhead of the parapilot PyTorch client: three copies of the same DDP job in one
process group, stepped in turn (plain DDP; with a parapilot Session and no agent; with a Session
connected to the agent), so that machine noise hits all three alike. Prints the median step time
of each and the differences, as JSON, from rank 0.

    PARAPILOT_AGENT=127.0.0.1:7070 PARAPILOT_SECRET_FILE=secret \\
        python3 -m parapilot.launch --nproc 2 examples/pytorch_overhead.py --model small

Without PARAPILOT_AGENT the third variant is skipped. --model small (~75k parameters, 3
layers), tutorial (the 267k-parameter MLP of tests/python/tutorial_ddp.py) or medium (~3.2M
parameters, 4 layers).
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import parapilot.pytorch


def make_model(kind):
    torch.manual_seed(0)
    if kind == "small":
        dims = [32, 256, 256, 1]
    elif kind == "tutorial":  # the MLP of tests/python/tutorial_ddp.py (267,280 parameters)
        dims = [128, 512, 256, 256, 16]
    else:
        dims = [512, 1024, 1024, 1024, 512]
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]), dims[0], dims[-1]


def _time_bookkeeping(session):
    """Accumulates the wall time of the session's own per-step work (step begin and end: timing
    marks, gradient statistics, the plan agreement's launch and collection, building and queueing
    the telemetry message) into session.bookkeeping_ms, one entry per step."""
    session.bookkeeping_ms = []
    begin, end = session._begin, session._end

    def timed_begin():
        t0 = time.perf_counter()
        begin()
        session._bk = time.perf_counter() - t0

    def timed_end():
        t0 = time.perf_counter()
        end()
        session.bookkeeping_ms.append((session._bk + time.perf_counter() - t0) * 1000)
    session._begin, session._end = timed_begin, timed_end


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["small", "tutorial", "medium"], default="small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--global-batch", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with_agent = bool(os.environ.get("PARAPILOT_AGENT"))

    variants = {}
    for name in ["plain", "session"] + (["session+agent"] if with_agent else []):
        model, d_in, d_out = make_model(args.model)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        session = None
        if name != "plain":
            session = parapilot.pytorch.Session(
                ddp, opt, global_batch=args.global_batch,
                agent=None if name == "session+agent" else "")
        variants[name] = (ddp, opt, session, [])
        if session is not None:
            _time_bookkeeping(session)
    if with_agent:
        variants["session+agent"][2].client.wait_connected(10)
    b = args.global_batch // world
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(b, d_in, generator=g)
    y = torch.randn(b, d_out, generator=g)
    loss_fn = torch.nn.MSELoss()

    def plain_step(ddp, opt):
        loss = loss_fn(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(args.warmup + args.steps):
        for name, (ddp, opt, session, times) in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            if session is None:
                plain_step(ddp, opt)
            else:
                with session.step():
                    plain_step(ddp, opt)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1000)
    sent = None
    if with_agent:
        c = variants["session+agent"][2].client
        c.flush(5)
        sent = c.stats().messages_sent
    for _, _, session, _ in variants.values():
        if session:
            session.close()
    if rank == 0:
        med = {k: statistics.median(v[3]) for k, v in variants.items()}
        out = {"model": args.model, "world": world, "steps": args.steps,
               "parameters": sum(p.numel() for p in variants["plain"][0].parameters()),
               "median_step_ms": {k: round(v, 4) for k, v in med.items()},
               "overhead_ms": {k: round(med[k] - med["plain"], 4) for k in med if k != "plain"},
               "overhead_pct": {k: round(100 * (med[k] - med["plain"]) / med["plain"], 2)
                                for k in med if k != "plain"},
               "session_bookkeeping_ms_median": {
                   k: round(statistics.median(v[2].bookkeeping_ms[args.warmup:]), 4)
                   for k, v in variants.items() if v[2] is not None},
               "telemetry_frames_sent_rank0": sent}
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
