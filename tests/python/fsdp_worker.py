"""A small FSDP2 training job used by the Python tests and benchmarks/live/fsdp_mixed.py: one
process per rank, configured with torchrun's environment variables and a JSON config in argv[1];
writes a JSON result per rank. Every Linear and the root are wrapped with fully_shard; the
session is parapilot.pytorch.FSDPSession and the loss is scaled by session.loss_scale.

Config keys:
  steps, global_batch (default 32), initial_shares, seed (the sampler's, default 5)
  model: "mlp" (a small MLP; dtype "float64" or "float32") or "device" (job_shapes.Model,
      float32, on an emulated device: job_shapes.Device, its time slept)
  device_where / speeds: "device" model: rank r's device is Device(device_where, speeds[r]) (where:
      "forward", "backward", "data", "optimizer" or "mixed"; default all 1: healthy)
  reference: rank 0 also trains a plain (unsharded) copy of the model on the full global batch
      and records, after every step, the largest difference of the job's (gathered) parameters
  until_plans / steps_after: stop this many steps after the until_plans-th plan applied
  agent: the agent's address (default: env PARAPILOT_AGENT)
  out: result path prefix (harness.launch sets it)
Per rank: records (per step: plan, samples, loss_scale, compute_ms, cycle_ms, waits and the FSDP
collectives as [ms, calls]), step_ms (wall time of each step), applied, final counts, max_diff.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import parapilot.pytorch as ppt
from parapilot import telemetry_keys as keys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

REPORTED = (keys.WAIT_DP, keys.WAIT_OTHER, keys.ALL_GATHER_FSDP, keys.REDUCE_SCATTER_FSDP,
            keys.PHASE_OPTIMIZER)


def fully_shard_fn():
    try:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard  # torch 2.4-2.5
    return fully_shard


def make_mlp(dtype):
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4)).to(dtype)


def make_data(cfg, dtype):
    g = torch.Generator().manual_seed(99)
    n = cfg.get("global_batch", 32) * 16
    if cfg.get("model", "mlp") == "device":
        import job_shapes
        return torch.utils.data.TensorDataset(
            torch.randn(n, job_shapes.FEATURES, generator=g),
            torch.randint(0, job_shapes.CLASSES, (n,), generator=g))
    x = torch.randn(n, 16, generator=g, dtype=dtype)
    return torch.utils.data.TensorDataset(x, x[:, :4] * 2 + 0.1 * torch.randn(n, 4, generator=g,
                                                                               dtype=dtype))


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    B = cfg.get("global_batch", 32)
    fully_shard = fully_shard_fn()
    device = None
    if cfg.get("model", "mlp") == "device":
        import job_shapes
        torch.manual_seed(0)
        model = job_shapes.Model(buffers=False)
        speeds = cfg.get("speeds") or [1.0] * world
        device = job_shapes.Device(cfg.get("device_where", "mixed"), speeds[rank], B // world)
        model.device = device
        dtype = torch.float32
        loss_fn = torch.nn.functional.cross_entropy
    else:
        dtype = torch.float64 if cfg.get("dtype", "float64") == "float64" else torch.float32
        model = make_mlp(dtype)
        loss_fn = torch.nn.functional.mse_loss
    ref = ref_opt = None
    if cfg.get("reference") and rank == 0:
        ref = make_mlp(dtype)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if device is not None:
        inner = opt.step

        def device_step(*a, **kw):
            device.at("optimizer", 0)
            return inner(*a, **kw)
        opt.step = device_step
    session = ppt.FSDPSession(model, opt, global_batch=B, agent=cfg.get("agent"),
                              initial_shares=cfg.get("initial_shares"),
                              client_options={"heartbeat_interval_ms": 200,
                                              "reconnect_initial_ms": 20,
                                              "reconnect_max_ms": 200})
    data = make_data(cfg, dtype)

    def collate(batch):
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        if device is not None:
            device.at("data", len(batch))
        return x, y
    sampler = session.batch_sampler(data, seed=cfg.get("seed", 5))
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=collate)
    records, step_ms = [], []
    max_diff = train(cfg, session, model, opt, loss_fn, data, loader, sampler, ref, ref_opt,
                     records, step_ms)
    counts = session.local_counts()
    applied = list(session.applied_plans)
    session.close()
    out = {"rank": rank, "world": world, "records": records, "step_ms": step_ms,
           "applied": applied, "final_counts": counts, "max_diff": max_diff,
           "framework": session.framework}
    with open(f"{cfg['out']}.{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()  # Gloo aborts at exit when a rank tears down while a peer still sends
    dist.destroy_process_group()


def gathered(model):
    """The job's full parameters (a collective: every rank calls it)."""
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach()
            for p in model.parameters()]


def train(cfg, session, model, opt, loss_fn, data, loader, sampler, ref, ref_opt, records,
          step_ms):
    """The training loop; returns the largest parameter difference from the reference."""
    B = cfg.get("global_batch", 32)
    steps = cfg.get("steps", 20)
    max_diff = 0.0
    applied_seen, applied_at = 0, 0
    epoch = 0
    done = False
    while not done:
        sampler.set_epoch(epoch)
        if ref is not None:
            g = torch.Generator().manual_seed(cfg.get("seed", 5) + epoch)
            order = torch.randperm(len(data), generator=g).tolist()
        for i, (x, y) in enumerate(loader):
            step = session.step_index
            t0 = time.perf_counter()
            with session.step():
                opt.zero_grad()
                loss = loss_fn(model(x), y) * session.loss_scale
                loss.backward()
                opt.step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            t = session.last_telemetry
            records.append({
                "step": step, "plan": keys.info(t, keys.PLAN), "samples": len(x),
                "loss_scale": session.loss_scale, "compute_ms": t.compute_ms,
                "cycle_ms": (t.step_end_ns - t.step_start_ns) / 1e6,
                "waits": {k: [c.ms, c.calls] for k, c in t.collectives.items() if k in REPORTED}})
            if ref is not None or cfg.get("reference"):
                with session.outside_steps():
                    full = gathered(model)
            if ref is not None:
                xb, yb = data[order[i * B:(i + 1) * B]]
                ref_opt.zero_grad()
                loss_fn(ref(xb), yb).backward()
                ref_opt.step()
                with torch.no_grad():
                    d = max(float((a - b).abs().max()) for a, b in zip(full, ref.parameters()))
                max_diff = max(max_diff, d)
                records[-1]["diff"] = d
            n_applied = len(session.applied_plans)
            if n_applied != applied_seen:
                applied_seen, applied_at = n_applied, session.step_index
            if session.should_stop or session.step_index >= steps:
                done = True
            elif cfg.get("until_plans") and n_applied >= cfg["until_plans"] and \
                    session.step_index >= applied_at + cfg.get("steps_after", 3):
                done = True
            if done:
                break
        epoch += 1
    return max_diff


if __name__ == "__main__":
    main()
