#!/usr/bin/env bash
# Installs parapilot's build and test dependencies from Debian 12 packages (run as root).
# CUDA and NCCL are optional and not installed here; they are used when found under /usr/local/cuda.
# Last, the virtual environments from PyPI: torch 2.x for the Python client's torch2 test entries
# (scripts/install-torch2.sh) and TensorFlow for its tensorflow entries
# (scripts/install-tensorflow.sh); without them (no network to PyPI) everything else still builds
# and runs, and those entries report skipped.
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev libboost-dev libcereal-dev libcli11-dev doctest-dev libtomlplusplus-dev
  nlohmann-json3-dev libzmq3-dev cppzmq-dev gnuplot-nox python3 python3-torch python3-venv
  clang-14 libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all packages present"
fi
bash "$(dirname "$0")/install-torch2.sh" ||
  echo "install-deps: no torch 2.x environment (see above); the torch2 test entries will be skipped" >&2
bash "$(dirname "$0")/install-tensorflow.sh" ||
  echo "install-deps: no TensorFlow environment (see above); the tensorflow test entries will be skipped" >&2
