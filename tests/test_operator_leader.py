"""Operator replicas and their leader Lease, against the emulator: one replica reconciles, the
other stands by; a leader that stops hands over at once, one that loses the Lease stops acting
at once, and a standby takes a Lease nobody renews only once it has expired. Timings are cut
to seconds (the chart keeps controller-runtime's 15 / 10 / 2)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator,operator-test]')")
pytest.importorskip("kmock", reason="the operator-test extra is not installed (pip install -e '.[operator-test]')")

from conftest import REPO  # noqa: E402
from hivekeeper.local.network import free_port  # noqa: E402
from hivekeeper_operator.kube import Kube, KubeError  # noqa: E402
from hivekeeper_operator.leader import LeaderElection, LeadershipLost  # noqa: E402
from hivekeeper_operator.pods import WorkloadSettings  # noqa: E402
from hivekeeper_operator.reconcile import OperatorConfig  # noqa: E402
from hivekeeper_operator.runtime import Operator  # noqa: E402
from test_operator import (  # noqa: E402,F401  (fixtures)
    CHILD_RESOURCES,
    NS,
    all_children_made,
    apply_swarm,
    children,
    client,
    cluster,
    example,
    monitor,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)
LEASES = "coordination.k8s.io/v1/leases"
LEASE = "hivekeeper-operator"
TIMING = dict(lease_duration=10.0, renew_deadline=8.0, retry_period=0.3)


@pytest.fixture
def start_replica(cluster, monitor):
    started: list[Operator] = []

    def start(identity: str) -> Operator:
        import kubernetes

        kube = Kube(kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig)))
        config = OperatorConfig(settings=WorkloadSettings(image="hivekeeper:test"), resync_seconds=0.2,
                                metrics_port=None, status_reader=monitor,
                                leader_election=LeaderElection(namespace=NS, identity=identity, **TIMING))
        operator = Operator(config, kube=kube).start()
        started.append(operator)
        return operator

    yield start
    for operator in started:
        if not operator.stop_flag.is_set():
            operator.stop()


def lease(cluster) -> dict[str, Any]:
    return (cluster.object(LEASES, NS, LEASE) or {}).get("spec") or {}


def child_writes(operator: Operator) -> float:
    return sum(s.value for metric in operator.metrics.writes.collect() for s in metric.samples
               if s.name.endswith("_total"))


def set_lease(client, holder: str, duration: int) -> None:
    """What another replica's renewal would write (a replica that then dies: nobody renews).
    Like any writer of a lease it retries on a conflict: the leader renews every 0.3 s here, and
    a renewal between our read and our write made the write stale (seen in CI: 409)."""
    kube = Kube(client)
    for attempt in range(20):
        live = kube.get("coordination.k8s.io/v1", "Lease", NS, LEASE)
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            kube.replace({**live, "spec": {**live["spec"], "holderIdentity": holder, "leaseDurationSeconds": duration,
                                           "renewTime": now}})
            return
        except KubeError as e:
            if e.status != 409 or attempt == 19:
                raise


def test_one_replica_leads_and_the_other_takes_over_when_it_stops(cluster, client, start_replica):
    first = start_replica("first")
    wait_for(lambda: first.resynced.is_set(), what="the first replica leading")
    second = start_replica("second")
    wait_for(lambda: second.elector.holder == "first", what="the second replica seeing the leader")
    apply_swarm(client, example())
    made = wait_for(lambda: all_children_made(cluster), what="the Swarm's children")
    time.sleep(1.0)  # several resyncs of the leader, several tries of the standby
    assert lease(cluster)["holderIdentity"] == "first"
    assert not second.leadership.leading and not second.resynced.is_set()
    assert child_writes(second) == 0  # a standby writes nothing

    first.stop()  # a clean stop: the Lease is released, the standby takes it at its next try
    wait_for(lambda: second.leadership.leading, what="the second replica leading")
    spec = lease(cluster)
    assert spec["holderIdentity"] == "second" and spec["leaseTransitions"] == 1
    assert spec["leaseDurationSeconds"] == TIMING["lease_duration"]

    # The new leader reconciles what is applied now, and leaves the first one's children as they are.
    apply_swarm(client, example(changes={"metadata": {"name": "later"}}))
    wait_for(lambda: {(kind, name.replace("later-", "digits-")) for kind, name in children(cluster, "later")}
             == set(made), what="the later Swarm's children")
    time.sleep(1.0)
    now = children(cluster)
    assert {key: obj["metadata"]["resourceVersion"] for key, obj in now.items()} == {
        key: obj["metadata"]["resourceVersion"] for key, obj in made.items()}
    assert sum(len(cluster.objects(r, NS)) for r in CHILD_RESOURCES) == 2 * len(made)


def test_a_leader_that_loses_the_lease_stops_and_a_standby_waits_for_it_to_expire(cluster, client, start_replica):
    leader = start_replica("leader")
    wait_for(lambda: leader.resynced.is_set(), what="the replica leading")
    standby = start_replica("standby")
    wait_for(lambda: standby.elector.holder == "leader", what="the standby seeing the leader")

    # Another replica took the Lease (the leader was cut off from the API for too long, say),
    # and holds it for an hour: the leader stops at its next renewal; the standby waits.
    set_lease(client, "elsewhere", 3600)
    wait_for(lambda: leader.stop_flag.is_set(), what="the leader to stop")
    assert not leader.leadership.leading
    with pytest.raises(LeadershipLost, match="held by elsewhere"):
        leader.stop()
    apply_swarm(client, example())
    time.sleep(1.5)  # several resyncs' worth: nobody who leads, nothing reconciled
    assert children(cluster) == {} and not standby.leadership.leading

    # That replica dies: its Lease (4 s now) is not renewed again; the standby takes it once it
    # has seen it unchanged that long, and reconciles.
    set_lease(client, "elsewhere", 4)
    wait_for(lambda: standby.leadership.leading, what="the standby to take the expired Lease")
    assert lease(cluster)["holderIdentity"] == "standby"
    wait_for(lambda: all_children_made(cluster), what="the Swarm's children")


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_the_operator_process_stands_by_leads_and_exits_when_it_loses_the_lease(cluster, client, tmp_path):
    """The command line: a standby is ready (a rollout goes on) and reconciles nothing; a lost
    Lease ends the process at once with a failure, for the Deployment to start it again."""
    Kube(client).create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": LEASE, "namespace": NS}, "spec": {}})
    set_lease(client, "elsewhere", 3600)
    port = free_port()
    log_path = tmp_path / "operator.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "hivekeeper_operator", "--kubeconfig", str(cluster.kubeconfig),
             "--metrics-port", str(port), "--resync-seconds", "0.2", "--image", "hivekeeper:test",
             "--leader-elect", "--leader-elect-namespace", NS, "--leader-elect-lease", LEASE,
             "--leader-elect-lease-duration", "10", "--leader-elect-renew-deadline", "8",
             "--leader-elect-retry-period", "0.3"],
            cwd=REPO, env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert process.poll() is None, log_path.read_text()[-3000:]
            return ready(port)

        wait_for(up, 120, "the standby's /readyz")
        apply_swarm(client, example())
        time.sleep(1.0)
        assert children(cluster) == {}

        set_lease(client, "", 1)  # released
        wait_for(lambda: all_children_made(cluster), what="the Swarm's children, once the process leads")
        holder = lease(cluster)["holderIdentity"]
        assert holder.startswith(f"{os.uname().nodename}_")

        set_lease(client, "elsewhere", 3600)
        code = wait_for(lambda: process.poll() is not None and (process.returncode,), 30, "the process to exit")
        assert code == (1,), log_path.read_text()[-3000:]
        assert '"msg": "leadership lost"' in log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
