"""`python -m hivekeeper_operator` stops on SIGTERM (a pod deleted, a rollout) and SIGINT:
kopf's own signal handlers replace any the process set, and a thread of kopf's that waits on
the operator's stop flag kept the process alive until the kubelet's SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator,operator-test]')")
pytest.importorskip("kmock", reason="the operator-test extra is not installed (pip install -e '.[operator-test]')")

import kubernetes  # noqa: E402
import yaml  # noqa: E402

from conftest import EXAMPLES, REPO, wait_for  # noqa: E402
from hivekeeper.local.network import free_port  # noqa: E402
from hivekeeper.spec.crd import KINDS, crd  # noqa: E402
from kube_emulator import EmulatedCluster  # noqa: E402

pytestmark = pytest.mark.timeout(240)
SWARMS = "hivekeeper.dev/v1alpha1/swarms"
STOP_WITHIN = 25.0  # seconds: under a pod's default 30 s grace period, on a machine 10x slower than idle


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def group_members(pgid: int) -> list[int]:
    """Processes still in a process group (children the operator may have left)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[2]) == pgid:
                members.append(int(entry.name))
    return members


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_operator_process_stops_on_a_signal(tmp_path, sig):
    with EmulatedCluster(tmp_path, crds=[crd(kind) for kind in sorted(KINDS)]) as cluster:
        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"}
        log = (tmp_path / "operator.log").open("w")
        process = subprocess.Popen(
            [sys.executable, "-m", "hivekeeper_operator", "--kubeconfig", str(cluster.kubeconfig),
             "--metrics-port", str(port), "--resync-seconds", "1", "--image", "hivekeeper:test"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def up() -> bool:
                assert process.poll() is None, (tmp_path / "operator.log").read_text()[-4000:]
                return ready(port)

            wait_for(up, 150, "the operator's /readyz")
            # Something to reconcile while it stops: kopf's watchers and handlers are busy.
            client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
            kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
                "hivekeeper.dev", "v1alpha1", "default", "swarms",
                yaml.safe_load((EXAMPLES / "swarm-digits.yaml").read_text()))
            wait_for(lambda: (cluster.object(SWARMS, "default", "digits") or {}).get("status"), 30,
                     "the Swarm's status")

            process.send_signal(sig)
            began = time.monotonic()
            try:
                code = process.wait(STOP_WITHIN)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - began
            output = (tmp_path / "operator.log").read_text()[-3000:]
            assert code == 0, f"{sig.name}: exit code {code} after {took:.1f}s\n{output}"
            assert group_members(process.pid) == [], "the operator left processes behind"
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            log.close()
