#!/usr/bin/env bash
# apt-install.sh [APT-OPTION...] PACKAGE...: installs the Debian packages that are missing, one
# apt at a time (options such as --no-install-recommends go to `apt-get install`).
# CI builds the cluster's binaries while the Python environment installs, so two of this
# project's scripts may want apt at once; apt's own lock on its lists is not waited for
# (`DPkg::Lock::Timeout` covers dpkg's lock only) and the second `apt-get update` failed at
# once on a bare machine. A lock of our own serializes them; the timeout covers other apt users.
set -euo pipefail
options=()
while [ "$#" -gt 0 ] && [ "${1#-}" != "$1" ]; do options+=("$1"); shift; done
[ "$#" -gt 0 ] || exit 0
exec 9>/run/lock/hivekeeper-apt.lock
flock -w 1200 9 || { echo "apt-install.sh: another apt-get held the lock for 20 minutes" >&2; exit 1; }
missing=()
for p in "$@"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0  # installed by whoever held the lock before us
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${options[@]}" "${missing[@]}" >/dev/null
