#!/bin/sh
# Each benchmark given: `--help` prints its usage ("usage: NAME ...") and exits 0 at once,
# without measuring anything (10 s at most each).
if [ $# -eq 0 ]; then
  echo "help_check: no benchmark given: a check of nothing fails" >&2
  exit 1
fi
status=0
for bench in "$@"; do
  name=$(basename "$bench")
  if ! out=$(timeout 10 "$bench" --help 2>&1); then
    echo "$name --help: exit code not 0" >&2
    status=1
    continue
  fi
  case "$out" in
    "usage: $name"*) echo "$name --help: ok" ;;
    *) echo "$name --help: printed no usage line: $(echo "$out" | head -2)" >&2; status=1 ;;
  esac
done
exit $status
