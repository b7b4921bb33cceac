"""The operator as the chart installs it: it works with its ServiceAccount and RBAC, nothing more;
the API server refuses bad manifests at `kubectl apply`; the short names name only hivekeeper's
kinds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from e2e.support import NAMESPACE, OPERATOR_NAMESPACE, RELEASE, REPO, Cluster, example, operator_pod, pod_ready, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_operator_runs_as_its_service_account_and_writes_status(cluster: Cluster, release: str):
    pod = operator_pod(cluster)
    assert pod_ready(pod)
    assert pod["spec"]["serviceAccountName"] == RELEASE
    assert pod["spec"]["containers"][0]["image"] == cluster.image
    # A Swarm without trainers: the operator must read it and write its status and children,
    # which it can only do authenticated by its ServiceAccount's token.
    swarm = example("swarm-digits.yaml", {"metadata": {"name": "auth-probe"},
                                          "spec": {"trainers": {"replicas": 0}, "auxiliary": {"replicas": 0},
                                                   "balancer": {"enabled": False}}})
    cluster.apply(swarm)
    try:
        status = wait_for(lambda: cluster.status("swarm", "auth-probe").get("observedGeneration") == 1
                          and cluster.status("swarm", "auth-probe"), 90, "the operator to write the Swarm's status")
        assert status["phase"] in ("Pending", "Running"), status
        assert cluster.get("statefulset", "auth-probe-backbone")["metadata"]["ownerReferences"][0]["name"] == "auth-probe"
    finally:
        cluster.kubectl("delete", "swarm", "auth-probe", "-n", NAMESPACE, "--wait=true")
        # Its pods hold CPU requests the next tests need.
        wait_for(lambda: not cluster.pods("hivekeeper.dev/swarm=auth-probe"), 120, "the probe's pods to go")
    log = cluster.logs(operator_pod(cluster)["metadata"]["name"], OPERATOR_NAMESPACE)
    assert "system:anonymous" not in log
    assert "Forbidden" not in log and "forbidden" not in log, log[-2000:]


BAD_SPECS = {
    "an unknown field": ({"spec": {"trainers": {"replica": 2}}}, "replica"),
    "a wrong type": ({"spec": {"trainers": {"replicas": "three"}}}, "replicas"),
    "a value out of range": ({"spec": {"trainers": {"replicas": -1}}}, "replicas"),
    "a value not in the enum": ({"spec": {"averaging": {"compression": "gzip"}}}, "compression"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_the_api_server_refuses_a_bad_manifest_at_apply(cluster: Cluster, release: str, case: str, tmp_path):
    changes, field = BAD_SPECS[case]
    document = example("swarm-digits.yaml", {"metadata": {"name": "bad"}, **changes})
    applied = cluster.apply(document, check=False)
    assert applied.returncode != 0, f"kubectl apply accepted {case}"
    assert field in applied.stderr, applied.stderr
    assert cluster.kubectl("get", "swarm", "bad", "-n", NAMESPACE, check=False).returncode != 0
    # `hivekeeper validate` refuses it too, before anything reaches a cluster.
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    validate = subprocess.run([sys.executable, "-m", "hivekeeper", "validate", str(path)], capture_output=True, text=True)
    assert validate.returncode == 2, validate


def test_short_names_list_only_hivekeeper_kinds(cluster: Cluster, release: str):
    short_names = {}
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for short in crd["spec"]["names"].get("shortNames", []):
            short_names[short] = crd["spec"]["names"]["kind"]
    for short, kind in short_names.items():
        # kubectl resolves a short name two groups share to the built-in one (ep: Endpoints).
        explained = cluster.kubectl("explain", short).stdout
        assert f"KIND:       {kind}" in explained or f"KIND: {kind}" in explained, (short, explained[:200])
    listed = cluster.kubectl("get", ",".join(short_names), "-n", NAMESPACE, "-o", "name").stdout
    assert "endpoints" not in listed
