"""The operator's two replicas on the real cluster: one holds the leader Lease and reconciles,
the other stands by. The leader's pod force-deleted, or its process killed outright, the other
takes the Lease (the takeover times are printed and kept in .cluster/e2e-ha.json), reconciles
what is applied next and makes nothing twice. Children are server-side applied: a hand edit of
a field the operator sets is set back within a resync, an untouched child is not written again,
and `kubectl describe` lists the operator's Events."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.support import (NAMESPACE, OPERATOR_NAMESPACE, RELEASE, REPO, Cluster, applied, example, lease_holder,
                         operator_pods, pod_ready, wait_for)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NAME = "ha-probe"
CHILD_KINDS = "statefulsets,jobs,services,configmaps,secrets,poddisruptionbudgets"
SMALL = {"cpu": "250m", "memory": "1Gi"}  # sized to a 2-core node
FIGURES: dict[str, Any] = {}


def probe(name: str = NAME) -> dict[str, Any]:
    """A Swarm with a backbone and a monitor, no trainers yet (CPU for the later checks)."""
    return example("swarm-digits.yaml", {"metadata": {"name": name}, "spec": {
        "trainers": {"replicas": 0, "resources": SMALL}, "auxiliary": {"replicas": 0},
        "balancer": {"enabled": False}}})


def children(cluster: Cluster, name: str = NAME) -> list[tuple[str, str, str]]:
    items = cluster.get(CHILD_KINDS, selector=f"hivekeeper.dev/swarm={name}")["items"]
    return sorted((i["kind"], i["metadata"]["name"], i["metadata"]["uid"]) for i in items)


def reconciled(cluster: Cluster, name: str) -> dict[str, Any]:
    return wait_for(lambda: (s := cluster.status("swarm", name)).get("observedGeneration") == 1 and s, 120,
                    f"the operator to reconcile {name}")


def leader_of(identity: str | None) -> str:
    return (identity or "").rpartition("_")[0]


def two_replicas_one_leading(cluster: Cluster) -> tuple[str, dict[str, Any]]:
    """(the Lease's holder, its pod) once both replicas are ready and one of them leads."""
    def settled() -> tuple[str, dict[str, Any]] | None:
        pods = operator_pods(cluster)
        holder = lease_holder(cluster)
        leader = next((p for p in pods if p["metadata"]["name"] == leader_of(holder)), None)
        return (holder, leader) if len(pods) == 2 and all(pod_ready(p) for p in pods) and leader else None

    return wait_for(settled, 240, "two ready operator replicas, one holding the Lease")


def takeover(cluster: Cluster, previous: str, began: float) -> tuple[str, float]:
    """The next holder of the Lease and the seconds from `began` until it held it."""
    def taken() -> str | None:
        holder = lease_holder(cluster)
        return holder if holder and holder != previous else None

    holder = wait_for(taken, 120, "another replica to take the Lease", interval=0.2)
    return holder, time.monotonic() - began


def operator_processes(pod_uid: str) -> list[int]:
    """The operator's processes in a pod, as this host sees them (scripts/cluster.sh runs the node
    here, with the cgroupfs driver: .../kubepods/<qos>/pod<UID>/<container>)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroup, cmdline = (entry / "cgroup").read_text(), (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"pod{pod_uid}" in cgroup or f"pod{pod_uid.replace('-', '_')}" in cgroup) and b"hivekeeper-operator" in cmdline:
            found.append(int(entry.name))
    return found


def save_figures() -> None:
    out = REPO / ".cluster" / "e2e-ha.json"
    if out.parent.exists():
        out.write_text(json.dumps(FIGURES, indent=2))
    print("operator HA figures:", json.dumps(FIGURES))


def test_two_replicas_one_leads_the_other_stands_by(cluster: Cluster, release: str):
    holder, leader = two_replicas_one_leading(cluster)
    standby = next(p for p in operator_pods(cluster) if p["metadata"]["name"] != leader["metadata"]["name"])
    assert "standing by" in cluster.logs(standby["metadata"]["name"], OPERATOR_NAMESPACE)
    assert '"msg": "leading"' in cluster.logs(leader["metadata"]["name"], OPERATOR_NAMESPACE)
    budget = cluster.get("poddisruptionbudget", RELEASE, OPERATOR_NAMESPACE)
    assert budget["spec"]["maxUnavailable"] == 1


def test_the_leader_force_deleted_the_other_takes_over_and_nothing_is_made_twice(cluster: Cluster, release: str):
    with applied(cluster, probe()):
        reconciled(cluster, NAME)
        before = children(cluster)
        holder, leader = two_replicas_one_leading(cluster)
        began = time.monotonic()
        cluster.kubectl("delete", "pod", leader["metadata"]["name"], "-n", OPERATOR_NAMESPACE, "--grace-period=0",
                        "--force")
        holder, seconds = takeover(cluster, holder, began)
        FIGURES["forceDeleteTakeoverSeconds"] = round(seconds, 1)
        save_figures()
        new_leader = leader_of(holder)
        assert new_leader != leader["metadata"]["name"] and new_leader in {
            p["metadata"]["name"] for p in operator_pods(cluster)}

        # The new leader reconciles what is applied now, and left the probe's children as they were.
        with applied(cluster, probe("ha-late")):
            reconciled(cluster, "ha-late")
        assert children(cluster) == before
        degraded = next(c for c in cluster.status("swarm", NAME)["conditions"] if c["type"] == "Degraded")
        assert degraded["reason"] != "NameConflict", degraded
        log = cluster.logs(new_leader, OPERATOR_NAMESPACE)
        assert "reconcile failed" not in log and "NameConflict" not in log, log[-2000:]


def test_the_leader_killed_its_lease_expires_and_the_other_takes_over(cluster: Cluster, release: str):
    """SIGKILL: nothing released the Lease; the standby takes it once it saw it unrenewed for the
    Lease's 15 s (plus up to a retry period)."""
    holder, leader = two_replicas_one_leading(cluster)
    processes = operator_processes(leader["metadata"]["uid"])
    if not processes:
        pytest.skip("the operator's process is not on this host (a cluster scripts/cluster.sh did not start)")
    with applied(cluster, probe()):
        reconciled(cluster, NAME)
        before = children(cluster)
        began = time.monotonic()
        for pid in processes:
            os.kill(pid, signal.SIGKILL)
        holder, seconds = takeover(cluster, holder, began)
        FIGURES["killTakeoverSeconds"] = round(seconds, 1)
        save_figures()
        # Safety, not speed: the Lease was renewed at most a retry period (2 s) before the kill.
        assert seconds >= 13, "a replica took the Lease before it expired"
        with applied(cluster, probe("ha-late")):
            reconciled(cluster, "ha-late")
        assert children(cluster) == before


def test_a_hand_edit_of_a_child_is_set_back_within_a_resync_and_describe_lists_events(cluster: Cluster, release: str):
    """The chart's resyncSeconds is 5 here. Server-side apply takes back what the operator
    set: the backbone's replicas (`kubectl scale statefulset`), a Service port's target, a label;
    a label of one's own stays; a child nobody edited keeps its resourceVersion."""
    with applied(cluster, probe()):
        reconciled(cluster, NAME)
        untouched = {kind: cluster.get(kind, name)["metadata"]["resourceVersion"]
                     for kind, name in (("secret", f"{NAME}-backbone-keys"), ("service", f"{NAME}-monitor"))}
        began = time.monotonic()
        cluster.kubectl("scale", "statefulset", f"{NAME}-backbone", "-n", NAMESPACE, "--replicas=2")
        cluster.kubectl("patch", "service", f"{NAME}-backbone", "-n", NAMESPACE, "--type=json", "-p",
                        json.dumps([{"op": "replace", "path": "/spec/ports/0/targetPort", "value": 9999}]))
        cluster.kubectl("label", "configmap", f"{NAME}-config", "-n", NAMESPACE, "--overwrite",
                        "app.kubernetes.io/part-of=other", "team=vision")

        def set_back() -> bool:
            sts = cluster.get("statefulset", f"{NAME}-backbone")
            ports = cluster.get("service", f"{NAME}-backbone")["spec"]["ports"]
            labels = cluster.get("configmap", f"{NAME}-config")["metadata"]["labels"]
            return sts["spec"]["replicas"] == 1 and all(p["targetPort"] != 9999 for p in ports) \
                and labels["app.kubernetes.io/part-of"] == "hivekeeper"

        wait_for(set_back, 60, "the hand edits set back", interval=0.5)
        FIGURES["handEditSetBackSeconds"] = round(time.monotonic() - began, 1)
        save_figures()
        assert cluster.get("configmap", f"{NAME}-config")["metadata"]["labels"]["team"] == "vision"
        time.sleep(15)  # three more resyncs
        assert {kind: cluster.get(kind, name)["metadata"]["resourceVersion"]
                for kind, name in (("secret", f"{NAME}-backbone-keys"), ("service", f"{NAME}-monitor"))} == untouched
        sts = json.loads(cluster.kubectl("get", "statefulset", f"{NAME}-backbone", "-n", NAMESPACE, "-o", "json",
                                         "--show-managed-fields").stdout)
        managers = {e["manager"]: e["operation"] for e in sts["metadata"]["managedFields"]}
        assert managers.get("hivekeeper-operator") == "Apply", managers

        # kubectl scale of the Swarm goes through its scale subresource to the trainers.
        cluster.kubectl("scale", "swarm", NAME, "-n", NAMESPACE, "--replicas=1")

        def described() -> str | None:
            text = cluster.kubectl("describe", "swarm", NAME, "-n", NAMESPACE).stdout
            events = text.partition("\nEvents:")[2]
            return text if all(line in events for line in (
                "PhaseChanged", "backbone: 2 -> 1 replicas", "trainer: 0 -> 1 replicas", "hivekeeper-operator")) else None

        text = wait_for(described, 60, "the operator's events in kubectl describe")
        print(text.partition("\nEvents:")[2])
