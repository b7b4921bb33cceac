#!/usr/bin/env bash
# Runs the test suite; fails if pytest collects no tests (exit 5) instead of passing quietly.
# Without arguments: tests marked `isolated` (they fork hivemind averagers from the test process
# itself) run first in a pytest process of their own, then everything else (the `netns` tests,
# volunteers behind a NAT in network namespaces, need root and skip without it).
set -uo pipefail
cd "$(dirname "$0")/.."

run() {
  .venv/bin/python -m pytest --durations=40 "$@"
  local code=$?
  if [ "$code" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
  fi
  return "$code"
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit $?
fi
run -m "isolated"
first=$?
run -m "not isolated"
second=$?
exit $(( first != 0 ? first : second ))
