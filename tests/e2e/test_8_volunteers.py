"""A Swarm with a door for volunteers, and a second lab pooling its cluster into it (issues 18
and 29 on real clusters). The operator's token service serves TLS with a certificate made from
the swarm's key, the peers get their tokens with the invites the operator minted (each naming
that key's fingerprint), and train with every RPC admitted by token: the monitor downloads the
trainers' state and evaluates it only if the trainers admit it. From outside the cluster, an
invite minted from the swarm's key Secret gets a volunteer its token through the NodePort
(`hivekeeper join --dry-run`).

Then lab B joins from its own cluster with its own resource (spec.join), across the WAN between
the labs: each lab's backbone and trainers announce their node's public address at node ports,
as labs that pool clusters expose them. A manifest that sets a host-owned field is refused at
apply; the joining Swarm's trainer trains in the host's swarm (the host's status counts the lab's
peers and samples) and its status shows the swarm's figures and Joined; both labs train on with
lab A's backbone pod deleted; a partition between the labs shows in lab B's Joined while its pods
run on, and both labs train on once it heals; lab A revoking lab B, then an invite of another
swarm, stop the lab's peers with the reason in Joined, the host unharmed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.support import (INVITE_SECRET, NAMESPACE, Cluster, applied, example, hivekeeper, joining, lab_joined,
                          partitioned, restarts, swarm_key, wait_for)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "open"
SMALL = {"cpu": "250m", "memory": "1Gi"}  # sized to a 2-core node
TINY = {"cpu": "100m", "memory": "1Gi"}  # the host's trainers and the lab's beside them
LAB = "lab-b"
BACKBONE_PORT, TRAINER_PORT = 31500, 31510  # each lab's, on its own node: trainer i at TRAINER_PORT + i


def exposed(host: str) -> dict[str, Any]:
    """The backbone's and the trainers' `network`: node ports at the lab's public address."""
    return {"backbone": {"network": {"expose": "NodePort", "port": BACKBONE_PORT, "publicHost": host}},
            "trainers": {"network": {"expose": "NodePort", "port": TRAINER_PORT, "publicHost": host}}}


def manifest(host: str) -> dict[str, Any]:
    """The example, on NodePorts of lab A's node at its public address, its peers' CPU requests cut
    to fit 2 cores."""
    return example("swarm-digits-volunteers.yaml", {"metadata": {"name": NAME}, "spec": {
        **exposed(host),
        "trainers": {"replicas": 2, "resources": TINY, **exposed(host)["trainers"]},
        "auxiliary": {"replicas": 0},
        "balancer": {"enabled": False},
        "monitor": {"evalEverySteps": 2},
        "stopping": {"targetSteps": 100_000, "targetMetric": None},  # deleted when the test is done
        "volunteers": {"serviceType": "NodePort", "publicHost": host,
                       "labs": [{"name": LAB, "maxPeers": 4, "roles": ["backbone", "trainer"]}]},
    }})


def lab_part(gateway: str, host: str, **spec: Any) -> dict[str, Any]:
    """Lab B's Swarm: its part only, exposed at its own public address `host`; the rest from the
    host lab."""
    ports = exposed(host)
    return joining("Swarm", "digits-part", gateway, **{
        **ports, "trainers": {"replicas": 1, "resources": TINY, **ports["trainers"]}, **spec})


def test_open_swarm_trains_with_every_rpc_admitted(cluster: Cluster, release: str, lab_b: Cluster, tmp_path: Path):
    host = cluster.public_ip
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

        invite = hivekeeper("invite", "--key-file", str(swarm_key(cluster, NAME, tmp_path)), "--identity", "alice")
        assert invite.returncode == 0, invite.stderr
        gateway = f"{host}:{manifest(host)['spec']['volunteers']['gatewayPort']}"
        joined = hivekeeper("join", gateway, "--token", invite.stdout.strip(), "--dry-run",
                            "--run-dir", str(tmp_path / "alice"), "--host", "0.0.0.0")
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "would join as a trainer" in joined.stderr, joined.stderr[-3000:]
        record = json.loads((tmp_path / "alice" / "join.json").read_text())
        assert record.get("state") == "dry-run", record

        lab_b_joins(cluster, lab_b, gateway, tmp_path)


def lab_b_joins(cluster: Cluster, lab_b: Cluster, gateway: str, tmp_path: Path) -> None:
    refused = lab_b.apply(lab_part(gateway, lab_b.public_ip, averaging={"mode": "diloco"}), check=False)
    assert refused.returncode != 0 and "spec.averaging: Invalid value" in refused.stderr \
        and "a joining Swarm takes this from the host (spec.join); remove it" in refused.stderr, refused.stderr
    with lab_joined(cluster, NAME, lab_b, LAB, lab_part(gateway, lab_b.public_ip), tmp_path):
        def part() -> dict[str, Any]:
            return lab_b.status("swarm", "digits-part")

        def joined(status: dict[str, Any]) -> dict[str, Any]:
            return next((c for c in status.get("conditions") or [] if c["type"] == "Joined"), {})

        def lab_in_host() -> dict[str, Any] | None:
            labs = {lab["name"]: lab for lab in cluster.status("swarm", NAME).get("labs") or []}
            return labs[LAB] if LAB in labs and labs[LAB]["samples"] > 0 else None

        try:
            lab = wait_for(lab_in_host, 420, "the host's status to count lab B's trainer and its samples")
            assert lab["peers"] >= 2, lab  # its backbone and its trainer
            # the status catches up with its pods and its backbone's reading at a reconcile
            status = wait_for(lambda: (s := part()).get("globalStep") and s["trainers"]["ready"] == 1
                              and s.get("peersAlive", {}).get("trainer", 0) >= 3 and s, 120,
                              "lab B's status: the global step, its trainer ready, every trainer alive")
            assert joined(status).get("status") == "True", status

            # Lab A's backbone goes down: the DHT lives on in lab B's backbone and every other
            # peer, and both labs train on (the operator starts lab A's backbone again).
            step_a, step_b = cluster.status("swarm", NAME)["globalStep"], status["globalStep"]
            cluster.kubectl("delete", "pod", "-n", NAMESPACE, "--wait=false", "-l",
                            f"hivekeeper.dev/swarm={NAME},hivekeeper.dev/component=backbone")
            wait_for(lambda: cluster.status("swarm", NAME).get("globalStep", 0) >= step_a + 3
                     and part().get("globalStep", 0) >= step_b + 3, 240,
                     "both labs' statuses to count 3 more steps with lab A's backbone deleted")

            # A partition between the labs: lab B's condition says so at its next probe and its
            # pods run on, none restarted; healed, lab B is Joined again and both labs train on.
            selector = "hivekeeper.dev/swarm=digits-part"
            restarted = restarts(lab_b, selector)
            with partitioned():
                wait_for(lambda: joined(part()).get("reason") == "GatewayUnreachable", 180,
                         "Joined: GatewayUnreachable across the partition")
                assert lab_b.pods(selector), "a partition stopped lab B's pods"
            wait_for(lambda: joined(part()).get("status") == "True", 120, "Joined again once the partition heals")
            step_a, step_b = cluster.status("swarm", NAME)["globalStep"], part()["globalStep"]
            wait_for(lambda: cluster.status("swarm", NAME).get("globalStep", 0) >= step_a + 3
                     and part().get("globalStep", 0) >= step_b + 3, 240,
                     "both labs' statuses to count 3 more steps after the partition")
            assert restarts(lab_b, selector) == restarted, "lab B's pods restarted across the partition"
        except AssertionError:
            print(lab_b.describe_failure())
            raise

        # Lab A revokes lab B: B's operator finds it refused at its next probe and stops B's peers.
        cluster.kubectl("patch", "swarm", NAME, "-n", NAMESPACE, "--type", "merge", "-p",
                        json.dumps({"spec": {"volunteers": {"labs": []}}}))
        revoked = wait_for(lambda: joined(s := part()).get("reason") == "InviteRefused" and s, 240,
                           "Joined: InviteRefused once lab A removed lab B")
        assert "allowlist" in joined(revoked)["message"] and revoked["phase"] == "Pending", revoked
        wait_for(lambda: not lab_b.pods("hivekeeper.dev/swarm=digits-part"), 180, "lab B's pods to stop")

        # Another swarm's invite: the host's gateway does not hold the key it names.
        from hivemind.utils.crypto import RSAPrivateKey

        from hivekeeper.auth.tokens import mint_invite

        other = mint_invite(RSAPrivateKey(), LAB, time.time() + 3600)
        lab_b.kubectl("delete", "secret", INVITE_SECRET, "-n", NAMESPACE)
        lab_b.kubectl("create", "secret", "generic", INVITE_SECRET, "-n", NAMESPACE, f"--from-literal=invite={other}")
        stopped = wait_for(lambda: joined(s := part()).get("reason") == "GatewayKeyMismatch" and s, 120,
                           "Joined: GatewayKeyMismatch")
        assert stopped["phase"] == "Pending" and not lab_b.pods("hivekeeper.dev/swarm=digits-part")
        events = lab_b.kubectl("get", "events", "-n", NAMESPACE, "-o", "json").stdout
        assert "InviteRefused" in events and "GatewayKeyMismatch" in events
        step = cluster.status("swarm", NAME).get("globalStep", 0)
        wait_for(lambda: cluster.status("swarm", NAME).get("globalStep", 0) > step, 120, "the host to train on")

