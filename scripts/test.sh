#!/usr/bin/env bash
# Runs the test suite; fails if pytest collects no tests (exit 5) instead of passing quietly.
# Without arguments, four tiers:
#   1. isolated: tests that fork hivemind averagers from the test process itself, in a pytest
#      process of their own;
#   2. unit: everything that starts no swarm (specs, planners, the operator against the
#      emulator, the chart, the docs), two pytest workers at once (pytest-xdist);
#   3. swarm: real hivemind peers on loopback, one at a time; then netns: volunteers behind a
#      NAT in network namespaces (they need root and skip without it), once the cluster tier
#      is done;
#   4. cluster: the real-cluster tier (tests/e2e): `scripts/cluster.sh up` starts a Kubernetes
#      on this machine (waiting for binaries and an image that CI may still be building), the
#      tests helm-install the operator and kubectl-apply every kind, and `scripts/cluster.sh
#      down` removes it all again. Needs root and Go; skipped without them, or with
#      HIVEKEEPER_E2E=0.
# The cluster tier runs beside the unit and swarm tiers: `cluster.sh up` starts at once, its
# tests once the isolated tier is done; its output goes to a log that is printed when it ends
# (in $HIVEKEEPER_CI_DIR, or a temporary folder). The
# tiers' tests wait for events, never for fixed windows, so a busier machine makes them slower,
# not different (the swarm tests most sensitive to timing pass with a busy loop on each core:
# docs/explanation/testing.md). The netns tier waits for it: both change network namespaces and
# iptables. (On a bare machine the netns tier could run while the cluster's binaries build,
# but it takes the CPU the niced builds need: tried, the binaries took 48 minutes instead of
# 27, and the cluster tier, the longest, started that much later.)
# (Tried too, in a warm run of 67465ff: the netns tier right after the cluster tier, beside the
# swarm tier. At 98% CPU the two slowed each other, to 29:07 and 38:47, and the run took 59:14;
# the run of 7fcf9d8 before it, one tier after the other, took 21:11 and 25:02, and 61:18 in
# all, with a hang reproduction beside its last 25 minutes. Less work helps, not overlap.)
# HIVEKEEPER_CLUSTER_BESIDE=0 runs the cluster tier last instead.
# Every tier runs even when an earlier one failed; the exit code is the first failure's.
# With $HIVEKEEPER_REPORTS, each tier writes its JUnit XML there (CI's slowest-tests summary),
# and with $HIVEKEEPER_PHASES each tier's time is recorded (scripts/phases.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/phases.sh

run() {
  .venv/bin/python -m pytest --durations=25 "$@"
  local code=$?
  if [ "$code" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
  fi
  return "$code"
}

# tier NAME PYTEST-ARGS...
# Tracebacks are Python's own (--tb=native): pytest's, which parse each frame's source with the
# ast module, hit CPython 3.11's AST recursion-depth bug (python/cpython#106905) now and then,
# and that INTERNALERROR ends the whole tier at the first failure instead of reporting it.
tier() {
  local name=$1
  shift
  local junit=()
  [ -n "${HIVEKEEPER_REPORTS:-}" ] && junit=(--junitxml "$HIVEKEEPER_REPORTS/$name.xml")
  echo "=== tier $name ===" >&2
  phase "tier: $name" run --tb=native "${junit[@]}" "$@"
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
  trap 'phase "cluster: down" scripts/cluster.sh labs down' EXIT
  phase "cluster: up" scripts/cluster.sh up || return 1
  phase "cluster: up lab b, the WAN" bash -c 'scripts/cluster.sh up b && scripts/cluster.sh wan up' || return 1
  wait_for_isolated
  # Each wait the e2e tests make prints how long it took: the report keeps it for every test,
  # so a slow run shows where its time went.
  tier cluster -m e2e -o junit_logging=system-out -o junit_log_passing_tests=true tests/e2e
}

# The cluster tier's pods (ten of them importing torch at once) starve the isolated tier's
# averagers on two cores: their tests failed twice in CI for parts that arrived late. The tier
# waits for the isolated one to end (a file); it ends long before the swarm tier either way.
isolated_done=$(mktemp -u /tmp/hivekeeper-isolated-done.XXXXXX)
wait_for_isolated() {
  local waited=0
  while [ ! -e "$isolated_done" ] && [ "$waited" -lt 1800 ]; do
    sleep 2
    waited=$((waited + 2))
  done
}

if [ "$#" -gt 0 ]; then
  run "$@"
  exit $?
fi
codes=()
beside=${HIVEKEEPER_CLUSTER_BESIDE:-1}
if [ "$beside" = 1 ]; then
  cluster_log=${HIVEKEEPER_CI_DIR:-$(mktemp -d /tmp/hivekeeper-test.XXXXXX)}/cluster-tier.log
  echo "=== tier cluster, beside the others: its output goes to $cluster_log ===" >&2
  cluster_tier >"$cluster_log" 2>&1 &
  cluster_job=$!
fi
tier isolated -m "isolated"; codes+=($?)
touch "$isolated_done"
tier unit -n 2 -m "not isolated and not e2e and not swarm and not netns"; codes+=($?)
tier swarm -m "not isolated and not e2e and swarm and not netns"; codes+=($?)
if [ "$beside" = 1 ]; then
  wait "$cluster_job"; codes+=($?)
  echo "=== tier cluster (ran beside the others) ===" >&2
  cat "$cluster_log" >&2
fi
# The namespace tests change network namespaces and iptables as the cluster does: never both.
tier netns -m "not isolated and not e2e and netns"; codes+=($?)
if [ "$beside" != 1 ]; then
  cluster_tier; codes+=($?)
fi
rm -f "$isolated_done"
for code in "${codes[@]}"; do
  [ "$code" -ne 0 ] && exit "$code"
done
exit 0
