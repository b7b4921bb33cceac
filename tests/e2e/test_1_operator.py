"""The operator as the chart installs it: it works with its ServiceAccount and RBAC, nothing more;
the API server refuses bad manifests at `kubectl apply`, cross-field rules included, and stores
every default; the short names name only hivekeeper's kinds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from e2e.support import NAMESPACE, OPERATOR_NAMESPACE, RELEASE, REPO, Cluster, example, operator_pod, pod_ready, wait_for
from hivekeeper.spec.crd import stored

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
        # The API server stored the defaults the manifest leaves out.
        spec = cluster.get("swarm", "auth-probe")["spec"]
        assert spec["averaging"]["mode"] == "gradients" and spec["trainers"]["resources"]["cpu"] == "1", spec
    finally:
        cluster.kubectl("delete", "swarm", "auth-probe", "-n", NAMESPACE, "--wait=true")
        # Its pods hold CPU requests the next tests need.
        wait_for(lambda: not cluster.pods("hivekeeper.dev/swarm=auth-probe"), 120, "the probe's pods to go")
    log = cluster.logs(operator_pod(cluster)["metadata"]["name"], OPERATOR_NAMESPACE)
    assert "system:anonymous" not in log
    assert "Forbidden" not in log and "forbidden" not in log, log[-2000:]


SWARM, BLOCKSERVER, EXPERTPOOL = "swarm-digits.yaml", "blockserver.yaml", "expertpool.yaml"
BAD_SPECS = {  # case -> (example, changes to its spec, what the API server's error names)
    "Swarm: an unknown field": (SWARM, {"trainers": {"replica": 2}}, "replica"),
    "Swarm: a wrong type": (SWARM, {"trainers": {"replicas": "three"}}, "spec.trainers.replicas"),
    "Swarm: a value out of range": (SWARM, {"trainers": {"replicas": -1}}, "spec.trainers.replicas"),
    "Swarm: a value not in the enum": (SWARM, {"averaging": {"compression": "gzip"}}, "spec.averaging.compression"),
    "Swarm: cpu in words": (SWARM, {"trainers": {"resources": {"cpu": "lots"}}}, "spec.trainers.resources.cpu"),
    "Swarm: a batch larger than the global batch": (SWARM, {"trainers": {"batchSize": 512}}, "spec.trainers.batchSize"),
    "Swarm: a group larger than the averaging peers": (SWARM, {"averaging": {"targetGroupSize": 9}},
                                                       "spec.averaging.targetGroupSize"),
    "Swarm: auxiliary peers while merging weights": (SWARM, {"averaging": {"mode": "ties"}}, "spec.auxiliary.replicas"),
    "Swarm: a target metric without a monitor": (SWARM, {"monitor": {"enabled": False}}, "spec.stopping.targetMetric"),
    "Swarm: volunteers nobody may be": (SWARM, {"volunteers": {"enabled": True}}, "spec.volunteers.allowlist"),
    "BlockServer: memory in words": (BLOCKSERVER, {"servers": {"resources": {"memory": "lots"}}},
                                     "spec.servers.resources.memory"),
    "BlockServer: a fraction of a cpu as a number": (BLOCKSERVER, {"client": {"resources": {"cpu": 0.5}}},
                                                     "spec.client.resources.cpu"),
    "BlockServer: heads that do not divide the width": (BLOCKSERVER, {"model": {"tiny": {"hiddenSize": 66}}},
                                                        "spec.model.tiny.hiddenSize"),
    "BlockServer: a session longer than the cache": (BLOCKSERVER, {"servers": {"maxSessionTokens": 8192}},
                                                     "spec.servers.maxSessionTokens"),
    "BlockServer: a span longer than the model": (BLOCKSERVER, {"servers": {"spanLength": 7}}, "spec.servers.spanLength"),
    "ExpertPool: cpu in words": (EXPERTPOOL, {"servers": {"resources": {"cpu": "lots"}}}, "spec.servers.resources.cpu"),
    "ExpertPool: a claim size in words": (EXPERTPOOL, {"checkpoint": {"volumeClaim": {"size": "lots"}}},
                                          "spec.checkpoint.volumeClaim.size"),
    "ExpertPool: kMin above kBest": (EXPERTPOOL, {"trainers": {"dmoe": {"kMin": 5}}}, "spec.trainers.dmoe.kMin"),
    "ExpertPool: kBest above the grid": (EXPERTPOOL, {"grid": {"dimensions": [3]}}, "spec.trainers.dmoe.kBest"),
    "ExpertPool: two checkpoint claims": (EXPERTPOOL, {"checkpoint": {"volumeClaim": {}, "existingClaim": "lab-nfs"}},
                                          "spec.checkpoint.existingClaim"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPECS))
def test_the_api_server_refuses_a_bad_manifest_at_apply(cluster: Cluster, release: str, case: str, tmp_path):
    name, changes, field = BAD_SPECS[case]
    document = example(name, {"metadata": {"name": "bad"}, "spec": changes})
    applied = cluster.apply(document, check=False)
    assert applied.returncode != 0, f"kubectl apply accepted {case}"
    assert field in applied.stderr, applied.stderr
    assert cluster.kubectl("get", document["kind"].lower(), "bad", "-n", NAMESPACE, check=False).returncode != 0
    # `hivekeeper validate` refuses it too, before anything reaches a cluster.
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    validate = subprocess.run([sys.executable, "-m", "hivekeeper", "validate", str(path)], capture_output=True, text=True)
    assert validate.returncode == 2, validate


@pytest.mark.parametrize("name", [SWARM, "swarm-digits-ties.yaml", "swarm-lm-diloco.yaml", BLOCKSERVER, EXPERTPOOL])
def test_the_api_server_stores_what_the_models_fill_in(cluster: Cluster, release: str, name: str):
    """The object the API server would store holds every default, exactly as `stored` (which the
    unit tests check the models against) fills them in."""
    document = example(name, {"metadata": {"name": "defaults"}})
    dry_run = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-n", NAMESPACE, "-f", "-",
                              input=yaml.safe_dump(document))
    spec = json.loads(dry_run.stdout)["spec"]
    assert spec == stored(document["kind"], document)["spec"]
    assert spec != document["spec"]  # the examples leave most defaults out


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
