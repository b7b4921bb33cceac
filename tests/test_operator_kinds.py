"""BlockServer and ExpertPool through the real operator against the emulator: the children
their roles need (keys, config, a StatefulSet per component, an Indexed Job for the roles that
end the run, headless Services, a PodDisruptionBudget for the backbone), owner references,
status from the workloads and the backbone's /status, scaling, completion and deletion."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator,operator-test]')")
pytest.importorskip("kmock", reason="the operator-test extra is not installed (pip install -e '.[operator-test]')")

from hivekeeper_operator import readers  # noqa: E402
from hivekeeper_operator.kube import Kube  # noqa: E402
from test_operator import (  # noqa: E402,F401  (fixtures)
    JOBS,
    NS,
    STS,
    client,
    cluster,
    example,
    monitor,
    start_operator,
    wait_for,
)

KINDS = {  # kind -> (plural, example, name, {component: replicas}, job components, scaled component)
    "BlockServer": ("blockservers", "blockserver.yaml", "tiny-llama",
                    {"backbone-blocks": 1, "block-server": 3, "block-balancer": 1}, {"block-client": 1},
                    "block-server"),
    "ExpertPool": ("expertpools", "expertpool.yaml", "digits-moe",
                   {"backbone-experts": 1, "expert-server": 2}, {"expert-trainer": 1}, "expert-server"),
}
PVCS = "v1/persistentvolumeclaims"


def backbone_reading(kind: str) -> dict[str, Any]:
    """What the kind's backbone serves on /status, made by the role's own code (6 blocks all held;
    2 servers with 8 experts each and 2 trainers), plus fields the status model does not have."""
    from hivekeeper.blocks.backbone import coverage_figures
    from hivekeeper.experts.backbone import pool_figures

    if kind == "BlockServer":
        reading = {**coverage_figures(6, 6, 12.5), "spans": {"block-server-0": "0-5"}}
    else:
        reading = pool_figures(
            [{"role": "backbone-experts"}]
            + [{"role": "expert-server", "experts": [f"expert.{i}.{j}" for j in range(8)]} for i in range(2)]
            + [{"role": "expert-trainer", "step": step, "samplesPerSecond": 150.0} for step in (40, 38)])
    return {**reading, "unknownFigure": 1, "phase": "Hacked"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_live_printer_column_is_filled_from_the_backbones_status(kind):
    """Each printer column the backbone's /status feeds gets a value: a figure of the wrong type
    (servedBlocks as a count, not "held/all") would be dropped by the operator without a word."""
    from hivekeeper.spec.crd import KINDS as KIND_INFO
    from hivekeeper_operator.status import LIVE_FIGURES_EXCLUDED, model_figures

    reading = backbone_reading(kind)
    figures = model_figures(kind, reading, {}, "")
    live = [c.json_path.removeprefix(".status.") for c in KIND_INFO[kind].printer_columns
            if c.json_path.startswith(".status.") and "." not in c.json_path.removeprefix(".status.")
            and c.json_path.removeprefix(".status.") not in LIVE_FIGURES_EXCLUDED]
    assert live and {key: figures.get(key) for key in live} == {key: reading[key] for key in live}
    assert "unknownFigure" not in figures and "phase" not in figures
CHILD_RESOURCES = ["v1/secrets", "v1/configmaps", "v1/services", STS, JOBS, "policy/v1/poddisruptionbudgets"]


def custom(client):
    import kubernetes

    return kubernetes.client.CustomObjectsApi(client)


def scale_servers(client, plural: str, name: str, replicas: int) -> dict[str, Any]:
    """What `kubectl scale` (or an HPA) does: patch the resource's scale subresource."""
    scale = custom(client).patch_namespaced_custom_object_scale(
        "hivekeeper.dev", "v1alpha1", NS, plural, name, {"spec": {"replicas": replicas}},
        _content_type="application/merge-patch+json")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == replicas
    return scale


def children(cluster, name: str) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for resource in CHILD_RESOURCES:
        for obj in cluster.objects(resource, NS):
            if obj["metadata"].get("labels", {}).get("hivekeeper.dev/swarm") == name:
                out[(obj["kind"], obj["metadata"]["name"])] = obj
    return out


def expected(name: str, stateful: dict[str, int], jobs: dict[str, int]) -> set[tuple[str, str]]:
    out = {("Secret", f"{name}-backbone-keys"), ("ConfigMap", f"{name}-config")}
    for component in [*stateful, *jobs]:
        out.add(("Service", f"{name}-{component}"))
    out |= {("StatefulSet", f"{name}-{c}") for c in stateful} | {("Job", f"{name}-{c}") for c in jobs}
    out |= {("PodDisruptionBudget", f"{name}-{c}") for c in stateful if c.startswith("backbone")}
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_kind_reconciles_scales_completes_and_deletes(cluster, client, start_operator, monitor, kind):
    plural, example_file, name, stateful, jobs, scaled = KINDS[kind]
    start_operator()
    custom(client).create_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, plural, example(example_file))
    made = wait_for(lambda: (m := children(cluster, name)) and set(m) == expected(name, stateful, jobs) and m,
                    what=f"every child of the {kind}")
    uid = cluster.object(f"hivekeeper.dev/v1alpha1/{plural}", NS, name)["metadata"]["uid"]
    for key, obj in made.items():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid, key
    for component, replicas in stateful.items():
        assert made[("StatefulSet", f"{name}-{component}")]["spec"]["replicas"] == replicas
    for component, count in jobs.items():
        job = made[("Job", f"{name}-{component}")]["spec"]
        assert (job["completionMode"], job["completions"], job["suspend"]) == ("Indexed", count, False)
    # The pods' roles: every role's `hivekeeper run` arguments, its backbone dialled by DNS.
    roles = json.loads(made[("ConfigMap", f"{name}-config")]["data"]["roles.json"])
    backbone = next(c for c in stateful if c.startswith("backbone"))
    assert set(roles) == {f"{c}-{i}" for c, n in {**stateful, **jobs}.items() for i in range(n)}
    server_args = roles[f"{scaled}-0"]["args"]
    peers = server_args[server_args.index("--initial-peers") + 1]
    assert peers.startswith(f"/dns4/{name}-{backbone}-0.{name}-{backbone}.{NS}.svc.cluster.local/tcp/")
    keys = made[("Secret", f"{name}-backbone-keys")]["data"]
    assert set(keys) == {f"{backbone}-0.key"}
    service = made[("Service", f"{name}-{backbone}")]["spec"]
    assert service["publishNotReadyAddresses"] is True

    # Pods become ready; the backbone's /status feeds the live figures the status model has.
    monitor.reading = backbone_reading(kind)
    for component, replicas in stateful.items():
        sts = cluster.object(STS, NS, f"{name}-{component}")
        cluster.set_status(STS, NS, f"{name}-{component}", {
            "observedGeneration": sts["metadata"]["generation"], "replicas": replicas, "readyReplicas": replicas,
            "updatedReplicas": replicas})
    for component, count in jobs.items():
        cluster.set_status(JOBS, NS, f"{name}-{component}", {"active": count, "ready": count})
    resource = wait_for(lambda: (r := cluster.object(f"hivekeeper.dev/v1alpha1/{plural}", NS, name))
                        and (r.get("status") or {}).get("phase") == "Running"
                        and r["status"]["conditions"][0]["status"] == "True" and r, what="Running and Ready")
    status = resource["status"]
    assert status["servers"]["ready"] == stateful[scaled]
    assert status["selector"] == f"hivekeeper.dev/swarm={name},hivekeeper.dev/component={scaled}"
    assert status["readyPeers"] == f"{sum(stateful.values()) + sum(jobs.values())}/" \
                                   f"{sum(stateful.values()) + sum(jobs.values())}"
    assert "unknownFigure" not in status and status["phase"] == "Running"
    if kind == "BlockServer":
        assert (status["servedBlocks"], status["numBlocks"], status["minBlockThroughput"]) == ("6/6", 6, 12.5)
    else:
        assert (status["expertsAlive"], status["step"], status["samplesPerSecond"]) == (16, 40, 300.0)

    # kubectl scale, through the scale subresource: the servers' StatefulSet follows. Nothing else
    # rolls, and the servers only when their roles depend on the count (an expert server's share
    # of the grid).
    scale = custom(client).get_namespaced_custom_object_scale("hivekeeper.dev", "v1alpha1", NS, plural, name)
    assert (scale["spec"], scale["status"]) == ({"replicas": stateful[scaled]},
                                                {"replicas": stateful[scaled], "selector": status["selector"]})
    before = {c: cluster.object(STS, NS, f"{name}-{c}")["spec"]["template"] for c in stateful}
    scale_servers(client, plural, name, 4)
    assert cluster.object(f"hivekeeper.dev/v1alpha1/{plural}", NS, name)["spec"]["servers"]["replicas"] == 4
    wait_for(lambda: cluster.object(STS, NS, f"{name}-{scaled}")["spec"]["replicas"] == 4, what="scaled servers")
    after = {c: cluster.object(STS, NS, f"{name}-{c}")["spec"]["template"] for c in stateful}
    rolled = {c for c in stateful if after[c] != before[c]}
    assert rolled == ({scaled} if kind == "ExpertPool" else set()), rolled

    # The roles that end the run succeed: the run is over, its peers stop.
    job_uids = {c: cluster.object(JOBS, NS, f"{name}-{c}")["metadata"]["uid"] for c in jobs}
    final = {"globalStep": 1234, "reason": "target accuracy reached", "metrics": {"accuracy": 0.93}}
    for component in jobs:  # what the Job controller and the kubelet make of the role's pod
        job = cluster.object(JOBS, NS, f"{name}-{component}")
        Kube(client).create({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{component}-0-x7k2p", "namespace": NS,
                         "labels": job["spec"]["template"]["metadata"]["labels"],
                         "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
                                              "uid": job["metadata"]["uid"], "controller": True}]},
            "spec": job["spec"]["template"]["spec"],
            "status": {"phase": "Succeeded", "containerStatuses": [{"name": component, "state": {"terminated": {
                "exitCode": 0, "reason": "Completed", "finishedAt": "2026-01-01T00:10:00Z",
                "message": readers.final_report_message(final)}}}]}})
    for component, count in jobs.items():
        cluster.set_status(JOBS, NS, f"{name}-{component}", {
            "succeeded": count, "completedIndexes": f"0-{count - 1}" if count > 1 else "0",
            "conditions": [{"type": "Complete", "status": "True"}]})
    wait_for(lambda: (cluster.object(f"hivekeeper.dev/v1alpha1/{plural}", NS, name).get("status") or {})
             .get("phase") == "Succeeded", what="Succeeded")
    assert all(cluster.object(STS, NS, f"{name}-{c}")["spec"]["replicas"] == 0 for c in stateful)
    # Its Jobs are suspended in place, never replaced: a new Job would run the roles again (on a
    # real cluster the operator looped: replaced, re-ran, completed, replaced...).
    wait_for(lambda: all(cluster.object(JOBS, NS, f"{name}-{c}")["spec"].get("suspend") for c in jobs),
             what="the Jobs suspended")
    time.sleep(1.0)  # several resyncs
    assert {c: cluster.object(JOBS, NS, f"{name}-{c}")["metadata"]["uid"] for c in jobs} == job_uids
    status = cluster.object(f"hivekeeper.dev/v1alpha1/{plural}", NS, name)["status"]
    assert status["phase"] == "Succeeded"
    if kind == "ExpertPool":  # the trainer's last figures, not the backbone's last reading (step 40)
        assert (status["step"], status["evalMetrics"]) == (1234, {"accuracy": 0.93})

    custom(client).delete_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, plural, name)
    wait_for(lambda: not children(cluster, name), what="the children to go with their owner")


def test_an_invalid_blockserver_gets_a_condition_and_no_children(cluster, client, start_operator):
    start_operator()
    document = example("blockserver.yaml", {"spec": {"servers": {"replicas": -1}}})
    custom(client).create_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, "blockservers", document)
    resource = wait_for(lambda: (r := cluster.object("hivekeeper.dev/v1alpha1/blockservers", NS, "tiny-llama"))
                        and (r.get("status") or {}).get("phase") == "Invalid" and r, what="Invalid")
    ready = next(c for c in resource["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "servers.replicas" in ready["message"]
    assert not children(cluster, "tiny-llama")


def checkpoint_volume(cluster, name: str = "digits-moe") -> tuple[str, str] | None:
    """(claim, mount path) of the checkpoint volume in the expert servers' pod template."""
    sts = cluster.object(STS, NS, f"{name}-expert-server")
    if sts is None:
        return None
    pod = sts["spec"]["template"]["spec"]
    claim = next((v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == "checkpoints"), None)
    mount = next((m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "checkpoints"), None)
    return (claim, mount) if claim else None


def owned_claim(cluster, client, plural: str, document: dict[str, Any], claim_name: str) -> dict[str, Any]:
    """Create the resource, wait for the checkpoint claim the operator makes for it; check its owner."""
    custom(client).create_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, plural, document)
    claim = wait_for(lambda: cluster.object(PVCS, NS, claim_name), what=f"the claim {claim_name}")
    owner = cluster.object(f"hivekeeper.dev/v1alpha1/{plural}", NS, document["metadata"]["name"])
    assert claim["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    return claim


def test_expert_checkpoints_claim_outlives_scaling_and_edits_and_goes_with_the_pool(cluster, client, start_operator):
    start_operator()
    document = example("expertpool.yaml", {"spec": {"checkpoint": {"volumeClaim": {"size": "2Gi"}}}})
    claim = owned_claim(cluster, client, "expertpools", document, "digits-moe-checkpoints")
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "2Gi"}}}
    shared = ("digits-moe-checkpoints", "/var/lib/hivekeeper/experts")
    assert wait_for(lambda: checkpoint_volume(cluster), what="the servers' checkpoint volume") == shared

    # A rebalance (servers restart with new shares of the grid) keeps the one claim, untouched:
    # a server taking over an expert finds its file there.
    template = cluster.object(STS, NS, "digits-moe-expert-server")["spec"]["template"]
    scale_servers(client, "expertpools", "digits-moe", 3)
    scaled = wait_for(lambda: (s := cluster.object(STS, NS, "digits-moe-expert-server"))["spec"]["replicas"] == 3 and s,
                      what="3 servers")
    assert scaled["spec"]["template"] != template and checkpoint_volume(cluster) == shared
    # Its size applies when it is made (a bound claim is not rewritten; resize it yourself).
    custom(client).patch_namespaced_custom_object(
        "hivekeeper.dev", "v1alpha1", NS, "expertpools", "digits-moe",
        {"spec": {"checkpoint": {"volumeClaim": {"size": "5Gi"}}}}, _content_type="application/merge-patch+json")
    wait_for(lambda: (cluster.object("hivekeeper.dev/v1alpha1/expertpools", NS, "digits-moe").get("status") or {})
             .get("observedGeneration") == 3, what="the edit reconciled")
    [kept] = cluster.objects(PVCS, NS)
    assert (kept["metadata"]["uid"], kept["metadata"]["resourceVersion"]) == (
        claim["metadata"]["uid"], claim["metadata"]["resourceVersion"])

    custom(client).delete_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, "expertpools", "digits-moe")
    wait_for(lambda: cluster.object(PVCS, NS, "digits-moe-checkpoints") is None and not children(cluster, "digits-moe"),
             what="the claim to go with the pool")


def test_an_existing_checkpoint_claim_is_mounted_and_never_deleted(cluster, client, start_operator):
    import kubernetes

    core = kubernetes.client.CoreV1Api(client)
    core.create_namespaced_persistent_volume_claim(NS, {
        "metadata": {"name": "lab-nfs"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}}})
    start_operator()
    document = example("expertpool.yaml", {"spec": {"checkpoint": {"existingClaim": "lab-nfs", "dir": "/checkpoints"}}})
    custom(client).create_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, "expertpools", document)
    assert wait_for(lambda: checkpoint_volume(cluster), what="the servers' checkpoint volume") == (
        "lab-nfs", "/checkpoints")
    assert [c["metadata"]["name"] for c in cluster.objects(PVCS, NS)] == ["lab-nfs"]
    custom(client).delete_namespaced_custom_object("hivekeeper.dev", "v1alpha1", NS, "expertpools", "digits-moe")
    wait_for(lambda: not children(cluster, "digits-moe"), what="the pool's children to go")
    assert cluster.object(PVCS, NS, "lab-nfs") is not None


def test_a_monitor_claim_is_made_for_the_swarm_and_a_placement_naming_a_pod_volume_is_invalid(
        cluster, client, start_operator):
    start_operator()
    document = example("swarm-digits.yaml", {"spec": {"monitor": {"volumeClaim": {"size": "1Gi"}}}})
    owned_claim(cluster, client, "swarms", document, "digits-checkpoints")
    job = wait_for(lambda: cluster.object(JOBS, NS, "digits-monitor"), what="the monitor's Job")
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "digits-checkpoints"}} in \
        job["spec"]["template"]["spec"]["volumes"]

    custom(client).patch_namespaced_custom_object(
        "hivekeeper.dev", "v1alpha1", NS, "swarms", "digits",
        {"spec": {"trainers": {"placement": {"volumes": [{"name": "config", "emptyDir": {}}]}}}},
        _content_type="application/merge-patch+json")
    status = wait_for(lambda: (s := cluster.object("hivekeeper.dev/v1alpha1/swarms", NS, "digits").get("status") or {})
                      .get("phase") == "Invalid" and s, what="Invalid")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "volume 'config' is one of hivekeeper's own" in ready["message"]
    # The trainers' StatefulSet stays as it was planned last (Kubernetes would refuse two volumes 'config').
    trainers = cluster.object(STS, NS, "digits-trainer")["spec"]["template"]["spec"]
    assert {"name": "config", "emptyDir": {}} not in trainers["volumes"]
