"""A Swarm in pods on the real cluster against `hivekeeper up` of the same manifest on the same
machine (the anchor): the collaboration's median samples/s while it trains, global steps, wall
time from apply to the end of the run, and the final held-out accuracy.

Needs the cluster up (`scripts/cluster.sh up`); installs the chart as the real-cluster tier does.
The manifest is that tier's: examples/swarm-digits.yaml with its CPU requests cut to fit a 2-core
node, no balancer, learning rate 0.002.

    .venv/bin/python bench/bench_cluster_swarm.py [--skip-local]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).parent))

from bench_results import write_results  # noqa: E402
from e2e.support import ENV, NAMESPACE, Cluster, install_release  # noqa: E402
from e2e.test_2_swarm import swarm_manifest  # noqa: E402

NAME = "bench-digits"


def in_cluster(cluster: Cluster, manifest: dict) -> dict:
    manifest = {**manifest, "metadata": {"name": NAME}}
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    began = time.monotonic()
    cluster.apply(manifest)
    rates: list[float] = []
    status: dict = {}
    try:
        while time.monotonic() - began < 1200:
            status = cluster.status("swarm", NAME)
            if status.get("phase") == "Running" and status.get("samplesPerSecond"):
                rates.append(float(status["samplesPerSecond"]))
            if status.get("phase") in ("Succeeded", "Failed"):
                break
            time.sleep(2)
    finally:
        cluster.kubectl("delete", "swarm", NAME, "-n", NAMESPACE, "--wait=true", check=False, timeout=300)
    return {"phase": status.get("phase"), "wallSeconds": round(time.monotonic() - began, 1),
            "globalStep": status.get("globalStep"), "accuracy": (status.get("evalMetrics") or {}).get("accuracy"),
            "samplesPerSecond": round(statistics.median(rates), 1) if rates else None}


def locally(manifest: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "swarm.yaml"
        path.write_text(yaml.safe_dump({**manifest, "metadata": {"name": NAME}}))
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "hivekeeper", "up", str(path), "--run-dir", f"{tmp}/run", "--json"],
                       check=True, timeout=1200, stdout=subprocess.DEVNULL)
        summary = json.loads((Path(tmp) / "run" / "summary.json").read_text())
    return {"phase": "Succeeded", "wallSeconds": round(time.monotonic() - began, 1),
            "globalStep": summary.get("globalStep"), "accuracy": (summary.get("metrics") or {}).get("accuracy"),
            "samplesPerSecond": summary.get("samplesPerSecond")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-local", action="store_true")
    args = parser.parse_args()
    if not (ENV.get("KUBECONFIG") and ENV.get("HIVEKEEPER_E2E_IMAGE")):
        print("no cluster: scripts/cluster.sh up first", file=sys.stderr)
        return 2
    manifest = swarm_manifest()
    cluster = Cluster(ENV)
    install_release(cluster)
    rows = {"pods (Kubernetes v1.34.4)": in_cluster(cluster, manifest)}
    if not args.skip_local:
        rows["hivekeeper up (anchor)"] = locally(manifest)
    print(f"{'where':28} {'samples/s':>10} {'steps':>6} {'accuracy':>9} {'wall s':>8}")
    for where, row in rows.items():
        print(f"{where:28} {row['samplesPerSecond'] or 0:>10.1f} {row['globalStep'] or 0:>6} "
              f"{row['accuracy'] or 0:>9.3f} {row['wallSeconds']:>8.1f}")
    write_results("cluster_swarm", "hivekeeper up of the same manifest on the same machine", rows=rows,
                  manifest=manifest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
