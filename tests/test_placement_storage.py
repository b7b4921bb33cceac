"""Placement and storage in the operator's plan: a role group's placement (merged over the
spec-wide one) on its pods and workload, names the pods' own parts use refused, the GPU resource
name, a Swarm monitor's checkpoints and a BlockServer's weights on volumes, and a restarted
monitor going on numbering from the checkpoints its directory kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")

from conftest import EXAMPLES  # noqa: E402
from hivekeeper.cli import build_parser  # noqa: E402
from hivekeeper.errors import UserError  # noqa: E402
from hivekeeper.spec import parse_manifest  # noqa: E402
from hivekeeper_operator import launch  # noqa: E402
from hivekeeper_operator.pods import CONFIG_HASH, PlacementConflict  # noqa: E402
from test_operator_plan import plan_role_planned  # noqa: E402

LAB = {  # what a lab asks of its trainers' pods
    "nodeSelector": {"lab.example/pool": "a100"},
    "tolerations": [{"key": "lab.example/dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                          "labelSelector": {"matchLabels": {"hivekeeper.dev/component": "trainer"}}}}]}},
    "priorityClassName": "research-high",
    "schedulerName": "default-scheduler",
    "labels": {"kueue.x-k8s.io/queue-name": "lab-queue"},
    "env": [{"name": "HF_HOME", "value": "/data/hf"},
            {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "key"}}}],
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
}
EVERY_POD = {"annotations": {"lab.example/cost-centre": "vision"},
             "tolerations": [{"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
             "env": [{"name": "HF_HOME", "value": "/scratch/hf"}, {"name": "TZ", "value": "UTC"}]}


def document(path: str, spec: dict[str, Any]) -> dict[str, Any]:
    out = yaml.safe_load((EXAMPLES / path).read_text())
    for key, value in spec.items():
        out["spec"][key] = {**out["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    return out


def blockserver(model: dict[str, Any]) -> dict[str, Any]:
    """The BlockServer example serving a checkpoint instead of its tiny model."""
    out = document("blockserver.yaml", {})
    out["spec"]["model"] = model
    return out


def workloads(plan) -> dict[str, dict[str, Any]]:
    return {c["metadata"]["labels"]["hivekeeper.dev/component"]: c for c in plan.children
            if c["kind"] in ("StatefulSet", "Job")}


def pod(workload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(pod metadata, pod spec, container) of a workload's template."""
    template = workload["spec"]["template"]
    return template["metadata"], template["spec"], template["spec"]["containers"][0]


def test_a_groups_placement_reaches_its_pods_merged_over_the_spec_wide_one():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    plain = plan_role_planned(parse_manifest(document("swarm-digits.yaml", {})))
    placed = plan_role_planned(parse_manifest(document("swarm-digits.yaml", {"placement": EVERY_POD,
                                                                            "trainers": {"placement": LAB}})))
    for child in placed.children:
        if child["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(child, "1.33.0", strict=True)
    meta, spec, container = pod(workloads(placed)["trainer"])
    assert spec["nodeSelector"] == LAB["nodeSelector"]
    assert spec["tolerations"] == EVERY_POD["tolerations"] + LAB["tolerations"]
    assert (spec["affinity"], spec["priorityClassName"], spec["schedulerName"]) == (
        LAB["affinity"], "research-high", "default-scheduler")
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "lab-queue"
    assert meta["labels"]["hivekeeper.dev/component"] == "trainer"  # the operator's own stay
    assert meta["annotations"]["lab.example/cost-centre"] == "vision" and CONFIG_HASH in meta["annotations"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_HOME"] == {"name": "HF_HOME", "value": "/data/hf"}  # the group's wins over the spec-wide
    assert env["TZ"]["value"] == "UTC" and env["WANDB_API_KEY"]["valueFrom"] == LAB["env"][1]["valueFrom"]
    assert "POD_IP" in env
    assert LAB["volumes"][0] in spec["volumes"] and LAB["volumeMounts"][0] in container["volumeMounts"]
    # The workload carries the labels too (Kueue reads a Job's or StatefulSet's queue label).
    assert workloads(placed)["trainer"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "lab-queue"

    # Other groups get the spec-wide placement only.
    meta, spec, container = pod(workloads(placed)["backbone"])
    assert "nodeSelector" not in spec and spec["tolerations"] == EVERY_POD["tolerations"]
    assert "kueue.x-k8s.io/queue-name" not in meta["labels"] and meta["annotations"]["lab.example/cost-centre"]
    assert {e["name"]: e.get("value") for e in container["env"]}["HF_HOME"] == "/scratch/hf"
    # Placement is stated by the template itself: the config hash (what the role reads) stays.
    assert placed.hashes == plain.hashes
    assert pod(workloads(plain)["trainer"])[1].get("nodeSelector") is None


@pytest.mark.parametrize("placement, error", [
    ({"labels": {"hivekeeper.dev/swarm": "other"}}, "hivekeeper.dev/swarm: keys under hivekeeper.dev/"),
    ({"annotations": {"app.kubernetes.io/name": "x"}}, "are the operator's"),
    ({"labels": {"team": "a b"}}, "a label value"),
    ({"nodeSelector": {"-bad": "x"}}, "the name must be"),
    ({"tolerations": [{"value": "x"}]}, "without a key needs operator Exists"),
    ({"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 5}]}, "NoExecute only"),
    ({"volumes": [{"name": "data", "emptyDir": {}, "hostPath": {"path": "/x"}}]}, "exactly one volume source"),
    ({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}, "names no volume"),
    ({"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}, "not both"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "appears twice"),
], ids=lambda v: str(v)[:40])
def test_a_placement_kubernetes_would_refuse_or_the_operator_owns_is_invalid(placement, error):
    with pytest.raises(UserError, match="trainers.placement") as refused:
        parse_manifest(document("swarm-digits.yaml", {"trainers": {"placement": placement}}))
    assert error in str(refused.value)


def test_a_mount_may_name_a_volume_of_the_spec_wide_placement():
    manifest = parse_manifest(document("swarm-digits.yaml", {
        "placement": {"volumes": [{"name": "data", "emptyDir": {}}]},
        "trainers": {"placement": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}}}))
    _, spec, container = pod(workloads(plan_role_planned(manifest))["trainer"])
    assert {"name": "data", "emptyDir": {}} in spec["volumes"] and {"name": "data", "mountPath": "/data",
                                                                     "readOnly": False} in container["volumeMounts"]


@pytest.mark.parametrize("placement, error", [
    ({"volumes": [{"name": "config", "emptyDir": {}}]}, "volume 'config' is one of hivekeeper's own"),
    ({"volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "v", "mountPath": "/tmp"}]},
     "mountPath /tmp is hivekeeper's own tmp volume"),
    ({"volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "v", "mountPath": "/etc/hivekeeper/x"}]},
     "inside hivekeeper's own config volume"),
    ({"env": [{"name": "POD_IP", "value": "1.2.3.4"}]}, "env POD_IP is set by hivekeeper"),
    ({"env": [{"name": "JOB_COMPLETION_INDEX", "value": "0"}]}, "env JOB_COMPLETION_INDEX is set by hivekeeper"),
], ids=["volume", "mountPath", "inside-read-only", "env", "job-env"])
def test_a_placement_naming_the_pods_own_parts_is_refused_by_the_planner(placement, error):
    manifest = parse_manifest(document("swarm-digits.yaml", {"trainers": {"placement": placement}}))
    with pytest.raises(PlacementConflict, match="placement of the trainer pods") as refused:
        plan_role_planned(manifest)
    assert error in str(refused.value)


def test_the_monitors_checkpoint_volume_is_its_own_too():
    manifest = parse_manifest(document("swarm-digits.yaml", {"monitor": {
        "volumeClaim": {}, "placement": {"volumes": [{"name": "checkpoints", "emptyDir": {}}]}}}))
    with pytest.raises(PlacementConflict, match="volume 'checkpoints' is one of hivekeeper's own"):
        plan_role_planned(manifest)


def test_gpus_are_requested_under_the_device_plugins_resource_name():
    manifest = parse_manifest(document("swarm-digits.yaml", {"trainers": {
        "resources": {"gpu": 1, "gpuResource": "amd.com/gpu"}}}))
    _, _, container = pod(workloads(plan_role_planned(manifest))["trainer"])
    assert container["resources"]["limits"] == {"amd.com/gpu": 1}
    assert container["resources"]["requests"]["amd.com/gpu"] == 1
    with pytest.raises(UserError, match="gpuResource"):
        parse_manifest(document("swarm-digits.yaml", {"trainers": {"resources": {"gpuResource": "gpu"}}}))


def volume_mounts(workload: dict[str, Any], name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    _, spec, container = pod(workload)
    return [(v, m) for v in spec["volumes"] for m in container["volumeMounts"] if v["name"] == m["name"] == name]


def test_the_monitors_checkpoints_go_on_a_claim_it_saves_to():
    """monitor.volumeClaim: a claim owned by the Swarm, mounted by the monitor's Job pods (only)
    where the monitor, started from the arguments the operator renders, saves."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    manifest = parse_manifest(document("swarm-digits.yaml", {"monitor": {
        "volumeClaim": {"size": "2Gi", "storageClassName": "fast"}}}))
    plan = plan_role_planned(manifest)
    [claim] = [c for c in plan.children if c["kind"] == "PersistentVolumeClaim"]
    kubernetes_validate.validate(claim, "1.33.0", strict=True)
    assert claim["metadata"]["name"] == "digits-checkpoints"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"  # deleted with the Swarm
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                             "resources": {"requests": {"storage": "2Gi"}}}
    mounted = {component: volume_mounts(w, "checkpoints") for component, w in workloads(plan).items()}
    [(volume, mount)] = mounted.pop("monitor")
    assert volume == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "digits-checkpoints"}}
    assert all(m == [] for m in mounted.values())
    [config] = [c for c in plan.children if c["kind"] == "ConfigMap"]
    args = build_parser().parse_args(
        ["run", *launch.resolve(json.loads(config["data"]["roles.json"]), "monitor", 0, {"POD_IP": "10.1.2.3"})])
    assert manifest.spec.monitor.directory(args.run_dir) == mount["mountPath"] == "/var/lib/hivekeeper/checkpoints"

    theirs = plan_role_planned(parse_manifest(document("swarm-digits.yaml", {"monitor": {
        "existingClaim": "lab-nfs", "checkpointDir": "/checkpoints/digits"}})))
    assert not [c for c in theirs.children if c["kind"] == "PersistentVolumeClaim"]
    assert volume_mounts(workloads(theirs)["monitor"], "checkpoints") == [
        ({"name": "checkpoints", "persistentVolumeClaim": {"claimName": "lab-nfs"}},
         {"name": "checkpoints", "mountPath": "/checkpoints/digits"})]


@pytest.mark.parametrize("monitor, error", [
    ({"volumeClaim": {}, "existingClaim": "x"}, "not both"),
    ({"volumeClaim": {}, "checkpointDir": "ckpt"}, "must be an absolute path"),
    ({"volumeClaim": {"size": "lots"}}, "size"),
    ({"enabled": False, "existingClaim": "x"}, "needs enabled: true"),
])
def test_a_monitor_claim_the_operator_could_not_mount_is_invalid(monitor, error):
    with pytest.raises(UserError, match="monitor") as refused:
        parse_manifest(document("swarm-digits.yaml", {"monitor": monitor}))
    assert error in str(refused.value)


def test_a_blockservers_weights_come_from_a_volume_every_role_that_reads_the_model_mounts():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    claimed = parse_manifest(blockserver({"checkpoint": "/models/llama-7b", "volume": {"existingClaim": "weights"}}))
    plan = plan_role_planned(claimed)
    expected = [({"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
                 {"name": "model", "mountPath": "/models", "readOnly": True})]
    assert {c: volume_mounts(w, "model") for c, w in workloads(plan).items()} == {
        c: expected for c in ("backbone-blocks", "block-server", "block-balancer", "block-client")}
    assert not [c for c in plan.children if c["kind"] == "PersistentVolumeClaim"]  # the user's: never made
    for child in plan.children:
        if child["kind"] in ("StatefulSet", "Job"):
            kubernetes_validate.validate(child, "1.33.0", strict=True)

    nfs = {"server": "nfs.lab.example", "path": "/export/models"}
    shared = parse_manifest(blockserver({"checkpoint": "/weights/llama",
                                         "volume": {"mountPath": "/weights", "source": {"nfs": nfs}}}))
    assert volume_mounts(workloads(plan_role_planned(shared))["block-server"], "model") == [
        ({"name": "model", "nfs": nfs}, {"name": "model", "mountPath": "/weights", "readOnly": True})]


@pytest.mark.parametrize("model, error", [
    ({"checkpoint": "/elsewhere/llama", "volume": {"existingClaim": "weights"}}, "must be a folder under"),
    ({"volume": {"existingClaim": "weights"}}, "must be a folder under"),  # a tiny model is built, not read
    ({"checkpoint": "/models/x", "volume": {}}, "set existingClaim or source"),
    ({"checkpoint": "/models/x", "volume": {"source": {"nfs": {}, "hostPath": {}}}}, "one volume source"),
])
def test_a_model_volume_that_cannot_hold_the_checkpoint_is_invalid(model, error):
    with pytest.raises(UserError, match="model") as refused:
        parse_manifest(blockserver(model))
    assert error in str(refused.value)


def test_a_restarted_monitor_goes_on_numbering_from_the_checkpoints_it_kept(tmp_path: Path):
    """The monitor's directory outlives its pod on a claim: a new monitor takes the last step-N
    checkpoint there as its last, so it saves the next one checkpointEverySteps later (not at
    once, under whatever step the swarm has reached), and prunes the old ones as before."""
    from hivekeeper.runtime.context import RoleContext
    from hivekeeper.metrics import SwarmMetrics
    from hivekeeper.swarm.monitor import Monitor

    spec = document("swarm-digits.yaml", {"monitor": {"checkpointEverySteps": 20, "keepCheckpoints": 2,
                                                      "checkpointDir": str(tmp_path / "ckpt")}})
    manifest_path = tmp_path / "digits.yaml"
    manifest_path.write_text(yaml.safe_dump(spec))
    args = build_parser().parse_args(["run", "monitor", "--manifest", str(manifest_path), "--run-dir", str(tmp_path)])

    def monitor() -> Monitor:
        return Monitor(RoleContext("monitor", args, parse_manifest(spec), metrics=SwarmMetrics()))

    first = monitor()
    assert first.checkpoint_step == 0  # nothing kept yet
    for step in (20, 40):
        first.eval_step = step
        first.maybe_checkpoint()
    first.history.close()

    restarted = monitor()
    assert restarted.checkpoint_step == 40
    restarted.eval_step = 47  # the swarm moved on while no monitor ran
    restarted.maybe_checkpoint()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*.pt")) == ["step-20.pt", "step-40.pt"]
    restarted.eval_step = 60
    restarted.maybe_checkpoint()
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*.pt")) == ["step-40.pt", "step-60.pt"]
    restarted.history.close()
