#!/bin/bash
# The checks that need a GPU, for a machine with an NVIDIA GPU, the CUDA toolkit, NCCL and
# PyTorch (e.g. PyTorch's CUDA wheels) but not necessarily this project's Debian packages:
#   1. benchmarks/live/nccl_check: the live worker's NCCL layer (env/live/nccl_comm.cc), built
#      here with g++ against the CUDA runtime and NCCL found on the machine;
#   2. tests/python/gpu_check.py: the PyTorch client's CUDA-event timing and compressed comm
#      hooks on a one-rank NCCL job;
#   3. benchmarks/gpu/gemm_efficiency.py: sustained bf16 GEMM rate for transformer layer shapes
#      (the cost model's gemm_efficiency).
# Usage: scripts/gpu-check.sh [OUT_DIR]   (prints everything; exit 1 if a check failed)
set -u
cd "$(dirname "$0")/.."
out=${1:-/tmp/parapilot-gpu-check}
mkdir -p "$out"
nvidia-smi -L || { echo "gpu-check: no NVIDIA GPU"; exit 2; }
py=${PYTHON:-python3}
cuda=${CUDA_HOME:-/usr/local/cuda}
find_one() { # first of NAME under the CUDA toolkit, the Python packages, /usr
  local site
  site=$($py -c "import site; print(' '.join(site.getsitepackages()))" 2>/dev/null)
  find -H "$cuda" $site /usr/include /usr/lib /opt 2>/dev/null -name "$1" -not -path '*triton*' |
    head -1
}
nccl_h=$(find_one nccl.h); nccl_so=$(find_one 'libnccl.so*'); cudart_h=$(find_one cuda_runtime.h)
cudart_so=$(find_one 'libcudart.so*')
echo "nccl.h: $nccl_h | libnccl: $nccl_so | cuda_runtime.h: $cudart_h | libcudart: $cudart_so"
status=0
if [ -n "$nccl_h" ] && [ -n "$nccl_so" ] && [ -n "$cudart_h" ] && [ -n "$cudart_so" ]; then
  g++ -std=c++20 -O2 -I. -I"$(dirname "$nccl_h")" -I"$(dirname "$cudart_h")" \
    benchmarks/live/nccl_check.cc env/live/nccl_comm.cc -o "$out/nccl_check" \
    "$nccl_so" "$cudart_so" -Wl,-rpath,"$(dirname "$nccl_so")":"$(dirname "$cudart_so")" \
    || status=1
  if [ -x "$out/nccl_check" ]; then
    "$out/nccl_check" --ranks 1 --mib 256 || status=1
    echo "-- two ranks on one GPU (NCCL may refuse a duplicate GPU; the layer must fail cleanly):"
    timeout 120 "$out/nccl_check" --ranks 2 --mib 64
    echo "   exit $?"
  fi
else
  echo "gpu-check: NCCL or the CUDA runtime not found; skipping nccl_check"; status=1
fi
PYTHONUNBUFFERED=1 timeout 300 $py tests/python/gpu_check.py || status=1
PYTHONUNBUFFERED=1 timeout 300 $py benchmarks/gpu/gemm_efficiency.py || status=1
exit $status
