#!/usr/bin/env bash
# Runs the test suite; fails if pytest collects no tests (exit 5) instead of passing quietly.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
code=$?
if [ "$code" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
fi
exit "$code"
