"""A BlockServer in pods: servers hold spans of a transformer's blocks, and the scripted client's
tokens through the chain of servers match decoding the same model locally."""

from __future__ import annotations

import re
from typing import Any

import pytest

from e2e.support import NAMESPACE, Cluster, applied, example, logged_entry, wait_for

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
