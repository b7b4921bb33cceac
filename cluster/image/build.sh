#!/usr/bin/env bash
# Builds hivekeeper's runtime image from the project's own Dockerfile, with buildah (from Debian)
# on a Debian bookworm base made here by mmdebstrap, and a tiny static "pause" sandbox image; both
# are written as image archives that containerd imports with their names:
#
#   ctr -n k8s.io images import "$ARCHIVE"        # -> localhost/hivekeeper:e2e
#
# Usage: cluster/image/build.sh [--image REF] [--pause-image REF] [--out DIR] [--verify] [--force]
#   --image REF        the image's name (default $HIVEKEEPER_IMAGE or localhost/hivekeeper:e2e);
#                      fully qualified, so that a pod spec naming the same string matches it
#                      (containerd would store a bare `hivekeeper:e2e` as docker.io/library/...)
#   --pause-image REF  the sandbox image (default $HIVEKEEPER_PAUSE_IMAGE or localhost/hivekeeper-pause:e2e)
#   --out DIR          where the archives and images.env go (default $CACHE/archives)
#   --verify           run checks inside the built images (hivekeeper --version, import torch, ...)
#   --force            ignore the archives' keys: run the build (buildah's layer cache still applies)
# Prints, last, on stdout:
#   IMAGE=<ref> ARCHIVE=<path>
#   PAUSE_IMAGE=<ref> PAUSE_ARCHIVE=<path>
# and writes the same (plus IMAGE_ID, PAUSE_IMAGE_ID: config digests) to DIR/images.env.
#
# Needs root (apt-get, mmdebstrap, buildah's chroot isolation); installs buildah, mmdebstrap and,
# if there is no Go, golang-go. Everything slow is cached under CACHE=${HIVEKEEPER_CACHE:-~/.cache/hivekeeper}/image:
#   base/<key>.tar     the mmdebstrap rootfs, keyed by suite, mirrors and package list
#   storage/           buildah's storage (overlay; storage-vfs/ where overlay does not work): the
#                      base image and the build's layers (--layers), so an unchanged step is reused
#   archives/          the archives, each with a .key (a hash of everything the image is made of:
#                      Dockerfile, .dockerignore, pyproject.toml, README.md, LICENSE,
#                      scripts/requirements.py, services/, operator/,
#                      the build args), so an unchanged tree rebuilds and rewrites nothing
# pip in the build installs from the wheelhouse scripts/install.sh fills ($CACHE/../wheels, mounted
# read-only, never in the image), so nothing is downloaded a second time; without one, from the
# index. Environment: TORCH_INDEX_URL (default https://pypi.org/simple: PyPI's torch, with its CUDA
# libraries; it runs on CPU), HIVEKEEPER_DEBIAN_MIRROR, HIVEKEEPER_DEBIAN_SECURITY_MIRROR.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/cluster/image
IMAGE=${HIVEKEEPER_IMAGE:-localhost/hivekeeper:e2e}
PAUSE_IMAGE=${HIVEKEEPER_PAUSE_IMAGE:-localhost/hivekeeper-pause:e2e}
CACHE=${HIVEKEEPER_CACHE:-$HOME/.cache/hivekeeper}/image
OUT=
VERIFY=0
FORCE=0
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}
MIRROR=${HIVEKEEPER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${HIVEKEEPER_DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
SUITE=bookworm
# What the image needs from Debian at run time. torch's wheel brings its own libgomp, hivemind's
# wheel a static p2pd; libstdc++6 and zlib come with minbase (apt needs them).
BASE_PACKAGES=(python3 python3-venv ca-certificates)
WHEELHOUSE=${HIVEKEEPER_CACHE:-$HOME/.cache/hivekeeper}/wheels
# Bumped whenever this script changes what it writes: the archives' keys include it.
FORMAT=2

while [ $# -gt 0 ]; do
  case $1 in
    --image) IMAGE=$2; shift 2 ;;
    --pause-image) PAUSE_IMAGE=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --verify) VERIFY=1; shift ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$CACHE/archives}
case $IMAGE$PAUSE_IMAGE in *@*) echo "build.sh: give tags, not digests" >&2; exit 2 ;; esac

START=$EPOCHREALTIME
# Seconds since $1, to a tenth (bash's EPOCHREALTIME: no forks).
secs() { local d=$(( ${EPOCHREALTIME/./} - ${1/./} )); printf '%d.%d' $((d / 1000000)) $((d % 1000000 / 100000)); }
log() { printf '[image %6s s] %s\n' "$(secs "$START")" "$*" >&2; }
since() { echo "$(secs "$1") s"; }
sha() { sha256sum | cut -c1-16; }
file_name() { local n=${1#localhost/}; n=${n//\//-}; echo "${n//:/-}.tar"; }

mkdir -p "$CACHE" "$OUT"
exec 9>"$CACHE/.lock"
if ! flock -n 9; then
  log "another build.sh holds $CACHE/.lock: waiting"
  flock 9
fi

ARCHIVE=$OUT/$(file_name "$IMAGE")
PAUSE_ARCHIVE=$OUT/$(file_name "$PAUSE_IMAGE")
[ "$ARCHIVE" != "$PAUSE_ARCHIVE" ] || { echo "build.sh: the two images need different names" >&2; exit 2; }

# --- keys: computed from content alone (no mtimes), so a fresh clone of the same tree matches -----
BASE_KEY=$( { printf '%s\n' "base-v1" "$SUITE" minbase "$MIRROR" "$SECURITY_MIRROR"; printf '%s\n' "${BASE_PACKAGES[@]}" | LC_ALL=C sort; } | sha)
BASE_REF=localhost/hivekeeper-base:$SUITE-$BASE_KEY
# What COPY brings into the image: .dockerignore leaves out __pycache__ and *.egg-info.
tree_files() {
  local top=() f
  for f in Dockerfile .dockerignore pyproject.toml README.md LICENSE scripts/requirements.py services operator; do
    [ -e "$ROOT/$f" ] && top+=("$f")
  done
  (cd "$ROOT" && find "${top[@]}" \( -name __pycache__ -o -name '*.egg-info' \) -prune -o -type f -print0 | LC_ALL=C sort -z)
}
IMAGE_KEY=$( {
  printf '%s\n' "image-v$FORMAT" "$IMAGE" "$BASE_KEY" "$TORCH_INDEX_URL"
  cd "$ROOT" && tree_files | xargs -0 stat -c '%a %n' && tree_files | xargs -0 sha256sum
} | sha)
PAUSE_KEY=$( { printf '%s\n' "pause-v$FORMAT" "$PAUSE_IMAGE"; cat "$HERE/pause/go.mod" "$HERE/pause/main.go"; } | sha)

# A field of ARCHIVE.key (KEY, ID, REF), empty where the archive or its .key is missing.
archive_field() { if [ -s "$1" ] && [ -f "$1.key" ]; then sed -n "s/^$2=//p" "$1.key"; fi; }
key_of() { archive_field "$1" KEY; }
id_of() { archive_field "$1" ID; }
ref_of() { archive_field "$1" REF; }
need_image=1; need_pause=1
if [ $FORCE = 0 ] && [ "$(key_of "$ARCHIVE")" = "$IMAGE_KEY" ] && [ "$(ref_of "$ARCHIVE")" = "$IMAGE" ]; then need_image=0; fi
if [ $FORCE = 0 ] && [ "$(key_of "$PAUSE_ARCHIVE")" = "$PAUSE_KEY" ] && [ "$(ref_of "$PAUSE_ARCHIVE")" = "$PAUSE_IMAGE" ]; then need_pause=0; fi

# --- tools ---------------------------------------------------------------------------------------
GO=$(command -v go || true)
[ -n "$GO" ] || [ ! -x /usr/local/go/bin/go ] || GO=/usr/local/go/bin/go
ensure_tools() {
  if [ "$(id -u)" != 0 ]; then
    echo "build.sh: needs root (apt-get, mmdebstrap, buildah --isolation chroot)" >&2; exit 1
  fi
  local missing=()
  command -v buildah >/dev/null 2>&1 || missing+=(buildah)
  command -v mmdebstrap >/dev/null 2>&1 || missing+=(mmdebstrap)
  [ -n "$GO" ] || missing+=(golang-go)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt-get)"
    "$ROOT/scripts/apt-install.sh" "${missing[@]}"
    [ -n "$GO" ] || GO=$(command -v go)
  fi
}
if [ $need_image = 1 ] || [ $need_pause = 1 ]; then
  ensure_tools
fi

# --- buildah: storage under the cache, chroot isolation (no nested runtime), no registry --------
STORE=()
containers=()
TMP=$(mktemp -d "$CACHE/tmp.XXXXXX")
cleanup() {
  local c
  wait || true
  for c in "${containers[@]}"; do buildah "${STORE[@]}" rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
init_storage() {
  # The run root is state that must not outlive a boot (a tmpfs in a stock setup): start it afresh
  # after a reboot only (a fresh one costs the storage's feature probes, seconds after a big export).
  local boot_id
  boot_id=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown)
  if [ "$(cat "$CACHE/run/.boot-id" 2>/dev/null)" != "$boot_id" ]; then
    rm -rf "$CACHE/run"
    mkdir -p "$CACHE/run"
    echo "$boot_id" >"$CACHE/run/.boot-id"
  fi
  STORE=(--root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver overlay)
  if ! buildah "${STORE[@]}" images >/dev/null 2>"$TMP/overlay.err"; then
    log "overlay storage does not work here ($(tail -1 "$TMP/overlay.err")): using vfs (slower, bigger)"
    STORE=(--root "$CACHE/storage-vfs" --runroot "$CACHE/run" --storage-driver vfs)
    buildah "${STORE[@]}" images >/dev/null
  fi
  cat >"$CACHE/policy.json" <<'EOF'
{"default": [{"type": "insecureAcceptAnything"}]}
EOF
}
image_id() { buildah "${STORE[@]}" images --noheading --no-trunc --format '{{.ID}}' "$1" 2>/dev/null | head -1; }

# --- base: a Debian rootfs from mmdebstrap, imported as an image --------------------------------
build_base() {
  local rootfs=$CACHE/base/$BASE_KEY.tar t
  if [ -n "$(image_id "$BASE_REF")" ]; then
    log "base: reused image $BASE_REF"
    return
  fi
  mkdir -p "$CACHE/base"
  if [ -s "$rootfs" ]; then
    log "base: reused rootfs $rootfs"
  else
    log "base: mmdebstrap $SUITE minbase + ${BASE_PACKAGES[*]}"
    t=$EPOCHREALTIME
    mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${BASE_PACKAGES[*]}")" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --skip=output/dev \
      "$SUITE" "$TMP/rootfs.tar" \
      "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main" "deb $SECURITY_MIRROR $SUITE-security main"
    mv "$TMP/rootfs.tar" "$rootfs"
    log "base: rootfs $(du -h "$rootfs" | cut -f1) in $(since "$t")"
  fi
  t=$EPOCHREALTIME
  local c
  c=$(buildah "${STORE[@]}" from --signature-policy "$CACHE/policy.json" scratch)
  containers+=("$c")
  buildah "${STORE[@]}" add "$c" "$rootfs" / >/dev/null
  buildah "${STORE[@]}" config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd /bin/bash --label "dev.hivekeeper.base-key=$BASE_KEY" "$c"
  buildah "${STORE[@]}" commit --quiet --rm --signature-policy "$CACHE/policy.json" "$c" "$BASE_REF" >/dev/null
  containers=("${containers[@]/$c}")
  log "base: imported as $BASE_REF in $(since "$t")"
}

# Writes an image as a docker-archive (uncompressed layers; containerd 1.6's `ctr import` tags it
# with the name inside). Reuses the archive there if it holds the same image.
export_archive() { # ref archive key
  local ref=$1 archive=$2 key=$3 id t tmpdir=${HIVEKEEPER_EXPORT_TMPDIR:-/var/tmp} rm_pid=
  id=$(image_id "$ref")
  if [ -s "$archive" ] && [ "$(id_of "$archive")" = "$id" ] && [ "$(ref_of "$archive")" = "$ref" ]; then
    log "export: $archive already holds $ref ($id): reused"
  else
    t=$EPOCHREALTIME
    rm -f "$archive.key" "$TMP/out.tar"
    # Deleting a multi-GB file takes seconds (more with online discard): do it during the push.
    if [ -e "$archive" ]; then
      mv "$archive" "$TMP/old.tar"
      rm -f "$TMP/old.tar" &
      rm_pid=$!
    fi
    # buildah spools each layer to a temporary file before it writes it into the archive: in
    # memory (/dev/shm) when there is plenty, which saves one disk write of the whole image.
    if [ -z "${HIVEKEEPER_EXPORT_TMPDIR:-}" ] && [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ] \
        && [ "$(awk '/^MemAvailable:/ { print int($2 / 1048576) }' /proc/meminfo)" -ge 12 ] \
        && [ "$(df -k --output=avail /dev/shm | tail -1)" -ge $((8 * 1048576)) ]; then
      tmpdir=/dev/shm
    fi
    TMPDIR=$tmpdir buildah "${STORE[@]}" push --quiet --signature-policy "$CACHE/policy.json" \
      "$ref" "docker-archive:$TMP/out.tar:$ref" >/dev/null
    [ -z "$rm_pid" ] || wait "$rm_pid"
    mv "$TMP/out.tar" "$archive"
    log "export: $ref -> $archive ($(du -h "$archive" | cut -f1)) in $(since "$t") (spooled in $tmpdir)"
  fi
  printf 'KEY=%s\nID=%s\nREF=%s\n' "$key" "$id" "$ref" >"$archive.key"
}

build_image() {
  local t log_file
  build_base
  mkdir -p "$CACHE/logs"
  log_file=$CACHE/logs/build-$(date +%Y%m%d-%H%M%S).log
  find "$CACHE/logs" -name 'build-*.log' -mtime +7 -delete
  local mounts=()
  if compgen -G "$WHEELHOUSE/torch-*.whl" >/dev/null; then
    mounts+=(--volume "$WHEELHOUSE:/wheels:ro" --build-arg WHEELHOUSE=/wheels)
  else
    log "image: no wheelhouse in $WHEELHOUSE (scripts/install.sh fills it): pip downloads from the index"
  fi
  # Behind a TLS-intercepting proxy only the host's CA bundle is trusted: lend it to the build
  # (a mount over the image's own bundle, for the RUN steps only).
  if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    mounts+=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
  fi
  log "image: buildah bud $IMAGE (log: $log_file)"
  t=$EPOCHREALTIME
  local step_t=$t
  # Each line stamped with the seconds since the build began, for the per-step timings.
  buildah "${STORE[@]}" bud --layers --isolation chroot --network host --pull=never \
      --signature-policy "$CACHE/policy.json" --force-rm \
      --build-arg BASE_IMAGE="$BASE_REF" --build-arg TORCH_INDEX_URL="$TORCH_INDEX_URL" \
      "${mounts[@]}" -f "$ROOT/Dockerfile" -t "$IMAGE" "$ROOT" 2>&1 \
    | while IFS= read -r line; do
        printf '%7s %s\n' "$(secs "$step_t")" "$line"
      done >"$log_file" || { tail -40 "$log_file" >&2; log "image: build failed (log: $log_file)"; exit 1; }
  # Which steps came from the layer cache and which ran, with how long each took.
  awk '/ STEP [0-9]+\/[0-9]+: / { t0 = $1; step = $0; sub(/^ *[0-9.]+ /, "", step); next }
       / --> Using cache / { if (step ~ /: (RUN|COPY|ADD) /) printf "  reused          %s\n", substr(step, 1, 100); step = ""; next }
       / --> / && step != "" { if (step ~ /: (RUN|COPY|ADD) /) printf "  ran   %7.1f s  %s\n", $1 - t0, substr(step, 1, 100); step = "" }' \
    "$log_file" >&2 || true
  log "image: built $IMAGE in $(since "$t")"
  # Drop images nothing uses any more (an earlier build's last layers); the cached steps stay.
  buildah "${STORE[@]}" rmi --prune >/dev/null 2>&1 || true
}

build_pause() {
  local t c
  t=$EPOCHREALTIME
  mkdir -p "$TMP/pause"
  (cd "$HERE/pause" && CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS='' "$GO" build -trimpath -ldflags='-s -w' -o "$TMP/pause/pause" .)
  c=$(buildah "${STORE[@]}" from --signature-policy "$CACHE/policy.json" scratch)
  containers+=("$c")
  buildah "${STORE[@]}" copy "$c" "$TMP/pause/pause" /pause >/dev/null
  buildah "${STORE[@]}" config --entrypoint '["/pause"]' --cmd '' --user 65535:65535 "$c"
  buildah "${STORE[@]}" commit --quiet --rm --signature-policy "$CACHE/policy.json" "$c" "$PAUSE_IMAGE" >/dev/null
  containers=("${containers[@]/$c}")
  log "pause: built $PAUSE_IMAGE in $(since "$t")"
}

verify() {
  local c ref archive
  # The images are checked in buildah's storage; one that is no longer there comes from its archive.
  for ref in "$IMAGE" "$PAUSE_IMAGE"; do
    archive=$ARCHIVE; [ "$ref" = "$IMAGE" ] || archive=$PAUSE_ARCHIVE
    if [ -z "$(image_id "$ref")" ]; then
      buildah "${STORE[@]}" pull --quiet --signature-policy "$CACHE/policy.json" "docker-archive:$archive" >/dev/null
    fi
  done
  log "verify: $IMAGE"
  c=$(buildah "${STORE[@]}" from --pull=never --signature-policy "$CACHE/policy.json" "$IMAGE")
  containers+=("$c")
  local run=(buildah "${STORE[@]}" run --isolation chroot --network host "$c" --)
  "${run[@]}" id -u
  "${run[@]}" hivekeeper --version
  "${run[@]}" hivekeeper-operator --help >/dev/null
  "${run[@]}" python -c 'import os, torch, hivemind, hivekeeper, hivekeeper_operator
from hivemind.p2p.p2p_daemon import P2P
print("torch", torch.__version__, "hivemind", hivemind.__version__, "cuda built:", torch.version.cuda,
      "| matmul ok:", float(torch.ones(2, 2).matmul(torch.ones(2, 2)).sum()) == 8.0)'
  buildah "${STORE[@]}" rm "$c" >/dev/null
  containers=("${containers[@]/$c}")
  log "verify: $PAUSE_IMAGE"
  c=$(buildah "${STORE[@]}" from --pull=never --signature-policy "$CACHE/policy.json" "$PAUSE_IMAGE")
  containers+=("$c")
  buildah "${STORE[@]}" run --isolation chroot "$c" -- /pause --version
  buildah "${STORE[@]}" rm "$c" >/dev/null
  containers=("${containers[@]/$c}")
}

if [ $need_image = 1 ] || [ $need_pause = 1 ] || [ $VERIFY = 1 ]; then
  init_storage
fi
if [ $need_image = 1 ]; then
  build_image
  export_archive "$IMAGE" "$ARCHIVE" "$IMAGE_KEY"
else
  log "image: $ARCHIVE is up to date (key $IMAGE_KEY): reused, nothing built"
fi
if [ $need_pause = 1 ]; then
  build_pause
  export_archive "$PAUSE_IMAGE" "$PAUSE_ARCHIVE" "$PAUSE_KEY"
else
  log "pause: $PAUSE_ARCHIVE is up to date (key $PAUSE_KEY): reused, nothing built"
fi
[ $VERIFY = 0 ] || verify >&2

cat >"$OUT/images.env" <<EOF
IMAGE=$IMAGE
ARCHIVE=$ARCHIVE
IMAGE_ID=$(id_of "$ARCHIVE")
PAUSE_IMAGE=$PAUSE_IMAGE
PAUSE_ARCHIVE=$PAUSE_ARCHIVE
PAUSE_IMAGE_ID=$(id_of "$PAUSE_ARCHIVE")
EOF
log "done; wrote $OUT/images.env"
echo "IMAGE=$IMAGE ARCHIVE=$ARCHIVE"
echo "PAUSE_IMAGE=$PAUSE_IMAGE PAUSE_ARCHIVE=$PAUSE_ARCHIVE"
