"""The PyTorch client on a GPU (not a ctest: CI has no GPU; scripts/gpu-check.sh runs it).

One rank, NCCL, a model on CUDA: the session's CUDA-event timing (forward, backward, the
gradient collectives, resolved without synchronising) and the comm hook's compressed paths
(fp16, PowerSGD, top-k) on CUDA tensors. Prints what it measured; exits 1 when a check fails.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import parapilot.pytorch as ppt  # noqa: E402
from parapilot import telemetry_keys as keys, wire  # noqa: E402

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def main():
    cpu = "--cpu" in sys.argv  # a dry run of this script's logic on a machine without a GPU
    if not cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if cpu else "nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    width, batch = (256, 64) if cpu else (2048, 256)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in
                                  (torch.nn.Linear(width, width), torch.nn.ReLU())],
                                torch.nn.Linear(width, 1)).to(dev)
    ddp = DDP(model) if cpu else DDP(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    session = ppt.Session(ddp, opt, global_batch=batch)
    x = torch.randn(batch, width, device=dev)
    y = torch.randn(batch, 1, device=dev)
    n_layers = session._n_layers

    def train(steps):
        losses, walls = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            with session.step():
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(loss.item())
            walls.append((time.perf_counter() - t0) * 1000)
        session._emit(force=True)
        return losses, walls, session.last_telemetry

    def use(method, parameter):
        comp = [] if method is None else [wire.LayerCompression(0, n_layers - 1, method, parameter)]
        session._hook.config = session._build_config(0, [], comp, "")

    print(f"gpu_check: {'cpu' if cpu else torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    results = {}
    for name, method, parameter in [("none", None, 0.0), ("fp16", ppt.FP16, 0.0),
                                    ("powersgd r=4", ppt.POWERSGD, 4.0),
                                    ("topk 1%", ppt.TOPK, 0.01)]:
        use(method, parameter)
        losses, walls, t = train(20)
        c = t.collectives
        comm = c.get(keys.ALL_REDUCE_DP, wire.CollectiveStat()).bytes + \
            c.get(keys.ALL_GATHER_DP, wire.CollectiveStat()).bytes
        fwd, bwd = c[keys.PHASE_FORWARD].ms, c[keys.PHASE_BACKWARD].ms
        wall = (t.step_end_ns - t.step_start_ns) / 1e6
        results[name] = comm
        print(f"  {name:13s} loss {losses[0]:.4f} -> {losses[-1]:.4f}; last step: wall "
              f"{wall:.2f} ms, timers: forward {fwd:.3f} ms, backward {bwd:.3f} ms, "
              f"compute {t.compute_ms:.3f} ms; gradient bytes {comm:,}; median step "
              f"{sorted(walls)[len(walls) // 2]:.2f} ms", flush=True)
        check(all(l == l and l < float("inf") for l in losses), f"{name}: finite losses")
        check(fwd > 0 and bwd > 0 and 0 < t.compute_ms <= wall + 1.0,
              f"{name}: CUDA-event timings positive and within the step")
        check(keys.info(t, keys.SAMPLES) == batch, f"{name}: info/samples = {batch}")
    full = results["none"]
    check(full > 0, "uncompressed gradient bytes counted")
    check(abs(results["fp16"] / full - 0.5) < 0.01, "fp16 sends half the bytes")
    check(results["powersgd r=4"] < 0.1 * full, "PowerSGD r=4 sends under 10% of the bytes")
    check(results["topk 1%"] < 0.05 * full, "top-k 1% sends under 5% of the bytes")
    session.close()
    dist.destroy_process_group()
    print("gpu_check: " + ("all checks passed" if not failures else f"{len(failures)} FAILED"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
