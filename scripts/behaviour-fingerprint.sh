#!/usr/bin/env bash
# Prints a fingerprint of what the product computes, for checking that a refactor changed nothing:
# `eval --json` on the six scenario families (every default policy, plus lookahead and a trace
# replay of a recorded episode), and bench_env's fixed-work checksums.
#
#   scripts/behaviour-fingerprint.sh BUILD_DIR > after.txt
#   diff before.txt after.txt        # empty when behaviour is unchanged
#
# Each line is "what sha256"; a differing line names the run whose output changed.
set -euo pipefail
build=${1:?usage: behaviour-fingerprint.sh BUILD_DIR}
cli=$(realpath "$build/parapilot")
bench=$(realpath "$build/benchmarks/env/bench_env")
for exe in "$cli" "$bench"; do
  [[ -x $exe ]] || { echo "behaviour-fingerprint: $exe is not built" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for family in hetero straggler congestion failure phase mixed; do
  "$cli" eval --scenario "$family" --episodes 3 --json > "$tmp/eval.json"
  echo "eval-$family $(sha256sum < "$tmp/eval.json" | cut -d' ' -f1)"
  "$cli" eval --scenario "$family" --episodes 2 --policies 'lookahead(k=4,h=6),reactive' --json \
    > "$tmp/lookahead.json"
  echo "eval-lookahead-$family $(sha256sum < "$tmp/lookahead.json" | cut -d' ' -f1)"
done
# The env id (and so the JSON) holds the trace's path: the same relative one every run.
(cd "$tmp" &&
  "$cli" eval --scenario straggler --episodes 1 --policies static --record rec.csv > /dev/null &&
  "$cli" eval --scenario trace:rec.csv --episodes 2 --policies rl,static,reactive --json \
    > trace.json)
echo "eval-trace $(sha256sum < "$tmp/trace.json" | cut -d' ' -f1)"
# The checksum column only: steps/s depends on the machine.
"$bench" --steps 2000 sim:hetero sim:straggler sim:congestion sim:failure sim:phase sim:mixed \
  'sim:mixed(gpus=1024)' | awk 'NR > 1 { print "bench_env-" $1, $4 }'
