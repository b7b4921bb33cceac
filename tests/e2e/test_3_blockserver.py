"""A BlockServer in pods: servers hold spans of a transformer's blocks, and the scripted client's
tokens through the chain of servers match decoding the same model locally."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from e2e.support import NAMESPACE, Cluster, applied, example, hivekeeper, logged_entry, node_ip, swarm_key, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "tiny-llama"
SELECTOR = f"hivekeeper.dev/swarm={NAME}"


def client_result(cluster: Cluster) -> dict[str, Any] | None:
    for pod in cluster.pods(f"{SELECTOR},hivekeeper.dev/component=block-client"):
        entry = logged_entry(cluster.logs(pod["metadata"]["name"]), "generated")
        if entry:
            return entry
    return None


def test_blockserver_client_decodes_as_the_local_model(cluster: Cluster, release: str):
    small = {"cpu": "250m", "memory": "1Gi"}  # sized to a 2-core node
    manifest = example("blockserver.yaml", {"spec": {"servers": {"replicas": 2, "resources": small},
                                                     "client": {"resources": small}}})
    with applied(cluster, manifest):
        # The client may be done before a reading of all six blocks reaches the status: either
        # shows the servers at work.
        status = wait_for(lambda: ((s := cluster.status("blockserver", NAME)).get("servedBlocks") == "6/6"
                                   or s.get("phase") == "Succeeded") and s, 420, "every block served, or the run done",
                          interval=2)
        assert status["phase"] in ("Running", "Succeeded"), status
        columns = cluster.kubectl("get", "blockserver", NAME, "-n", NAMESPACE).stdout
        assert re.search(r"\s\d/6\s", columns), columns  # BLOCKS: held by an online server / all
        result = wait_for(lambda: client_result(cluster), 420, "the client's generated tokens", interval=3)
        assert result["metrics"]["matchesLocal"] is True, result
        assert len(result["tokens"]) == manifest["spec"]["client"]["newTokens"]
        # Its chain of servers covers the six blocks, span after span.
        spans = sorted(tuple(map(int, hop.split("@")[0].split(":"))) for hop in result["chain"])
        assert spans[0][0] == 0 and spans[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans


def test_a_lab_contributes_the_server_that_completes_the_chain(cluster: Cluster, release: str, tmp_path: Path):
    """Lab A's BlockServer has one server holding 3 of the 6 blocks; lab B joins from a namespace
    of its own (through A's NodePorts, as from another cluster) with one server. The client's
    chain needs B's server for the rest, and its tokens equal local decoding."""
    tiny = {"cpu": "100m", "memory": "1Gi"}  # both labs' pods on a 2-core node
    host = node_ip(cluster)
    manifest = example("blockserver-volunteers.yaml", {"metadata": {"name": NAME}, "spec": {
        "servers": {"replicas": 1, "spanLength": 3, "resources": tiny}, "client": {"resources": tiny},
        "volunteers": {"serviceType": "NodePort", "publicHost": host,
                       "labs": [{"name": "lab-b", "maxPeers": 2, "roles": ["backbone", "server"]}]}}})
    gateway = f"{host}:{manifest['spec']['volunteers']['gatewayPort']}"
    lab_namespace = "hivekeeper-e2e-lab-b"
    with applied(cluster, manifest):
        wait_for(lambda: cluster.kubectl("get", "secret", f"{NAME}-swarm-auth", "-n", NAMESPACE,
                                         check=False).returncode == 0, 120, "the swarm's key")
        invite = hivekeeper("invite", "--key-file", str(swarm_key(cluster, NAME, tmp_path)), "--identity", "lab-b")
        assert invite.returncode == 0, invite.stderr
        cluster.kubectl("create", "namespace", lab_namespace, check=False)
        try:
            cluster.kubectl("create", "secret", "generic", "lab-a-invite", "-n", lab_namespace,
                            f"--from-literal=invite={invite.stdout.strip()}")
            cluster.apply({"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "BlockServer",
                           "metadata": {"name": "tiny-llama-part"},
                           "spec": {"join": {"gateway": gateway, "inviteSecret": "lab-a-invite"},
                                    "servers": {"replicas": 1, "resources": tiny}}}, namespace=lab_namespace)
            try:
                result = wait_for(lambda: client_result(cluster), 600, "the client's tokens through both labs",
                                  interval=3)
            except AssertionError:
                print(cluster.describe_failure(lab_namespace))
                raise
            assert result["metrics"]["matchesLocal"] is True, result
            spans = sorted(tuple(map(int, hop.split("@")[0].split(":"))) for hop in result["chain"])
            assert spans[0][0] == 0 and spans[-1][1] == 6 and len({hop.split("@")[1] for hop in result["chain"]}) == 2, \
                spans  # lab A's one server holds 3 blocks: the chain crosses into lab B's
            joined = next(c for c in cluster.status("blockserver", "tiny-llama-part", lab_namespace)["conditions"]
                          if c["type"] == "Joined")
            assert joined["status"] == "True", joined
        finally:
            cluster.kubectl("delete", "namespace", lab_namespace, "--wait=true", timeout=300, check=False)
