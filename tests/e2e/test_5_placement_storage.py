"""Placement and storage on a real cluster: a role group's node selector, tolerations, priority
class, extra labels, env and volumes on its pods, which get scheduled; a selector no node
matches leaves the new pod Pending until a node gets the label; a placement naming a volume of
the pods' own turns the Swarm Invalid; the Swarm monitor's checkpoints on a claim bound to a
PersistentVolume the test makes, a monitor pod deleted mid-run going on from them, the final
model there after the run; a BlockServer serving a Hugging Face folder from a claim."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from e2e.support import NAMESPACE, Cluster, applied, example, logged_entry, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NODE = "hk-node"  # scripts/cluster.sh's one node
POOL = "lab.example/pool"
SMALL = {"cpu": "250m", "memory": "1Gi"}  # sized to a 2-core node


def pods_of(cluster: Cluster, name: str, component: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(f"hivekeeper.dev/swarm={name},hivekeeper.dev/component={component}")
            if not p["metadata"].get("deletionTimestamp")]


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def patch(cluster: Cluster, kind: str, name: str, spec: dict[str, Any]) -> None:
    cluster.kubectl("patch", kind, name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": spec}))


@contextmanager
def host_directory() -> Iterator[Path]:
    """A directory the node mounts as a hostPath: the node's kubelet and containerd share this
    machine's filesystem (scripts/cluster.sh). Open to the pods' user (10001): Kubernetes applies
    no fsGroup to a hostPath volume."""
    path = Path(tempfile.mkdtemp(prefix="hk-e2e-", dir="/var/tmp"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def persistent_volume(cluster: Cluster, name: str, path: Path, access_mode: str) -> Iterator[str]:
    """A PersistentVolume on a host directory, of a storage class of its own (so only the claim
    meant for it binds it); its storage class name is yielded. Kept (Retain) when its claim goes."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [access_mode], "storageClassName": name,
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path), "type": "Directory"}}}))
    try:
        yield name
    finally:
        cluster.kubectl("delete", "persistentvolume", name, "--wait=false", check=False)


@contextmanager
def logs_on_failure(cluster: Cluster, name: str) -> Iterator[None]:
    """The pods' logs (and their previous containers') printed if a check fails."""
    try:
        yield
    except AssertionError:
        for pod in cluster.pods(f"hivekeeper.dev/swarm={name}"):
            for previous in (False, True):
                print(f"--- {pod['metadata']['name']}{' (previous)' if previous else ''}:\n"
                      f"{cluster.logs(pod['metadata']['name'], previous=previous)[-4000:]}")
        raise


@contextmanager
def node_label(cluster: Cluster, value: str) -> Iterator[None]:
    cluster.kubectl("label", "node", NODE, f"{POOL}={value}", "--overwrite")
    try:
        yield
    finally:
        cluster.kubectl("label", "node", NODE, f"{POOL}-", check=False)


@contextmanager
def cluster_object(cluster: Cluster, document: dict[str, Any]) -> Iterator[None]:
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(document))
    try:
        yield
    finally:
        cluster.kubectl("delete", document["kind"].lower(), document["metadata"]["name"], "-n", NAMESPACE,
                        "--wait=false", check=False)


def test_a_groups_placement_reaches_its_pods_and_a_selector_no_node_matches_leaves_them_pending(
        cluster: Cluster, release: str):
    name = "placed"
    lab = {
        "nodeSelector": {POOL: "a"},
        "tolerations": [{"key": "lab.example/dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "hk-e2e-research",
        "labels": {"kueue.x-k8s.io/queue-name": "lab-queue"},
        "env": [{"name": "LAB_DATASET", "value": "/data/digits"}],
        "volumes": [{"name": "data", "configMap": {"name": "lab-data"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
    }
    manifest = example("swarm-digits.yaml", {"metadata": {"name": name}, "spec": {
        "trainers": {"replicas": 1, "resources": SMALL, "placement": lab},
        "auxiliary": {"replicas": 0}, "balancer": {"enabled": False}, "monitor": {"enabled": False},
        "stopping": {"targetMetric": None, "targetSteps": 100000},
        "placement": {"annotations": {"lab.example/team": "vision"}},
    }})
    priority = {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "hk-e2e-research"},
                "value": 1000, "description": "hivekeeper e2e: a lab's research priority"}
    data = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "lab-data"}, "data": {"README": "digits"}}
    with cluster_object(cluster, priority), cluster_object(cluster, data), node_label(cluster, "a"), \
            applied(cluster, manifest), logs_on_failure(cluster, name):
        # The trainer's pod carries the group's placement and runs on the labelled node.
        trainer = wait_for(lambda: [p for p in pods_of(cluster, name, "trainer")
                                    if (p.get("status") or {}).get("phase") == "Running"], 300,
                           "the trainer's pod running")[0]
        spec, meta = trainer["spec"], trainer["metadata"]
        assert spec["nodeName"] == NODE and spec["nodeSelector"] == {POOL: "a"}
        assert lab["tolerations"][0] in spec["tolerations"]
        assert (spec["priorityClassName"], spec["priority"]) == ("hk-e2e-research", 1000)  # admission resolved it
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "lab-queue"
        assert meta["annotations"]["lab.example/team"] == "vision"  # the spec-wide placement
        container = spec["containers"][0]
        assert {"name": "LAB_DATASET", "value": "/data/digits"} in container["env"]
        assert any(m["name"] == "data" and m["mountPath"] == "/data" for m in container["volumeMounts"])
        statefulset = cluster.get("statefulset", f"{name}-trainer")
        assert statefulset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "lab-queue"
        # The backbone has the spec-wide placement only.
        backbone = wait_for(lambda: pods_of(cluster, name, "backbone"), 120, "the backbone's pod")[0]
        assert backbone["metadata"]["annotations"]["lab.example/team"] == "vision"
        assert "nodeSelector" not in backbone["spec"] and "kueue.x-k8s.io/queue-name" not in backbone["metadata"]["labels"]

        # Break: a pool no node is in. The trainer's new pod cannot be scheduled...
        old = trainer["metadata"]["uid"]
        patch(cluster, "swarm", name, {"trainers": {"placement": {"nodeSelector": {POOL: "b"}}}})
        pending = wait_for(lambda: [p for p in pods_of(cluster, name, "trainer") if p["metadata"]["uid"] != old
                                    and condition(p, "PodScheduled").get("reason") == "Unschedulable"], 180,
                           "the trainer's new pod unschedulable")[0]
        assert pending["status"]["phase"] == "Pending" and pending["spec"]["nodeSelector"] == {POOL: "b"}
        # ...until a node joins the pool.
        # (That pod, or its replacement: a kubelet whose view of the node lags the new label can
        # refuse the pod bound to it, and the StatefulSet then makes another, seen in CI.)
        with node_label(cluster, "b"):
            wait_for(lambda: any(condition(p, "PodScheduled").get("status") == "True"
                                 for p in pods_of(cluster, name, "trainer")
                                 if p["metadata"]["uid"] != old and p["spec"].get("nodeSelector") == {POOL: "b"}),
                     120, "the pending trainer scheduled once the node is in the pool")

        # A placement naming a volume of the pods' own: the Swarm turns Invalid, saying which.
        patch(cluster, "swarm", name, {"trainers": {"placement": {"volumes": [{"name": "config", "emptyDir": {}}],
                                                                  "volumeMounts": []}}})
        status = wait_for(lambda: (s := cluster.status("swarm", name)).get("phase") == "Invalid" and s, 60,
                          "the Swarm Invalid")
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert "volume 'config' is one of hivekeeper's own" in ready["message"], ready


def checkpoint_steps(directory: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in directory.glob("step-*.pt"))


def test_the_monitors_checkpoints_and_final_model_outlive_its_pods_on_a_claim(cluster: Cluster, release: str):
    """A monitor deleted mid-run comes back in a new pod on the same claim and goes on from the
    last checkpoint there (a fresh one would start from nothing); the final model is on the
    volume after the Swarm is gone."""
    torch = pytest.importorskip("torch")
    name = "kept"
    with host_directory() as directory, persistent_volume(cluster, "hk-e2e-checkpoints", directory,
                                                          "ReadWriteOnce") as storage_class:
        # A lone trainer no longer waits out matchmaking each step: with 2048 samples a step it
        # reached step 42 before the restarted monitor was up. 4096 and 60 steps leave the new
        # monitor minutes to take its first checkpoint.
        every, target = 4, 60
        manifest = example("swarm-digits.yaml", {"metadata": {"name": name}, "spec": {
            "targetBatchSize": 4096,
            "trainers": {"replicas": 1, "resources": SMALL},
            "auxiliary": {"replicas": 0}, "balancer": {"enabled": False},
            "monitor": {"evalEverySteps": 2, "checkpointEverySteps": every, "keepCheckpoints": 100,
                        "volumeClaim": {"size": "100Mi", "storageClassName": storage_class}},
            "stopping": {"targetMetric": None, "targetSteps": target},
        }})
        with applied(cluster, manifest), logs_on_failure(cluster, name):
            claim = wait_for(lambda: (c := cluster.get("persistentvolumeclaim", f"{name}-checkpoints"))
                             ["status"].get("phase") == "Bound" and c, 120, "the monitor's claim bound")
            assert claim["spec"]["volumeName"] == "hk-e2e-checkpoints"
            wait_for(lambda: checkpoint_steps(directory), 420, "a first checkpoint on the volume", interval=2)

            [monitor] = pods_of(cluster, name, "monitor")
            cluster.kubectl("delete", "pod", monitor["metadata"]["name"], "-n", NAMESPACE, "--wait=true", timeout=180)
            kept = checkpoint_steps(directory)
            restarted = wait_for(lambda: [p for p in pods_of(cluster, name, "monitor")
                                          if p["metadata"]["uid"] != monitor["metadata"]["uid"]], 120,
                                 "the monitor's Job to start a new pod")[0]
            up = wait_for(lambda: logged_entry(cluster.logs(restarted["metadata"]["name"]), "monitor up"), 240,
                          "the new monitor up", interval=2)
            assert up["last_checkpoint_step"] >= kept[-1], (up, kept)  # a fresh directory would give 0
            final = wait_for(lambda: (s := cluster.status("swarm", name)).get("phase") == "Succeeded" and s, 600,
                             "the Swarm to succeed", interval=3)
            # The new monitor went on numbering: its first checkpoint came checkpointEverySteps
            # after the last one it found, not at once under whatever step the swarm had reached.
            later = [s for s in checkpoint_steps(directory) if s > up["last_checkpoint_step"]]
            print("checkpoint steps before the restart:", kept, "found by the new monitor:",
                  up["last_checkpoint_step"], "after:", later)
            assert later and later[0] >= up["last_checkpoint_step"] + every, (up, later)
        # The Swarm and its claim are gone; the final model stays on the volume.
        saved = torch.load(directory / "final.pt", map_location="cpu", weights_only=True)
        assert saved["format"] == "hivekeeper-checkpoint/1" and saved["step"] == final["globalStep"], (saved["step"], final)


def test_a_blockserver_serves_a_hugging_face_folder_from_a_claim(cluster: Cluster, release: str):
    transformers = pytest.importorskip("transformers")
    from hivekeeper.blocks.checkpoint import tiny_config
    from hivekeeper.spec.blockserver import TinyModelSpec

    name = "from-claim"
    with host_directory() as directory, persistent_volume(cluster, "hk-e2e-weights", directory,
                                                          "ReadOnlyMany") as storage_class:
        torch = pytest.importorskip("torch")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(tiny_config(TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4)))
        model.save_pretrained(directory / "llama")  # config.json and model.safetensors: real weights
        for path in (directory / "llama").iterdir():
            path.chmod(0o644)  # safetensors writes its file for its owner alone; the pods run as 10001
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "weights"},
                 "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": storage_class,
                          "resources": {"requests": {"storage": "100Mi"}}}}
        manifest = example("blockserver.yaml", {"metadata": {"name": name}, "spec": {
            "servers": {"replicas": 1, "resources": SMALL}, "balancer": {"enabled": False},
            "client": {"resources": SMALL, "newTokens": 8}}})
        manifest["spec"]["model"] = {"checkpoint": "/models/llama", "volume": {"existingClaim": "weights"}}
        with cluster_object(cluster, claim), applied(cluster, manifest), logs_on_failure(cluster, name):
            server = wait_for(lambda: pods_of(cluster, name, "block-server"), 120, "the block server's pod")[0]
            assert {"name": "model", "mountPath": "/models", "readOnly": True} in \
                server["spec"]["containers"][0]["volumeMounts"]

            def generated() -> dict[str, Any] | None:
                for pod in pods_of(cluster, name, "block-client"):
                    entry = logged_entry(cluster.logs(pod["metadata"]["name"]), "generated")
                    if entry:
                        return entry
                return None

            result = wait_for(generated, 420, "the client's generated tokens", interval=3)
            assert result["metrics"]["matchesLocal"] is True, result  # the servers ran the folder's weights
            assert len(result["tokens"]) == 8
