#!/usr/bin/env bash
# Makes the virtual environment with TensorFlow (CPU) from PyPI in which the Python client's
# TensorFlow tests run (the `tensorflow` ctest entries; docs/tensorflow.md). The packages are those
# pinned in scripts/tf-requirements.txt, installed with Debian's Python 3.11, without the system's
# site-packages and without torch (parapilot.tensorflow must not need it).
#
#   bash scripts/install-tensorflow.sh [VENV]     # default /opt/parapilot/tf
#
# The tests find it through the CMake cache variable PARAPILOT_TF_PYTHON (default
# /opt/parapilot/tf/bin/python); for another VENV, configure with
# -DPARAPILOT_TF_PYTHON=VENV/bin/python. It lives outside the source tree so that one copy serves
# every checkout and CI's fresh clones on the machine.
#
# Idempotent: nothing is done when VENV holds the set the requirements file pins (a stamp with the
# file's checksum, written last, and an import of tensorflow at the pinned version); otherwise VENV
# is removed and made anew. It needs PyPI (about 300 MB of wheels, a 1.6 GB venv) and exits
# non-zero, saying so (2 when pip cannot install the set), when the set cannot be installed;
# scripts/install-deps.sh carries on without it, and the tensorflow entries then report skipped.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-/opt/parapilot/tf}"
requirements="$here/tf-requirements.txt"
python=/usr/bin/python3
want=$(sed -n 's/^tensorflow-cpu==//p' "$requirements")
sum=$(sha256sum "$requirements" | cut -d' ' -f1)
stamp="$venv/parapilot-requirements.sha256"

# The venv's TensorFlow version (its import also proves the install loads).
tf_version() {
  TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/python" -c 'import tensorflow as tf; print(tf.__version__)' \
    2>/dev/null
}

# One install at a time (checkouts and CI share the venv): the second waits, then finds it made.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ] && [ "$(tf_version)" = "$want" ]; then
  echo "install-tensorflow: tensorflow $want present in $venv"
  exit 0
fi
echo "install-tensorflow: making $venv with tensorflow-cpu $want from PyPI"
start=$(date +%s)
if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
  echo "install-tensorflow: $venv exists and is no virtual environment; leaving it alone" >&2
  exit 1
fi
rm -rf "$venv"
# A half-made environment is removed: the tensorflow entries then say there is none.
trap 'rm -rf "$venv"' ERR
"$python" -m venv "$venv"
if ! "$venv/bin/python" -m pip install --quiet --no-input --disable-pip-version-check \
  --progress-bar off --no-cache-dir --only-binary=:all: --no-deps -r "$requirements"; then
  echo "install-tensorflow: pip could not install scripts/tf-requirements.txt (is PyPI" \
    "reachable?); the tensorflow test entries will be skipped" >&2
  rm -rf "$venv"
  exit 2
fi
got=$(tf_version) || true
[ "$got" = "$want" ] || {
  echo "install-tensorflow: $venv has tensorflow '$got', not $want" >&2
  false
}
echo "$sum" > "$stamp"
echo "install-tensorflow: tensorflow $got in $venv ($(du -sh "$venv" | cut -f1)," \
  "$(($(date +%s) - start)) s)"
