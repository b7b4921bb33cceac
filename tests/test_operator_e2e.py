"""End to end against a real cluster: runs only when $KUBECONFIG names one, and skips otherwise.

    kind create cluster --name hivekeeper
    docker build -t hivekeeper:e2e . && kind load docker-image hivekeeper:e2e --name hivekeeper
    KUBECONFIG=~/.kube/config HIVEKEEPER_E2E_IMAGE=hivekeeper:e2e .venv/bin/python -m pytest tests/test_operator_e2e.py

It installs (or updates) the CRDs, runs the operator in this process against one fresh
namespace, applies the Swarm example, and checks what the emulator cannot: the apiserver's
schema validation, the scale subresource, the garbage collector. With HIVEKEEPER_E2E_IMAGE
(an image the cluster can run) it also waits for the pods to become ready.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable

import pytest
import yaml

KUBECONFIG = os.environ.get("KUBECONFIG")
pytestmark = [
    pytest.mark.skipif(not KUBECONFIG, reason="no cluster: set KUBECONFIG to run the end-to-end tests"),
    pytest.mark.timeout(900),
]

from conftest import EXAMPLES, REPO, deep_update  # noqa: E402
from conftest import wait_for as poll_until  # noqa: E402

IMAGE = os.environ.get("HIVEKEEPER_E2E_IMAGE")


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    return poll_until(predicate, timeout, what, interval=1.0)


@pytest.fixture(scope="module")
def kube():
    pytest.importorskip("kopf")
    from hivekeeper_operator.kube import Kube, KubeError

    import kubernetes

    try:
        kube = Kube.from_environment(KUBECONFIG)
        kube.request("GET", "version")
    except (KubeError, OSError, kubernetes.config.ConfigException) as e:
        pytest.skip(f"$KUBECONFIG names no cluster that answers: {e}")
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        base = "apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        try:
            kube.request("POST", base, body=crd)
        except KubeError as e:
            if e.status != 409:
                raise
            kube.request("PATCH", f"{base}/{crd['metadata']['name']}", body=[
                {"op": "replace", "path": "/spec", "value": crd["spec"]}], content_type="application/json-patch+json")

        def established(name: str = crd["metadata"]["name"]) -> bool:
            conditions = (kube.request("GET", f"{base}/{name}").get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        wait_for(established, 60, f"CRD {crd['metadata']['name']} established")
    return kube


@pytest.fixture(scope="module")
def namespace(kube):
    name = f"hivekeeper-e2e-{uuid.uuid4().hex[:6]}"
    kube.request("POST", "api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.request("DELETE", f"api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def operator(kube, namespace):
    from hivekeeper_operator.reconcile import OperatorConfig
    from hivekeeper_operator.runtime import Operator
    from hivekeeper_operator.swarm import WorkloadSettings

    config = OperatorConfig(settings=WorkloadSettings(image=IMAGE or "hivekeeper:latest"), namespaces=(namespace,),
                            resync_seconds=2.0, metrics_port=None)
    running = Operator(config, kube=kube).start()
    assert running.resynced.wait(120)
    yield running
    running.stop()


def swarm_path(namespace: str, name: str = "", sub: str = "") -> str:
    path = f"apis/hivekeeper.dev/v1alpha1/namespaces/{namespace}/swarms"
    return "/".join(p for p in (path, name, sub) if p)


def test_the_apiserver_rejects_what_the_crd_schema_rejects(kube, namespace):
    from hivekeeper_operator.kube import KubeError

    document = deep_update(yaml.safe_load((EXAMPLES / "swarm-digits.yaml").read_text()),
                           {"metadata": {"name": "bad"}, "spec": {"averaging": {"compression": "gzip"}}})
    with pytest.raises(KubeError) as error:
        kube.request("POST", swarm_path(namespace), body=document)
    assert error.value.status == 422


def test_swarm_lifecycle_in_a_real_cluster(kube, namespace, operator):
    document = deep_update(yaml.safe_load((EXAMPLES / "swarm-digits.yaml").read_text()),
                           {"spec": {"trainers": {"replicas": 1, "resources": {"cpu": "250m", "memory": "1Gi"}},
                                     "auxiliary": {"replicas": 0}}})
    document["metadata"]["namespace"] = namespace
    created = kube.request("POST", swarm_path(namespace), body=document)
    uid = created["metadata"]["uid"]

    def sts(component: str) -> dict | None:
        return kube.get("apps/v1", "StatefulSet", namespace, f"digits-{component}")

    wait_for(lambda: all(sts(c) for c in ("backbone", "trainer", "auxiliary")), 120, "the StatefulSets")
    assert sts("trainer")["metadata"]["ownerReferences"][0]["uid"] == uid
    status = wait_for(lambda: kube.request("GET", swarm_path(namespace, "digits")).get("status"), 60, "a status")
    assert status["observedGeneration"] == 1

    # kubectl scale swarm/digits --replicas=2 goes through the scale subresource.
    kube.merge_patch(swarm_path(namespace, "digits", "scale"), {"spec": {"replicas": 2}})
    wait_for(lambda: sts("trainer")["spec"]["replicas"] == 2, 60, "two trainers")
    scale = kube.request("GET", swarm_path(namespace, "digits", "scale"))
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["selector"] == "hivekeeper.dev/swarm=digits,hivekeeper.dev/component=trainer"

    if IMAGE:
        ready = wait_for(lambda: (s := kube.request("GET", swarm_path(namespace, "digits")).get("status", {}))
                         .get("backbone", {}).get("ready") == 1 and s.get("trainers", {}).get("ready") == 2 and s,
                         600, "ready backbone and trainer pods")
        assert ready["phase"] in ("Running", "Succeeded")

    kube.request("DELETE", swarm_path(namespace, "digits"))
    wait_for(lambda: sts("trainer") is None and kube.get("v1", "ConfigMap", namespace, "digits-config") is None,
             180, "the garbage collector to remove the children")
