"""Sustained bf16 GEMM rate on this machine's GPU for the matrix shapes of transformer layers,
as a fraction of the datasheet peak: the number the cost model calls gemm_efficiency
(strategy/cluster.cc). Run on a GPU machine with PyTorch:

    python3 benchmarks/gpu/gemm_efficiency.py [--peak-tflops 989]

Each shape: three warm-up products, then the median of 20 timed with CUDA events.
"""

import argparse

import torch

# (tokens, in, out) of the forward GEMMs of one layer: QKV, attention out, MLP up/gate, MLP down.
SHAPES = {
    "llama2-7b": [(4096, 4096, 3 * 4096), (4096, 4096, 4096), (4096, 4096, 11008),
                  (4096, 11008, 4096)],
    "llama2-70b tp8": [(4096, 8192, (8192 + 2 * 1024) // 8), (4096, 1024, 8192),
                       (4096, 8192, 28672 // 8), (4096, 28672 // 8, 8192)],
    "gpt3-175b tp8": [(2048, 12288, 3 * 12288 // 8), (2048, 12288 // 8, 12288),
                      (2048, 12288, 4 * 12288 // 8), (2048, 4 * 12288 // 8, 12288)],
    "square 8192": [(8192, 8192, 8192)],
}


def rate(m, k, n):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    ms = sorted(times)[len(times) // 2]
    return 2 * m * k * n / ms / 1e9  # TFLOP/s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, peak {args.peak_tflops} "
          "TFLOP/s (bf16 dense)")
    for model, shapes in SHAPES.items():
        total_flop = sum(2 * m * k * n for m, k, n in shapes)
        total_ms = 0.0
        parts = []
        for m, k, n in shapes:
            r = rate(m, k, n)
            total_ms += 2 * m * k * n / r / 1e9
            parts.append(f"{m}x{k}x{n} {r:.0f}")
        layer = total_flop / total_ms / 1e9
        print(f"{model:15s} layer GEMMs {layer:6.0f} TFLOP/s = {layer / args.peak_tflops:.3f} of "
              f"peak  ({'; '.join(parts)})")


if __name__ == "__main__":
    main()
