"""The operator imports neither torch, nor hivemind, nor scikit-learn, not even lazily at run
time: validating a spec checks task options with torch-free models, keys are made with
`cryptography`, volunteers' invites are signed without hivemind. Checked in a fresh interpreter
that imports the operator and reconciles one of each kind (volunteers, a checkpoint claim and a
bad manifest among them) against the emulator. Nor does `hivekeeper invite`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")
pytest.importorskip("kmock", reason="the operator-test extra is not installed (pip install -e '.[operator-test]')")

PROBE = r"""
import json, os, resource, sys
import yaml
from conftest import EXAMPLES, deep_update
from kube_emulator import EmulatedCluster
from hivekeeper.spec.crd import KINDS, crd
import hivekeeper_operator.__main__, hivekeeper_operator.runtime
from hivekeeper_operator.kube import Kube
from hivekeeper_operator.metrics import OperatorMetrics
from hivekeeper_operator.reconcile import API, OperatorConfig, controllers
import kubernetes

documents = [
    ("swarm-digits-volunteers.yaml", {}),
    ("blockserver.yaml", {}),
    ("expertpool.yaml", {"spec": {"checkpoint": {"volumeClaim": {"size": "2Gi"}}}}),
    ("swarm-digits.yaml", {"metadata": {"name": "bad"}, "spec": {"task": {"options": {"hiddenSize": 1}}}}),
]
phases = {}
with EmulatedCluster(sys.argv[1], crds=[crd(kind) for kind in sorted(KINDS)]) as cluster:
    api_client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
    kube = Kube(api_client)
    reconcilers = controllers(kube, OperatorConfig(metrics_port=None, status_reader=lambda *a: None), OperatorMetrics())
    for path, changes in documents:
        document = deep_update(yaml.safe_load((EXAMPLES / path).read_text()), changes)
        document["metadata"]["namespace"] = "default"
        kube.create(document)
        phases[document["metadata"]["name"]] = reconcilers[document["kind"]].reconcile("default", document["metadata"]["name"])
    bad = kube.get(API, "Swarm", "default", "bad")["status"]["conditions"][0]["message"]
rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(json.dumps({"phases": phases, "bad": bad, "rss_kib": rss,
                  "heavy": sorted(m for m in ("torch", "hivemind", "sklearn") if m in sys.modules)}))
"""


def test_the_operator_never_imports_torch_hivemind_or_sklearn(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "KUBECONFIG": str(tmp_path / "none")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["phases"] == {"digits-open": "Pending", "tiny-llama": "Pending", "digits-moe": "Pending",
                                "bad": "Invalid"}
    # A bad task option still gets one clear line naming the field.
    assert "spec.task.options.hiddenSize" in result["bad"] and "greater than or equal to 8" in result["bad"]
    print(f"operator RSS after one reconcile of each kind: {result['rss_kib'] / 1024:.0f} MiB")


INVITE_PROBE = r"""
import sys
from hivekeeper.cli import main
code = main(["invite", "--key-file", sys.argv[1], "--identity", "lab-b"])
print("heavy:", ",".join(m for m in ("torch", "hivemind") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def test_an_invite_is_minted_without_torch_or_hivemind_and_the_swarm_reads_it(tmp_path):
    """An admin's `hivekeeper invite` (and the real-cluster tier's) costs no torch import: on a
    loaded host that import alone took over two minutes. The token service, which has hivemind,
    reads the invite."""
    from hivekeeper.auth.keys import load_swarm_key
    from hivekeeper.auth.tokens import read_invite
    from hivekeeper_operator.volunteers import generate_swarm_key

    key_file = tmp_path / "swarm-auth.pem"
    key_file.write_bytes(generate_swarm_key())
    done = subprocess.run([sys.executable, "-c", INVITE_PROBE, str(key_file)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    heavy = next(line for line in done.stderr.splitlines() if line.startswith("heavy:"))
    assert heavy == "heavy: ", done.stderr
    invite = read_invite(done.stdout.strip(), load_swarm_key(key_file).get_public_key())
    assert invite.identity == "lab-b"
