"""An ExpertPool in pods: expert servers announce their experts in the DHT, a trainer's DMoE layer
trains through them to the manifest's target. Then lab B pools its cluster: its expert server,
in its own cluster across the WAN, holds experts the host's servers leave free, and the host's
trainer finds them by beam search and trains through them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e.support import NAMESPACE, Cluster, applied, example, joining, lab_joined, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "digits-moe"
BACKBONE_PORT, SERVER_PORT = 31700, 31710  # each lab's, on its own node


def test_expertpool_trains_to_its_target(cluster: Cluster, release: str):
    manifest = example("expertpool.yaml", {"spec": {
        "servers": {"resources": {"cpu": "250m", "memory": "1Gi"}},
        "trainers": {"resources": {"cpu": "250m", "memory": "1Gi"}},
        "stopping": {"targetMetric": {"name": "accuracy", "value": 0.9}},
    }})
    with applied(cluster, manifest):
        # All 16 experts alive in a live reading (or the run already done: the status keeps its last).
        status = wait_for(lambda: ((s := cluster.status("expertpool", NAME)).get("expertsAlive") == 16
                                   or s.get("phase") == "Succeeded") and s, 420, "all 16 experts alive", interval=2)
        assert status["phase"] in ("Running", "Succeeded"), status
        status = wait_for(lambda: (s := cluster.status("expertpool", NAME)).get("phase") == "Succeeded" and s,
                          600, "the ExpertPool to reach its target", interval=3)
        assert status["evalMetrics"]["accuracy"] >= 0.9, status


def forward_batches(cluster: Cluster, pod: str) -> float:
    """The batches of forward requests the experts of an expert server's pod ran (its metrics,
    read through the API server's proxy to the pod)."""
    metrics = cluster.kubectl("get", "--raw", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}:9300/proxy/metrics").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("hivekeeper_expert_forward_batches{"))


def exposed(host: str, **servers: Any) -> dict[str, Any]:
    """The backbone and the expert servers on node ports at the lab's public address `host`."""
    return {"backbone": {"network": {"expose": "NodePort", "port": BACKBONE_PORT, "publicHost": host}},
            "servers": {**servers, "network": {"expose": "NodePort", "port": SERVER_PORT, "publicHost": host}}}


def test_a_lab_serves_experts_to_the_hosts_trainer(cluster: Cluster, release: str, lab_b: Cluster, tmp_path: Path):
    """Lab A's two servers hold 8 of the 16 experts; lab B's one server, joined from its own
    cluster, holds 4 more: the host's trainer counts them alive and trains on through them, and
    lab B's server serves its requests. Lab B's pool deleted, the host's trainer trains on."""
    tiny = {"cpu": "100m", "memory": "1Gi"}  # pods sized to a 2-core node
    host = cluster.public_ip
    manifest = example("expertpool-volunteers.yaml", {"metadata": {"name": NAME}, "spec": {
        **exposed(host, resources=tiny), "trainers": {"resources": tiny},
        "stopping": {"targetMetric": None, "targetSteps": 100_000},  # deleted when the test is done
        "volunteers": {"serviceType": "NodePort", "publicHost": host,
                       "labs": [{"name": "lab-b", "maxPeers": 2, "roles": ["backbone", "server"]}]}}})
    gateway = f"{host}:{manifest['spec']['volunteers']['gatewayPort']}"
    with applied(cluster, manifest):
        status = wait_for(lambda: (s := cluster.status("expertpool", NAME)).get("expertsAlive") == 8
                          and s.get("step") and s, 420, "the host's trainer on its own 8 experts", interval=2)
        part = joining("ExpertPool", "digits-moe-part", gateway,
                       # its servers only: a joining pool runs trainers only if it asks (lab B's
                       # roles above have none)
                       **exposed(lab_b.public_ip, replicas=1, resources=tiny))
        with lab_joined(cluster, NAME, lab_b, "lab-b", part, tmp_path):
            try:
                wait_for(lambda: cluster.status("expertpool", NAME).get("expertsAlive") == 12, 420,
                         "the host's trainer to count lab B's 4 experts alive", interval=2)
                step = cluster.status("expertpool", NAME)["step"]
                wait_for(lambda: forward_batches(lab_b, "digits-moe-part-expert-server-0") >= 10, 300,
                         "lab B's experts to run 10 batches of the host's trainer's requests", interval=2)
                wait_for(lambda: cluster.status("expertpool", NAME).get("step", 0) >= step + 10, 120,
                         "the host's trainer to step on", interval=2)
            except AssertionError:
                print(cluster.describe_failure(components=["expert-trainer"]))
                print(lab_b.describe_failure(components=["expert-server"]))
                raise
            joined = next(c for c in lab_b.status("expertpool", "digits-moe-part")["conditions"]
                          if c["type"] == "Joined")
            assert joined["status"] == "True", joined
            assert not lab_b.pods("hivekeeper.dev/swarm=digits-moe-part,hivekeeper.dev/component=expert-trainer")
        # lab B leaves mid-run (its pool deleted, its pods gone): the host's trainer steps on
        wait_for(lambda: not lab_b.pods("hivekeeper.dev/swarm=digits-moe-part"), 180, "lab B's pods to go")
        step = cluster.status("expertpool", NAME)["step"]
        wait_for(lambda: cluster.status("expertpool", NAME).get("step", 0) >= step + 10, 120,
                 "the host's trainer to step on with lab B gone", interval=2)
    assert status["phase"] == "Running", status
