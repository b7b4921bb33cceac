#!/usr/bin/env bash
# Runs the test suite; fails if pytest collects no tests (exit 5) instead of passing quietly.
# Without arguments, three tiers:
#   1. tests marked `isolated` (they fork hivemind averagers from the test process itself), in a
#      pytest process of their own;
#   2. everything else but the real cluster (the `netns` tests, volunteers behind a NAT in
#      network namespaces, need root and skip without it);
#   3. the real-cluster tier (tests/e2e): `scripts/cluster.sh up` builds and starts a Kubernetes
#      on this machine, the tests helm-install the operator and kubectl-apply every kind, and
#      `scripts/cluster.sh down` removes it all again. Needs root and Go; skipped without them,
#      or with HIVEKEEPER_E2E=0.
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

cluster_tier() {
  if [ "${HIVEKEEPER_E2E:-1}" = 0 ]; then
    echo "real-cluster tier skipped (HIVEKEEPER_E2E=0)" >&2
    return 0
  fi
  if [ "$(id -u)" != 0 ] || ! command -v go >/dev/null 2>&1; then
    echo "real-cluster tier skipped: it needs root and Go (scripts/cluster.sh)" >&2
    return 0
  fi
  trap 'scripts/cluster.sh down' EXIT
  scripts/cluster.sh up || return 1
  run -m e2e tests/e2e
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit $?
fi
run -m "isolated"
first=$?
run -m "not isolated and not e2e"
second=$?
cluster_tier
third=$?
for code in "$first" "$second" "$third"; do
  [ "$code" -ne 0 ] && exit "$code"
done
exit 0
