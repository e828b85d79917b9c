"""A small DDP training job used by the Python tests: one process per rank, configured with
torchrun's environment variables and a JSON config in argv[1]; writes a JSON result per rank.

Config keys: steps, global_batch, initial_shares, slow_rank, slow_ms, step_sleep_ms, reference
(rank 0 steps a plain model on the full global batch from the job's parameters before each step
and records the largest difference of the updated parameters),
until_plans (keep going until this many plans were applied, up to steps), stop_file (stop when it
exists), cut_links_rank / cut_links_file (that rank cuts its connections to its peers, keeping the
store and the agent, before the first step after the file exists; parapilot.peer_failure), out (result
path prefix), heartbeat_timeout_ms (the bus client's: the agent declared dead after this much
silence, and never less than twice the heartbeat interval the agent announces; default 1000 so
that reconnect tests against the scripted agent's 200 ms heartbeat are quick), layers_compression_probe; for attribution: buffers (the model
gets a batch norm, whose buffers DDP broadcasts at every forward), log_all_reduce (a loss
all-reduce after every step), async_all_reduce (the same with async_op=True and wait()),
barrier_every (a barrier between steps every N), outside_every / outside_ms (sleep that long
inside session.outside_steps() every N steps), gap_at / gap_ms (an unmarked sleep before step
gap_at), slow_after_ms (slow_rank also sleeps that long after its optimizer step, inside the
step), funcol_all_reduce (inside each step, after that: a loss all-reduce through torch 2.x's
functional collectives, its result read); torch2_idioms (torch 2.x: DDP with static_graph and
gradient_as_bucket_view, run through torch.compile, the forward under bf16 autocast; slow_ms is
then slept in the step before the forward instead of in a forward hook); hidden (the model's width, default 64: a wider model sends more gradient bytes).

A rank whose session raises PeerLost writes its result with "failed" (the message) and exits 3.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import parapilot.pytorch as ppt
from parapilot import peer_failure, telemetry_keys as keys, wire


def make_model(buffers=False, hidden=64):
    torch.manual_seed(1234)
    norm = [torch.nn.BatchNorm1d(hidden)] if buffers else []
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), *norm, torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 4))


def make_data(n=2048):
    g = torch.Generator()
    g.manual_seed(99)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 4, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    cfg = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(cfg.get("buffers", False), cfg.get("hidden", 64))
    idioms = cfg.get("torch2_idioms", False)
    ddp = DDP(model, bucket_cap_mb=cfg.get("bucket_cap_mb", 25),
              **({"static_graph": True, "gradient_as_bucket_view": True} if idioms else {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = make_data()
    B = cfg.get("global_batch", 16)
    session = ppt.Session(ddp, opt, global_batch=B, initial_shares=cfg.get("initial_shares"),
                          grad_stats_every=cfg.get("grad_stats_every", 10),
                          client_options={"heartbeat_interval_ms": 200,
                                          "heartbeat_timeout_ms": cfg.get("heartbeat_timeout_ms", 1000),
                                          "reconnect_initial_ms": 20, "reconnect_max_ms": 200})
    telemetry_before = session.last_telemetry  # None, not an AttributeError
    sampler = session.batch_sampler(data, seed=5)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    ref = ref_opt = None
    if cfg.get("reference") and rank == 0:
        ref = make_model(hidden=cfg.get("hidden", 64))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    slow_rank, slow_ms = cfg.get("slow_rank", -1), cfg.get("slow_ms", 0)
    if rank == slow_rank and slow_ms and not idioms:
        even = B / world  # slower in proportion to the samples it gets, like a slow device
        ddp.register_forward_pre_hook(lambda m, i: time.sleep(slow_ms / 1000.0 * i[0].shape[0] / even))
    forward = ddp
    if idioms:
        compiled = torch.compile(ddp)
        late = slow_ms / 1000.0 if rank == slow_rank else 0.0

        def forward(x):
            time.sleep(late)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return compiled(x).float()
    records = []
    failed = None
    try:
        max_diff = train(cfg, session, forward, model, opt, data, loader, sampler, ref, ref_opt,
                         records)
    except ppt.PeerLost as e:
        failed, max_diff = str(e), 0.0
    stats = session.client.stats() if session.client else None
    session.close()
    with torch.no_grad():
        digest = float(sum(p.double().sum() for p in model.parameters()))
    out = {"rank": rank, "world": world, "records": records, "applied": session.applied_plans,
           "events": session.book.events, "max_diff": max_diff, "digest": digest,
           "shares": session.shares, "stop_reason": session.stop_reason,
           "connects": stats.connects if stats else 0, "gaps_excluded": session.gaps_excluded,
           "telemetry_before_first_step": repr(telemetry_before), "failed": failed,
           "step_index": session.step_index}
    with open(f"{cfg['out']}.{rank}.json", "w") as f:
        json.dump(out, f)
    if failed is not None:
        sys.stdout.flush()
        os._exit(3)  # the process groups are broken: no teardown that could wait on them
    dist.destroy_process_group()


def train(cfg, session, ddp, model, opt, data, loader, sampler, ref, ref_opt, records):
    """The training loop (ddp: the job's forward); returns the largest difference from the
    reference."""
    rank = dist.get_rank()
    B = cfg.get("global_batch", 16)
    g = torch.Generator() if ref is not None else None
    loss_fn = torch.nn.MSELoss()
    steps = cfg.get("steps", 20)
    max_diff = 0.0
    applied_seen, applied_at = 0, 0
    epoch = 0
    done = False
    while not done:
        sampler.set_epoch(epoch)
        if ref is not None:
            g.manual_seed(5 + epoch)
            order = torch.randperm(len(data), generator=g).tolist()
        for i, (x, y) in enumerate(loader):
            step = session.step_index
            if ref is not None:
                # The reference starts every step from the job's parameters and momentum, so the
                # check compares each step's update (float32 rounding of one step), not two
                # trajectories that drift apart through rounding over hundreds of steps.
                with torch.no_grad():
                    for a, b in zip(ref.parameters(), model.parameters()):
                        a.copy_(b)
                for a, b in zip(ref.parameters(), model.parameters()):
                    buf = opt.state.get(b, {}).get("momentum_buffer")
                    if buf is not None:
                        ref_opt.state[a]["momentum_buffer"] = buf.clone()
            if rank == cfg.get("cut_links_rank", -1) and not session.fault_note and \
                    os.path.exists(cfg.get("cut_links_file", "")):
                agent = os.environ.get("PARAPILOT_AGENT", "")
                keep = [int(os.environ["MASTER_PORT"])] + ([int(agent.rsplit(":", 1)[1])] if agent else [])
                n = peer_failure.cut_peer_links(keep)
                session.fault_note = f"links to its peers cut before step {step} ({n} connections)"
            if step == cfg.get("gap_at", -1):
                time.sleep(cfg.get("gap_ms", 0) / 1000.0)
            with session.step():
                loss = loss_fn(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if rank == cfg.get("slow_rank") and cfg.get("slow_after_ms"):
                    time.sleep(cfg["slow_after_ms"] / 1000.0)
                if cfg.get("funcol_all_reduce"):
                    from torch.distributed import _functional_collectives as funcol
                    float(funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD))
            if cfg.get("log_all_reduce"):
                dist.all_reduce(loss.detach().clone())
            if cfg.get("async_all_reduce"):
                dist.all_reduce(loss.detach().clone(), async_op=True).wait()
            if cfg.get("barrier_every") and step % cfg["barrier_every"] == 0:
                dist.barrier()
            if cfg.get("outside_every") and step % cfg["outside_every"] == cfg["outside_every"] - 1:
                with session.outside_steps():
                    time.sleep(cfg.get("outside_ms", 0) / 1000.0)
                    dist.barrier()
            t = session.last_telemetry
            records.append({"step": step, "plan": keys.info(t, keys.PLAN),
                            "samples": len(x),
                            "all_reduce_bytes": t.collectives.get(keys.ALL_REDUCE_DP, wire.CollectiveStat()).bytes,
                            "all_gather_bytes": t.collectives.get(keys.ALL_GATHER_DP, wire.CollectiveStat()).bytes,
                            "compute_ms": t.compute_ms, "loss": loss.item(),
                            "cycle_ms": (t.step_end_ns - t.step_start_ns) / 1e6,
                            "waits": {k: [c.ms, c.calls] for k, c in t.collectives.items()
                                      if k.startswith("wait/") or k.endswith("/script")
                                      or k == keys.BROADCAST_BUFFERS}})
            if ref is not None:
                idx = order[i * B:(i + 1) * B]
                xb, yb = data[idx]
                rl = loss_fn(ref(xb), yb)
                ref_opt.zero_grad()
                rl.backward()
                ref_opt.step()
                with torch.no_grad():
                    d = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
                max_diff = max(max_diff, d)
                records[-1]["diff"] = d
            if cfg.get("step_sleep_ms"):
                time.sleep(cfg["step_sleep_ms"] / 1000.0)
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
