"""A BlockServer in pods: servers hold spans of a transformer's blocks, and the scripted client's
tokens through the chain of servers match decoding the same model locally."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from e2e.support import NAMESPACE, Cluster, applied, example, joining, lab_joined, logged_entry, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "tiny-llama"
SELECTOR = f"hivekeeper.dev/swarm={NAME}"
BACKBONE_PORT, SERVER_PORT = 31600, 31610  # each lab's, on its own node


def exposed(host: str, **servers: Any) -> dict[str, Any]:
    """The backbone and the servers on node ports at the lab's public address `host`."""
    return {"backbone": {"network": {"expose": "NodePort", "port": BACKBONE_PORT, "publicHost": host}},
            "servers": {**servers, "network": {"expose": "NodePort", "port": SERVER_PORT, "publicHost": host}}}


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


def test_a_lab_contributes_the_server_that_completes_the_chain(cluster: Cluster, release: str, lab_b: Cluster,
                                                               tmp_path: Path):
    """Lab A's BlockServer has one server holding 3 of the 6 blocks; lab B joins from its own
    cluster, across the WAN, with one server. The client's chain needs B's server for the rest,
    and its tokens equal local decoding."""
    tiny = {"cpu": "100m", "memory": "1Gi"}  # pods sized to a 2-core node
    host = cluster.public_ip
    manifest = example("blockserver-volunteers.yaml", {"metadata": {"name": NAME}, "spec": {
        **exposed(host, replicas=1, spanLength=3, resources=tiny), "client": {"resources": tiny},
        "volunteers": {"serviceType": "NodePort", "publicHost": host,
                       "labs": [{"name": "lab-b", "maxPeers": 2, "roles": ["backbone", "server"]}]}}})
    gateway = f"{host}:{manifest['spec']['volunteers']['gatewayPort']}"
    with applied(cluster, manifest):
        wait_for(lambda: cluster.kubectl("get", "secret", f"{NAME}-swarm-auth", "-n", NAMESPACE,
                                         check=False).returncode == 0, 120, "the swarm's key")
        part = joining("BlockServer", "tiny-llama-part", gateway,
                       **exposed(lab_b.public_ip, replicas=1, resources=tiny))
        with lab_joined(cluster, NAME, lab_b, "lab-b", part, tmp_path):
            try:
                result = wait_for(lambda: client_result(cluster), 600, "the client's tokens through both labs",
                                  interval=3)
            except AssertionError:
                print(cluster.describe_failure(components=["block-client"]))
                print(lab_b.describe_failure(components=["block-server"]))
                raise
            assert result["metrics"]["matchesLocal"] is True, result
            spans = sorted(tuple(map(int, hop.split("@")[0].split(":"))) for hop in result["chain"])
            assert spans[0][0] == 0 and spans[-1][1] == 6 and len({hop.split("@")[1] for hop in result["chain"]}) == 2, \
                spans  # lab A's one server holds 3 blocks: the chain crosses into lab B's
            joined = next(c for c in lab_b.status("blockserver", "tiny-llama-part")["conditions"]
                          if c["type"] == "Joined")
            assert joined["status"] == "True", joined
