"""A Swarm with a door for volunteers, in pods (issue 18 on a real cluster): the operator's
token service serves TLS with a certificate made from the swarm's key, the peers get their
tokens with the invites the operator minted (each naming that key's fingerprint), and train
with every RPC admitted by token: the monitor downloads the trainers' state and evaluates it
only if the trainers admit it. From outside the cluster, an invite minted from the swarm's key
Secret gets a volunteer its token through the NodePort (`hivekeeper join --dry-run`)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from e2e.support import REPO, Cluster, applied, example, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "open"
SMALL = {"cpu": "250m", "memory": "1Gi"}  # sized to a 2-core node


def node_ip(cluster: Cluster) -> str:
    node = cluster.get("nodes", namespace=None)["items"][0]
    return next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")


def manifest(host: str) -> dict[str, Any]:
    """The example, on NodePorts of the one node, its peers' CPU requests cut to fit 2 cores."""
    return example("swarm-digits-volunteers.yaml", {"metadata": {"name": NAME}, "spec": {
        "trainers": {"replicas": 2, "resources": SMALL},
        "auxiliary": {"replicas": 0},
        "balancer": {"enabled": False},
        "monitor": {"evalEverySteps": 2},
        "stopping": {"targetSteps": 400, "targetMetric": None},
        "volunteers": {"serviceType": "NodePort", "publicHost": host},
    }})


def swarm_key(cluster: Cluster, directory: Path) -> Path:
    """The swarm's signing key, as an admin reads it from its Secret (README: Join as a volunteer)."""
    pem = base64.b64decode(cluster.get("secret", f"{NAME}-swarm-auth")["data"]["swarm-auth.pem"])
    path = directory / "swarm-auth.pem"
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


def hivekeeper(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hivekeeper", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_open_swarm_trains_with_every_rpc_admitted(cluster: Cluster, release: str, tmp_path: Path):
    host = node_ip(cluster)
    with applied(cluster, manifest(host)):
        def status() -> dict[str, Any]:
            return cluster.status("swarm", NAME)

        # the monitor's evaluation needs the trainers' state: a download they serve only to admitted peers
        evaluated = wait_for(lambda: (s := status()).get("evalMetrics", {}).get("accuracy") is not None and s, 600,
                             "an evaluation of the trainers' state")
        assert evaluated["globalStep"] >= 1, evaluated

        auth_pod = cluster.pods(f"hivekeeper.dev/swarm={NAME},hivekeeper.dev/component=auth")[0]["metadata"]["name"]
        log = cluster.logs(auth_pod)
        issued = [json.loads(line) for line in log.splitlines() if '"token issued"' in line]
        assert len(issued) >= 4, log[-3000:]  # backbone, relay, trainers, monitor: each over TLS

        invite = hivekeeper("invite", "--key-file", str(swarm_key(cluster, tmp_path)), "--identity", "alice")
        assert invite.returncode == 0, invite.stderr
        gateway = f"{host}:{manifest(host)['spec']['volunteers']['gatewayPort']}"
        joined = hivekeeper("join", gateway, "--token", invite.stdout.strip(), "--dry-run",
                            "--run-dir", str(tmp_path / "alice"), "--host", "0.0.0.0")
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "would join as a trainer" in joined.stderr, joined.stderr[-3000:]
        record = json.loads((tmp_path / "alice" / "join.json").read_text())
        assert record.get("state") == "dry-run", record
