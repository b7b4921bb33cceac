"""The operator against a Kubernetes API: real kopf and the official client against kmock's
emulator (with tests/kube_emulator.py's shim: uid, resourceVersion, generation, status
subresource, garbage collection by owner). No controller runs there, so the tests write what
the StatefulSet and Job controllers would (readiness, completion) and fake the monitor's
/status through the injectable reader."""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from typing import Any, Callable

import pytest

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator,operator-test]')")
pytest.importorskip("kmock", reason="the operator-test extra is not installed (pip install -e '.[operator-test]')")

import jsonschema  # noqa: E402
import yaml  # noqa: E402

from conftest import EXAMPLES, deep_update  # noqa: E402
from conftest import wait_for as poll_until  # noqa: E402
from hivekeeper.spec.crd import KINDS, crd, jsonschema_for  # noqa: E402
from hivekeeper_operator import identity, readers  # noqa: E402
from hivekeeper_operator.kube import Kube  # noqa: E402
from hivekeeper.local.network import free_port  # noqa: E402
from hivekeeper_operator.reconcile import OperatorConfig  # noqa: E402
from hivekeeper_operator.runtime import Operator  # noqa: E402
from hivekeeper_operator.pods import CONFIG_HASH, WorkloadSettings  # noqa: E402
from kube_emulator import EmulatedCluster  # noqa: E402

NS = "default"
SWARMS = "hivekeeper.dev/v1alpha1/swarms"
STS = "apps/v1/statefulsets"
JOBS = "batch/v1/jobs"
CHILD_RESOURCES = ["v1/secrets", "v1/configmaps", "v1/services", STS, JOBS, "policy/v1/poddisruptionbudgets"]
# The longest a test waits for the operator (an idle 2-core machine: a few seconds). CI's
# machine is at times ten times slower (a waiting of 0.6 s here took 6.2 s there), and a wait
# costs only what the condition takes to come true.
WAIT = 120.0

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


class FakeMonitor:
    """Stands in for the monitor's /status endpoint."""

    def __init__(self) -> None:
        self.reading: dict[str, Any] | None = None
        self.urls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, namespace: str, name: str, url: str) -> dict[str, Any] | None:
        with self.lock:
            self.urls.append(url)
            return self.reading


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with EmulatedCluster(tmp_path, crds=[crd(kind) for kind in sorted(KINDS)]) as emulated:
        monkeypatch.setenv("KUBECONFIG", str(emulated.kubeconfig))
        yield emulated


@pytest.fixture
def service_monitor_cluster(tmp_path, monkeypatch):
    with EmulatedCluster(tmp_path, crds=[crd(kind) for kind in sorted(KINDS)], service_monitors=True) as emulated:
        monkeypatch.setenv("KUBECONFIG", str(emulated.kubeconfig))
        yield emulated


@pytest.fixture
def client(cluster):
    import kubernetes

    return kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture
def monitor():
    return FakeMonitor()


@pytest.fixture
def start_operator(request, monitor):
    started: list[Operator] = []

    def start(target: EmulatedCluster | None = None, **overrides: Any) -> Operator:
        import kubernetes

        target = target or request.getfixturevalue("cluster")
        kube = Kube(kubernetes.config.new_client_from_config(config_file=str(target.kubeconfig)))
        config = OperatorConfig(settings=WorkloadSettings(image="hivekeeper:test", progress_deadline_seconds=3600),
                                resync_seconds=0.2, metrics_port=None, status_reader=monitor)
        for key, value in overrides.items():
            setattr(config, key, value)
        operator = Operator(config, kube=kube).start()
        started.append(operator)
        assert operator.resynced.wait(WAIT), "the operator never finished a resync"
        return operator

    yield start
    for operator in started:
        if not operator.stop_flag.is_set():
            operator.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = WAIT, what: str = "condition") -> Any:
    return poll_until(predicate, timeout, what, interval=0.05)


def example(name: str = "swarm-digits.yaml", changes: dict[str, Any] | None = None) -> dict[str, Any]:
    document = yaml.safe_load((EXAMPLES / name).read_text())
    return deep_update(document, changes or {})


def apply_swarm(client, document: dict[str, Any]) -> dict[str, Any]:
    import kubernetes

    return kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
        "hivekeeper.dev", "v1alpha1", NS, "swarms", document)


def patch_swarm(client, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    import kubernetes

    return kubernetes.client.CustomObjectsApi(client).patch_namespaced_custom_object(
        "hivekeeper.dev", "v1alpha1", NS, "swarms", name, patch, _content_type="application/merge-patch+json")


def swarm(cluster: EmulatedCluster, name: str = "digits") -> dict[str, Any] | None:
    return cluster.object(SWARMS, NS, name)


def children(cluster: EmulatedCluster, name: str = "digits") -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for resource in CHILD_RESOURCES:
        for obj in cluster.objects(resource, NS):
            if obj["metadata"].get("labels", {}).get("hivekeeper.dev/swarm") == name:
                out[(obj["kind"] if "kind" in obj else resource, obj["metadata"]["name"])] = obj
    return out


EXPECTED_CHILDREN = {
    ("Secret", "digits-backbone-keys"), ("ConfigMap", "digits-config"),
    ("Service", "digits-backbone"), ("Service", "digits-trainer"), ("Service", "digits-auxiliary"),
    ("Service", "digits-monitor"), ("Service", "digits-balancer"),
    ("StatefulSet", "digits-backbone"), ("StatefulSet", "digits-trainer"), ("StatefulSet", "digits-auxiliary"),
    ("StatefulSet", "digits-balancer"),
    ("Job", "digits-monitor"), ("PodDisruptionBudget", "digits-backbone"),
}


def all_children_made(cluster: EmulatedCluster, name: str = "digits") -> dict | None:
    made = children(cluster, name)
    return made if set(made) == EXPECTED_CHILDREN else None


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def become_ready(cluster: EmulatedCluster, name: str = "digits", counts: dict[str, int] | None = None) -> None:
    """What the StatefulSet and Job controllers would report once every pod is ready."""
    counts = counts or {}
    for component in ("backbone", "trainer", "auxiliary", "balancer"):
        sts = cluster.object(STS, NS, f"{name}-{component}")
        n = counts.get(component, sts["spec"]["replicas"])
        cluster.set_status(STS, NS, f"{name}-{component}", {
            "observedGeneration": sts["metadata"]["generation"], "replicas": n, "readyReplicas": n,
            "updatedReplicas": n, "availableReplicas": n})
    cluster.set_status(JOBS, NS, f"{name}-monitor", {"active": 1, "ready": 1})


# ---------------------------------------------------------------------------------------------
# Apply: children, owner references, the rendered configuration, status


def test_swarm_becomes_children_with_owner_references(cluster, client, start_operator, monitor):
    start_operator()
    apply_swarm(client, example())
    made = wait_for(lambda: all_children_made(cluster), what="every child of the Swarm")
    uid = swarm(cluster)["metadata"]["uid"]
    for key, obj in made.items():
        owners = obj["metadata"]["ownerReferences"]
        assert owners == [{"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "Swarm", "name": "digits", "uid": uid,
                           "controller": True, "blockOwnerDeletion": True}], key
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "hivekeeper-operator"

    sts = {c: made[("StatefulSet", f"digits-{c}")] for c in ("backbone", "trainer", "auxiliary")}
    assert {c: s["spec"]["replicas"] for c, s in sts.items()} == {"backbone": 1, "trainer": 3, "auxiliary": 1}
    assert sts["backbone"]["spec"]["serviceName"] == "digits-backbone"
    assert sts["backbone"]["spec"]["podManagementPolicy"] == "Parallel"
    backbone_service = made[("Service", "digits-backbone")]["spec"]
    assert backbone_service["clusterIP"] == "None" and backbone_service["publishNotReadyAddresses"] is True

    trainer_pod = sts["trainer"]["spec"]["template"]["spec"]
    container = trainer_pod["containers"][0]
    assert container["image"] == "hivekeeper:test"
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert trainer_pod["securityContext"]["runAsNonRoot"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert made[("PodDisruptionBudget", "digits-backbone")]["spec"]["minAvailable"] == 1
    assert made[("Job", "digits-monitor")]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"

    # Every pod's arguments are the topology's, with the backbone's stable DNS name and peer ID.
    config = made[("ConfigMap", "digits-config")]["data"]
    roles = json.loads(config["roles.json"])
    assert sorted(roles) == ["auxiliary-0", "backbone-0", "balancer-0", "monitor-0", "trainer-0", "trainer-1",
                             "trainer-2"]
    key = base64.b64decode(made[("Secret", "digits-backbone-keys")]["data"]["backbone-0.key"])
    peer = identity.peer_id(key)
    maddr = f"/dns4/digits-backbone-0.digits-backbone.default.svc.cluster.local/tcp/31337/p2p/{peer}"
    trainer_args = roles["trainer-1"]["args"]
    assert trainer_args[:4] == ["trainer", "--manifest", "/etc/hivekeeper/manifest.json", "--index"]
    assert trainer_args[trainer_args.index("--initial-peers") + 1:] == [maddr]
    assert "--identity" in roles["backbone-0"]["args"] and "--initial-peers" not in roles["backbone-0"]["args"]
    # Peers follow the averaging plan signed by the balancer's key, also kept in the Secret.
    balancer = identity.peer_id(base64.b64decode(made[("Secret", "digits-backbone-keys")]["data"]["balancer-0.key"]))
    assert trainer_args[trainer_args.index("--plan-signer") + 1] == balancer
    assert "--identity" in roles["balancer-0"]["args"]
    rendered = json.loads(config["manifest.json"])
    assert rendered["spec"]["trainers"]["replicas"] == 3 and rendered["spec"]["optimizer"]["learningRate"] == 0.003

    # Status while nothing is ready yet, then once the controllers report every pod ready.
    pending = wait_for(lambda: (s := swarm(cluster)).get("status", {}).get("readyPeers") and s, what="status")
    assert pending["status"]["phase"] == "Pending"
    assert pending["status"]["readyPeers"] == "0/7"
    assert pending["status"]["observedGeneration"] == 1
    assert condition(pending, "Ready")["status"] == "False"
    assert pending["status"]["initialPeers"] == [maddr]

    monitor.reading = {"globalStep": 42, "samplesPerSecond": 1234.56, "loss": 0.5, "evalMetrics": {"accuracy": 0.9},
                       "peersAlive": {"backbone": 1, "trainer": 3, "auxiliary": 1, "monitor": 1, "balancer": 1},
                       "stepsPerSecond": 0.41, "plan": {"stepsPerSecond": 1.19, "computeBound": 1.19},
                       "labs": [*LABS, {"name": "broken", "peers": -1}]}  # a row the CRD refuses is dropped
    become_ready(cluster)
    running = wait_for(lambda: (s := swarm(cluster))["status"].get("globalStep") == 42
                       and s["status"]["phase"] == "Running" and s, what="a Running status with live figures")
    status = running["status"]
    assert status["readyPeers"] == "7/7"
    assert status["samplesPerSecond"] == 1234.6
    assert status["achievedStepsPerSecond"] == 0.41 and status["predictedStepsPerSecond"] == 1.19
    assert status["efficiency"] == 0.34
    assert status["peersAlive"] == {"backbone": 1, "trainer": 3, "auxiliary": 1, "monitor": 1, "balancer": 1}
    assert status["labs"] == LABS
    assert status["trainers"] == {"desired": 3, "replicas": 3, "ready": 3}
    assert status["selector"] == "hivekeeper.dev/swarm=digits,hivekeeper.dev/component=trainer"
    assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]} == {
        "Ready": ("True", "AllPeersReady"), "Progressing": ("False", "Stable"), "Degraded": ("False", "AsExpected")}
    assert monitor.urls[-1] == "http://digits-monitor.default.svc.cluster.local:9300/status"
    # The status the operator writes is one the CRD accepts, and it never touched the spec.
    jsonschema.validate(running, jsonschema_for("Swarm"))
    assert running["spec"] == example()["spec"]
    assert running["metadata"]["generation"] == 1
    assert not running["metadata"].get("finalizers")


# the monitor's parts of each party (hivekeeper.swarm.parties.labs_of)
LABS = [{"name": "digits", "host": True, "peers": 5, "samplesPerSecond": 900.0, "samples": 9000, "share": 0.75,
         "averagingBytesSent": 4096},
        {"name": "lab-b", "host": False, "peers": 2, "samplesPerSecond": 334.6, "samples": 3000, "share": 0.25,
         "averagingBytesSent": 2048}]


def test_scale_rolls_nothing_and_a_change_rolls_only_its_roles(cluster, client, start_operator):
    start_operator()
    apply_swarm(client, example())
    before = wait_for(lambda: all_children_made(cluster), what="children")
    templates = {c: before[("StatefulSet", f"digits-{c}")]["spec"]["template"] for c in ("backbone", "trainer", "auxiliary")}
    job_uid = before[("Job", "digits-monitor")]["metadata"]["uid"]

    # kubectl scale sets spec.trainers.replicas (the scale subresource's specReplicasPath).
    patch_swarm(client, "digits", {"spec": {"trainers": {"replicas": 5}}})
    scaled = wait_for(lambda: cluster.object(STS, NS, "digits-trainer")["spec"]["replicas"] == 5
                      and children(cluster), what="trainers scaled to 5")
    for component in ("backbone", "trainer", "auxiliary"):
        assert scaled[("StatefulSet", f"digits-{component}")]["spec"]["template"] == templates[component], component
    assert scaled[("Job", "digits-monitor")]["metadata"]["uid"] == job_uid
    roles = json.loads(scaled[("ConfigMap", "digits-config")]["data"]["roles.json"])
    assert "trainer-4" in roles
    status = wait_for(lambda: (s := swarm(cluster)["status"]).get("observedGeneration") == 2 and s, what="status")
    assert status["trainers"]["desired"] == 5

    # Trainer resources concern only the trainers.
    patch_swarm(client, "digits", {"spec": {"trainers": {"resources": {"cpu": "2"}}}})
    changed = wait_for(lambda: cluster.object(STS, NS, "digits-trainer")["spec"]["template"]["spec"]["containers"][0]
                       ["resources"]["requests"]["cpu"] == "2" and children(cluster), what="trainer resources")
    for component in ("backbone", "auxiliary"):
        assert changed[("StatefulSet", f"digits-{component}")]["spec"]["template"] == templates[component], component
    assert changed[("Job", "digits-monitor")]["metadata"]["uid"] == job_uid

    # The learning rate is read by every role: each one rolls, the monitor Job is replaced.
    patch_swarm(client, "digits", {"spec": {"optimizer": {"learningRate": 0.001}}})

    def rolled() -> dict | None:
        now = children(cluster)
        hashes = {c: now[("StatefulSet", f"digits-{c}")]["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]
                  for c in ("backbone", "trainer", "auxiliary") if ("StatefulSet", f"digits-{c}") in now}
        job = now.get(("Job", "digits-monitor"))
        if len(hashes) == 3 and job and job["metadata"]["uid"] != job_uid and all(
                hashes[c] != templates[c]["metadata"]["annotations"][CONFIG_HASH] for c in hashes):
            return now
        return None

    after = wait_for(rolled, what="every role rolled for a new learning rate")
    manifest = json.loads(after[("ConfigMap", "digits-config")]["data"]["manifest.json"])
    assert manifest["spec"]["optimizer"]["learningRate"] == 0.001
    assert len([k for k in after if k[0] == "Job"]) == 1


# kind -> (plural, example, name, the component whose StatefulSet goes missing)
RESTARTED = {"Swarm": ("swarms", "swarm-digits.yaml", "digits", "trainer"),
             "BlockServer": ("blockservers", "blockserver.yaml", "tiny-llama", "block-server"),
             "ExpertPool": ("expertpools", "expertpool.yaml", "digits-moe", "expert-server")}


@pytest.mark.parametrize("kind", sorted(RESTARTED))
def test_operator_restart_creates_no_duplicates_and_repairs_what_is_missing(cluster, client, start_operator, kind):
    import kubernetes

    plural, example_file, name, component = RESTARTED[kind]
    first = start_operator()
    kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
        "hivekeeper.dev", "v1alpha1", NS, plural, example(example_file))
    resource = f"hivekeeper.dev/v1alpha1/{plural}"
    # The status is written once every child of the first reconcile is applied.
    wait_for(lambda: (cluster.object(resource, NS, name).get("status") or {}).get("readyPeers"), what="status")
    made = children(cluster, name)
    assert ("StatefulSet", f"{name}-{component}") in made and ("ConfigMap", f"{name}-config") in made
    first.stop()
    counts = {r: len(cluster.objects(r, NS)) for r in CHILD_RESOURCES}

    # While no operator runs, a child disappears (deleted by hand, or the operator died
    # between two creates of its first reconcile).
    kubernetes.client.AppsV1Api(client).delete_namespaced_stateful_set(f"{name}-{component}", NS)
    kubernetes.client.CoreV1Api(client).delete_namespaced_config_map(f"{name}-config", NS)
    assert cluster.object(STS, NS, f"{name}-{component}") is None

    second = start_operator()
    repaired = wait_for(lambda: (now := children(cluster, name)) and set(now) == set(made) and now,
                        what="the missing children")
    time.sleep(1.0)  # several more resyncs
    assert {r: len(cluster.objects(r, NS)) for r in CHILD_RESOURCES} == counts
    for key, obj in repaired.items():
        if key not in (("StatefulSet", f"{name}-{component}"), ("ConfigMap", f"{name}-config")):
            assert obj["metadata"]["uid"] == made[key]["metadata"]["uid"], key
            assert obj["metadata"]["resourceVersion"] == made[key]["metadata"]["resourceVersion"], key
    # The backbone keeps its key, so its peer ID, and everyone's bootstrap address, stay.
    assert repaired[("Secret", f"{name}-backbone-keys")]["data"] == made[("Secret", f"{name}-backbone-keys")]["data"]
    assert repaired[("ConfigMap", f"{name}-config")]["data"] == made[("ConfigMap", f"{name}-config")]["data"]
    writes = {tuple(s.labels.values()): s.value for metric in second.metrics.writes.collect()
              for s in metric.samples if s.name.endswith("_total")}
    assert writes == {(kind, "StatefulSet", "create"): 1.0, (kind, "ConfigMap", "create"): 1.0}


def test_a_hand_edit_of_a_field_the_operator_sets_is_set_back_and_other_fields_stay(cluster, client, start_operator):
    """Server-side apply: `kubectl scale` of a StatefulSet, an edited Service port's target or
    label come back to the plan's values at the next resync; a label and an annotation of
    someone else's stay, and a child nobody touched is not written again. (The emulator's lists
    are atomic; a real apiserver merges ports by port number, so a port added by hand stays:
    the real-cluster test edits one the operator set.)"""
    import kubernetes

    operator = start_operator()
    apply_swarm(client, example())
    made = wait_for(lambda: all_children_made(cluster), what="children")
    apps, core = kubernetes.client.AppsV1Api(client), kubernetes.client.CoreV1Api(client)
    apps.patch_namespaced_stateful_set("digits-trainer", NS, {
        "metadata": {"labels": {"team": "vision"}, "annotations": {"note": "mine"}}, "spec": {"replicas": 7}})
    ports = made[("Service", "digits-backbone")]["spec"]["ports"]
    core.patch_namespaced_service("digits-backbone", NS, {"spec": {"ports": [{**ports[0], "targetPort": 9999}, *ports[1:]]}})
    core.patch_namespaced_config_map("digits-config", NS, {"metadata": {"labels": {"app.kubernetes.io/part-of": "other"}}})

    def set_back() -> dict | None:
        now = children(cluster)
        trainer = now[("StatefulSet", "digits-trainer")]
        return now if (trainer["spec"]["replicas"] == 3
                       and now[("Service", "digits-backbone")]["spec"]["ports"] == made[("Service", "digits-backbone")]["spec"]["ports"]
                       and now[("ConfigMap", "digits-config")]["metadata"]["labels"] == made[("ConfigMap", "digits-config")]["metadata"]["labels"]) else None

    now = wait_for(set_back, what="the hand edits set back")
    trainer = now[("StatefulSet", "digits-trainer")]["metadata"]
    assert trainer["labels"]["team"] == "vision" and trainer["annotations"]["note"] == "mine"
    assert now[("StatefulSet", "digits-trainer")]["spec"]["template"] == made[("StatefulSet", "digits-trainer")]["spec"]["template"]
    assert [e["manager"] for e in trainer["managedFields"] if e["operation"] == "Apply"] == ["hivekeeper-operator"]
    assert "hivekeeper.dev/applied-hash" not in (trainer.get("annotations") or {})
    edited = {("StatefulSet", "digits-trainer"), ("Service", "digits-backbone"), ("ConfigMap", "digits-config")}
    for key in set(made) - edited:
        assert now[key]["metadata"]["resourceVersion"] == made[key]["metadata"]["resourceVersion"], key
    writes = {tuple(s.labels.values()): s.value for metric in operator.metrics.writes.collect()
              for s in metric.samples if s.name.endswith("_total") and s.labels["action"] == "patch"}
    assert writes == {("Swarm", "StatefulSet", "patch"): 1.0, ("Swarm", "Service", "patch"): 1.0,
                      ("Swarm", "ConfigMap", "patch"): 1.0}


def events(cluster: EmulatedCluster, name: str = "digits") -> list[dict[str, Any]]:
    return sorted((e for e in cluster.objects("v1/events", NS) if e["involvedObject"]["name"] == name
                   and e["source"]["component"] == "hivekeeper-operator"), key=lambda e: e["metadata"]["name"])


def test_events_tell_phase_changes_scaling_and_errors_once_each(cluster, client, start_operator):
    """What `kubectl describe` lists: phase changes and scaling, and an error that repeats at every
    resync as one Event whose count grows."""
    start_operator()
    apply_swarm(client, example())
    wait_for(lambda: all_children_made(cluster), what="children")
    become_ready(cluster)
    wait_for(lambda: swarm(cluster).get("status", {}).get("phase") == "Running", what="Running")
    patch_swarm(client, "digits", {"spec": {"trainers": {"replicas": 5}}})
    recorded = wait_for(lambda: (found := events(cluster)) and any(e["reason"] == "Scaled" for e in found) and found,
                        what="a Scaled event")
    assert [(e["type"], e["reason"], e["message"]) for e in recorded] == [
        ("Normal", "PhaseChanged", "Pending"), ("Normal", "PhaseChanged", "Pending -> Running"),
        ("Normal", "Scaled", "trainer: 3 -> 5 replicas")]
    uid = swarm(cluster)["metadata"]["uid"]
    assert all(e["involvedObject"] == {**e["involvedObject"], "kind": "Swarm", "namespace": NS, "uid": uid}
               for e in recorded)

    apply_swarm(client, example(changes={"metadata": {"name": "bad"}, "spec": {"trainers": {"batchSize": 512}}}))
    repeated = wait_for(lambda: [e for e in events(cluster, "bad") if e["reason"] == "InvalidSpec" and e["count"] >= 3],
                        what="the invalid spec reported at three resyncs")
    assert len([e for e in events(cluster, "bad") if e["reason"] == "InvalidSpec"]) == 1
    assert repeated[0]["type"] == "Warning" and "exceeds targetBatchSize" in repeated[0]["message"]
    assert repeated[0]["lastTimestamp"] >= repeated[0]["firstTimestamp"]


def test_deleting_the_swarm_removes_its_children(cluster, client, start_operator):
    start_operator()
    apply_swarm(client, example())
    wait_for(lambda: all_children_made(cluster), what="children")
    assert not swarm(cluster)["metadata"].get("finalizers")  # deletion never waits for the operator

    import kubernetes

    kubernetes.client.CustomObjectsApi(client).delete_namespaced_custom_object(
        "hivekeeper.dev", "v1alpha1", NS, "swarms", "digits")
    wait_for(lambda: swarm(cluster) is None and not children(cluster), what="the Swarm and its children to go")
    time.sleep(1.0)  # several resyncs: nothing comes back
    assert children(cluster) == {}


def test_invalid_spec_is_reported_and_creates_nothing(cluster, client, start_operator):
    start_operator()
    # The CRD schema accepts this (each field is in range); the model's cross-field rule does not.
    apply_swarm(client, example(changes={"spec": {"trainers": {"batchSize": 512}}}))
    invalid = wait_for(lambda: (s := swarm(cluster)).get("status", {}).get("phase") == "Invalid" and s,
                       what="an Invalid phase")
    degraded = condition(invalid, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "trainers.batchSize (512) exceeds targetBatchSize (256)" in degraded["message"]
    assert children(cluster) == {}


def test_completed_run_stops_the_peers(cluster, client, start_operator):
    start_operator()
    apply_swarm(client, example())
    wait_for(lambda: all_children_made(cluster), what="children")
    become_ready(cluster)
    wait_for(lambda: swarm(cluster).get("status", {}).get("phase") == "Running", what="Running")
    cluster.set_status(JOBS, NS, "digits-monitor", {
        "succeeded": 1, "active": 0, "conditions": [{"type": "Complete", "status": "True"}]})
    done = wait_for(lambda: (s := swarm(cluster))["status"]["phase"] == "Succeeded" and s, what="Succeeded")
    assert condition(done, "Ready")["reason"] == "Completed"
    for component in ("backbone", "trainer", "auxiliary"):
        assert cluster.object(STS, NS, f"digits-{component}")["spec"]["replicas"] == 0, component
    assert cluster.object(JOBS, NS, "digits-monitor") is not None  # kept: its logs tell how it ended


def test_completed_run_shows_the_monitors_final_figures(cluster, client, start_operator, monitor):
    """The monitor evaluates once more as it finishes, after the operator's last read of its
    /status: the status ends with its final report (the Job pod's termination message)."""
    start_operator()
    apply_swarm(client, example())
    wait_for(lambda: all_children_made(cluster), what="children")
    monitor.reading = {"globalStep": 41, "loss": 0.31, "evalMetrics": {"accuracy": 0.95}, "samplesPerSecond": 412.6}
    become_ready(cluster)
    wait_for(lambda: swarm(cluster).get("status", {}).get("globalStep") == 41, what="the live figures")

    job = cluster.object(JOBS, NS, "digits-monitor")
    final = {"globalStep": 45, "reason": "target accuracy reached", "metrics": {"accuracy": 0.969},
             "losses": {"44": 0.2, "45": 0.18}, "outerSteps": 9}
    Kube(client).create({  # what the Job controller and the kubelet would have made of the monitor's pod
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "digits-monitor-x7k2p", "namespace": NS,
                     "labels": job["spec"]["template"]["metadata"]["labels"],
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "digits-monitor",
                                          "uid": job["metadata"]["uid"], "controller": True}]},
        "spec": job["spec"]["template"]["spec"],
        "status": {"phase": "Succeeded", "containerStatuses": [{"name": "monitor", "state": {"terminated": {
            "exitCode": 0, "reason": "Completed", "finishedAt": "2026-01-01T00:10:00Z",
            "message": readers.final_report_message(final)}}}]}})
    monitor.reading = None  # gone with its pod
    cluster.set_status(JOBS, NS, "digits-monitor", {
        "succeeded": 1, "active": 0, "conditions": [{"type": "Complete", "status": "True"}]})

    done = wait_for(lambda: (s := swarm(cluster))["status"]["phase"] == "Succeeded"
                    and s["status"].get("globalStep") == 45 and s, what="the final figures")
    status = done["status"]
    assert status["evalMetrics"] == {"accuracy": 0.969} and status["loss"] == 0.18
    assert status["outerSteps"] == 9  # replicas that train alone: their outer steps (or merges)
    assert status["samplesPerSecond"] == 412.6  # the last live reading's, the report has none
    time.sleep(1.0)  # several more resyncs: the final figures stay
    assert swarm(cluster)["status"]["globalStep"] == 45
    jsonschema.validate(swarm(cluster), jsonschema_for("Swarm"))


def test_service_monitor_only_when_its_crd_exists(service_monitor_cluster, start_operator):
    import kubernetes

    start_operator(service_monitor_cluster)
    client = kubernetes.config.new_client_from_config(config_file=str(service_monitor_cluster.kubeconfig))
    apply_swarm(client, example())
    monitor = wait_for(lambda: service_monitor_cluster.object("monitoring.coreos.com/v1/servicemonitors", NS, "digits"),
                       what="a ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {"hivekeeper.dev/swarm": "digits", "hivekeeper.dev/metrics": "true"}
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_a_foreign_object_with_a_child_name_is_left_alone(cluster, client, start_operator):
    import kubernetes

    kubernetes.client.CoreV1Api(client).create_namespaced_config_map(
        NS, {"metadata": {"name": "digits-config"}, "data": {"mine": "yes"}})
    start_operator()
    apply_swarm(client, example())
    degraded = wait_for(lambda: (s := swarm(cluster)).get("status", {}).get("conditions")
                        and condition(s, "Degraded")["reason"] == "NameConflict" and s, what="a NameConflict")
    assert "ConfigMap default/digits-config exists and is not managed by hivekeeper" in condition(degraded, "Degraded")["message"]
    assert cluster.object("v1/configmaps", NS, "digits-config")["data"] == {"mine": "yes"}


def test_operator_serves_metrics_and_probes(cluster, client, start_operator):
    port = free_port()
    start_operator(metrics_port=port, metrics_host="127.0.0.1")
    apply_swarm(client, example())
    wait_for(lambda: all_children_made(cluster), what="children")

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    import urllib.error

    assert get("/healthz")[0] == 200
    assert get("/readyz")[0] == 200
    body = wait_for(lambda: (b := get("/metrics")[1]) and 'hivekeeper_operator_reconciles_total{kind="Swarm",result="success"}' in b and b,
                    what="reconcile metrics")
    assert "hivekeeper_operator_reconcile_duration_seconds_bucket" in body
    assert 'hivekeeper_operator_child_writes_total{action="create",child_kind="StatefulSet",kind="Swarm"} 4.0' in body
    assert json.loads(get("/status")[1])["kinds"] == ["Swarm", "BlockServer", "ExpertPool"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("swarm-*.yaml")), ids=lambda p: p.name)
def test_every_example_reconciles(cluster, client, start_operator, path):
    """Every Swarm example (the other kinds' examples: test_operator_kinds.py)."""
    document = yaml.safe_load(path.read_text())
    name = document["metadata"]["name"]
    start_operator()
    apply_swarm(client, document)
    spec = document["spec"]

    def made() -> dict | None:
        now = children(cluster, name)
        return now if ("PodDisruptionBudget", f"{name}-backbone") in now and swarm(cluster, name).get("status") else None

    now = wait_for(made, what=f"the children of {path.name}")
    uid = swarm(cluster, name)["metadata"]["uid"]
    assert all(obj["metadata"]["ownerReferences"][0]["uid"] == uid for obj in now.values())
    replicas = {c: now[("StatefulSet", f"{name}-{c}")]["spec"]["replicas"] for c in ("backbone", "trainer", "auxiliary")}
    assert replicas == {"backbone": spec.get("backbone", {}).get("replicas", 1),
                        "trainer": spec.get("trainers", {}).get("replicas", 2),
                        "auxiliary": spec.get("auxiliary", {}).get("replicas", 0)}
    roles = json.loads(now[("ConfigMap", f"{name}-config")]["data"]["roles.json"])
    assert sum(r["component"] == "trainer" for r in roles.values()) == replicas["trainer"]
    assert swarm(cluster, name)["status"]["phase"] == "Pending"


def test_closing_the_door_to_volunteers_deletes_what_it_needed(cluster, client, start_operator):
    """The owner scan: spec.volunteers switched off, the relays, the token service, their
    external Services and Secrets go (Secrets through the keys Secret's record: never listed);
    everything else stays."""
    start_operator()
    apply_swarm(client, example("swarm-digits-volunteers.yaml"))
    name = "digits-open"
    door = {("StatefulSet", f"{name}-relay"), ("StatefulSet", f"{name}-auth"), ("Service", f"{name}-relay"),
            ("Service", f"{name}-auth"), ("Service", f"{name}-relay-0"), ("Service", f"{name}-gateway"),
            ("Secret", f"{name}-swarm-auth"), ("Secret", f"{name}-invites")}
    # The status is written after every child: once it is there, the first pass is whole.
    opened = wait_for(lambda: swarm(cluster, name).get("status") and (now := children(cluster, name)) and door <= set(now)
                      and now, what="the door's children")
    patch_swarm(client, name, {"spec": {"volunteers": {"enabled": False}}})
    closed = wait_for(lambda: (now := children(cluster, name)) and not door & set(now) and now, what="the door gone")
    assert set(closed) == set(opened) - door
    assert closed[("StatefulSet", f"{name}-trainer")]["metadata"]["uid"] == opened[("StatefulSet", f"{name}-trainer")]["metadata"]["uid"]
