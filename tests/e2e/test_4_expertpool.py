"""An ExpertPool in pods: expert servers announce their experts in the DHT, a trainer's DMoE layer
trains through them to the manifest's target."""

from __future__ import annotations

import pytest

from e2e.support import Cluster, applied, example, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "digits-moe"


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
