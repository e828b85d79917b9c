#!/usr/bin/env bash
# Builds the libFuzzer target of the transport frame decoder and message parser with clang-14
# (ASan + UBSan) and runs it for a given duration.
#   scripts/fuzz-transport.sh [seconds=600] [jobs=1]
# Work files go to $FUZZ_OUT (default build-fuzz-transport/; corpus in corpus/). Inputs that
# crash are written to crashes/ there; copy them to tests/data/fuzz-transport/, where
# tests/transport/test_codec.cc replays them in the normal test run.
# Exit status: 0 when the run found nothing, 1 when it found a crash (or failed to build), 77
# (ctest's "skipped") when clang-14 or its libFuzzer runtime is missing (scripts/install-deps.sh
# installs both). The ctest entry fuzz_transport runs it for 30 s on every test run.
set -euo pipefail
seconds=${1:-600}
jobs=${2:-1}
root=$(cd "$(dirname "$0")/.." && pwd)
out=${FUZZ_OUT:-"$root/build-fuzz-transport"}
mkdir -p "$out/corpus" "$out/crashes"
rm -f "$out"/crashes/*

CXX=${CXX_FUZZ:-clang++-14}
if ! command -v "$CXX" >/dev/null; then
  echo "fuzz-transport: skipped: $CXX not found (Debian package clang-14)" >&2
  exit 77
fi
# The libFuzzer runtime ships in libclang-rt-14-dev.
if ! dpkg-query -W -f='${Status}' libclang-rt-14-dev 2>/dev/null | grep -q "install ok installed"; then
  echo "fuzz-transport: skipped: libclang-rt-14-dev (the libFuzzer runtime) is not installed" >&2
  exit 77
fi

srcs=("$root/transport/messages.cc" "$root/transport/frame.cc" "$root/core/checksum.cc")
flags=(-std=c++20 -O1 -g -I"$root" -fno-omit-frame-pointer)

echo "fuzz-transport: building"
"$CXX" "${flags[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  "$root/tests/transport/fuzz/fuzz_transport.cc" "${srcs[@]}" -o "$out/fuzz_transport"
"$CXX" "${flags[@]}" "$root/tests/transport/fuzz/make_seeds.cc" "${srcs[@]}" -o "$out/make_seeds"
"$out/make_seeds" "$out/corpus"
# Known regression inputs seed the corpus too.
if compgen -G "$root/tests/data/fuzz-transport/*" >/dev/null; then
  cp "$root"/tests/data/fuzz-transport/* "$out/corpus/"
fi

parallel=()
if [ "$jobs" -gt 1 ]; then parallel=(-jobs="$jobs" -workers="$jobs"); fi
echo "fuzz-transport: running for ${seconds}s"
cd "$out"
"$out/fuzz_transport" "$out/corpus" -max_total_time="$seconds" -max_len=8192 -rss_limit_mb=2048 \
  -artifact_prefix="$out/crashes/" -print_final_stats=1 "${parallel[@]}" 2>&1 | tee "$out/fuzz.log"
crashes=$(find "$out/crashes" -type f | wc -l)
echo "fuzz-transport: crashes found: $crashes"
[ "$crashes" -eq 0 ]
