#!/usr/bin/env bash
# Makes the virtual environment with torch 2.x from PyPI in which the Python client's suites run a
# second time (the `torch2` ctest entries; Debian's /usr/bin/python3 has torch 1.13). The packages
# are those pinned in scripts/torch2-requirements.txt, installed with Debian's Python 3.11 and
# without the system's site-packages.
#
#   bash scripts/install-torch2.sh [VENV]     # default /opt/parapilot/torch2
#
# The tests find it through the CMake cache variable PARAPILOT_TORCH2_PYTHON (default
# /opt/parapilot/torch2/bin/python); for another VENV, configure with
# -DPARAPILOT_TORCH2_PYTHON=VENV/bin/python. It lives outside the source tree so that one copy
# (about 5 GB) serves every checkout and CI's fresh clones on the machine, as the Debian packages do.
#
# Idempotent: nothing is done when VENV holds the set the requirements file pins (a stamp with the
# file's checksum, written last, and an import of torch at the pinned version); otherwise VENV is
# removed and made anew. It needs PyPI (about 3 GB of wheels: PyPI's Linux torch depends on the CUDA
# libraries) and exits non-zero when the set cannot be installed; scripts/install-deps.sh carries on
# without it, and the torch2 entries then report skipped.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-/opt/parapilot/torch2}"
requirements="$here/torch2-requirements.txt"
python=/usr/bin/python3
want=$(sed -n 's/^torch==//p' "$requirements")
sum=$(sha256sum "$requirements" | cut -d' ' -f1)
stamp="$venv/parapilot-requirements.sha256"

# The venv's torch version without the build's local tag (PyPI's wheel says 2.15.0+cu132).
torch_version() {
  "$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null
}

# One install at a time (checkouts and CI share the venv): the second waits, then finds it made.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ] &&
  [ "$(torch_version)" = "$want" ]; then
  echo "install-torch2: torch $want present in $venv"
  exit 0
fi
echo "install-torch2: making $venv with torch $want from PyPI"
start=$(date +%s)
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "install-torch2: $venv exists and is no virtual environment; leaving it alone" >&2
  exit 1
fi
rm -rf "$venv"
# A half-made environment is removed: the torch2 entries then say there is none.
trap 'rm -rf "$venv"' ERR
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --no-input --disable-pip-version-check \
  --progress-bar off --no-cache-dir --only-binary=:all: -r "$requirements"
got=$(torch_version) || true
[ "$got" = "$want" ] || { echo "install-torch2: $venv has torch $got, not $want" >&2; false; }
echo "$sum" > "$stamp"
echo "install-torch2: torch $got in $venv ($(du -sh "$venv" | cut -f1), $(($(date +%s) - start)) s)"
