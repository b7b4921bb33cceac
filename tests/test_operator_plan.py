"""The operator's pure parts: the Kubernetes network for the topology, the children it plans
for every example (valid Kubernetes 1.33 objects, commands the CLI accepts), the pod launcher,
status conditions, and the runtime image's entrypoint."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")

from conftest import EXAMPLES, REPO  # noqa: E402
from hivekeeper.cli import build_parser  # noqa: E402
from hivekeeper.kinds import runtime  # noqa: E402
from hivekeeper.spec import load_manifest  # noqa: E402
from hivekeeper.spec.manifest import parse_manifest  # noqa: E402
from hivekeeper_operator import launch, pods, readers, volunteers  # noqa: E402
from hivekeeper_operator.conditions import Cond, render_conditions  # noqa: E402
from hivekeeper_operator.network import KubernetesNetwork  # noqa: E402
from hivekeeper_operator.plan import SCANNED, Plan, Request, door_of, plan, render_roles  # noqa: E402
from hivekeeper_operator.pods import CONFIG_HASH, WorkloadSettings  # noqa: E402
from hivekeeper_operator.status import resource_status  # noqa: E402
from hivekeeper_operator.volunteers import VolunteerAccess  # noqa: E402

PEER = "QmcMnYTosWBs1ZaJR1dwEV3eRk1SHoPoTggxmWwZJGKG96"
SETTINGS = WorkloadSettings(image="hivekeeper:test")
SWARM_KEY = volunteers.generate_swarm_key()  # made once: RSA key generation is slow


def owner(name: str) -> dict:
    return {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "Swarm",
            "metadata": {"name": name, "namespace": "default", "uid": "0000-1111"}}


def peer_ids(manifest) -> dict[str, str]:
    return {name: PEER for name in runtime(manifest.kind).identity_roles(manifest)}


def plan_of(manifest, keys: dict | None = None, **kwargs) -> Plan:
    """The operator's plan for a manifest, every identity role's peer ID PEER."""
    if door_of(manifest) is not None and "access" not in kwargs:
        kwargs["access"] = volunteer_access(manifest)
    return plan(Request({**owner(manifest.metadata.name), "kind": manifest.kind}, manifest, peer_ids(manifest),
                        keys or {}, SETTINGS, **kwargs))


def plan_for(path: Path, **kwargs):
    manifest = load_manifest(path)
    keys = {f"backbone-{i}.key": "a2V5" for i in range(manifest.spec.backbone.replicas)}
    return manifest, plan_of(manifest, keys, **kwargs)


def volunteer_access(manifest, hosts: list | None = None) -> VolunteerAccess:
    door = manifest.spec.volunteers
    hosts = hosts if hosts is not None else volunteers.public_hosts(door, [None] * door.relays)
    roles = render_roles(manifest, peer_ids(manifest), SETTINGS, hosts)
    auth, invites = volunteers.ensure_access(None, None, manifest.metadata.name, roles, generate=lambda: SWARM_KEY)
    return VolunteerAccess(relay_hosts=hosts, auth_data=auth, invites_data=invites)


EXAMPLE_PATHS = sorted(EXAMPLES.glob("*.yaml"))
SWARM_EXAMPLES = [p for p in EXAMPLE_PATHS if yaml.safe_load(p.read_text()).get("kind") == "Swarm"]


def test_backbone_is_reached_through_the_headless_service():
    network = KubernetesNetwork("digits", "ml", "cluster.local")
    assert network.backbone_maddr(0, 31337, PEER) == (
        f"/dns4/digits-backbone-0.digits-backbone.ml.svc.cluster.local/tcp/31337/p2p/{PEER}")
    assert network.listen_host == "0.0.0.0"
    assert network.port("trainer-3", "p2p") == network.port("backbone-0", "p2p")  # one pod, one IP
    assert network.identity_path("backbone-1") == "/var/run/hivekeeper/keys/backbone-1.key"
    assert network.announce_host("trainer-0") == "$(POD_IP)"


@pytest.mark.parametrize("path", SWARM_EXAMPLES, ids=lambda p: p.name)
def test_planned_children_are_valid_kubernetes_objects(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    _, plan = plan_for(path)
    for child in plan.children:
        kubernetes_validate.validate(child, "1.33.0", strict=True)
    # The names a StatefulSet's pods get stay within DNS label limits even for the longest name.
    long_name = load_manifest(path)
    long_name.metadata.name = "x" * 40
    for child in plan_of(long_name).children:
        if child["kind"] == "StatefulSet":
            assert len(child["metadata"]["name"]) <= 52  # room for "-<controller-revision-hash>"
        kubernetes_validate.validate(child, "1.33.0", strict=True)


@pytest.mark.parametrize("path", SWARM_EXAMPLES, ids=lambda p: p.name)
def test_every_pod_command_is_one_the_cli_accepts(path):
    manifest, plan = plan_for(path)
    roles = json.loads(next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["roles.json"])
    expected = {f"backbone-{i}" for i in range(manifest.spec.backbone.replicas)}
    expected |= {f"trainer-{i}" for i in range(manifest.spec.trainers.replicas)}
    expected |= {f"auxiliary-{i}" for i in range(manifest.spec.auxiliary.replicas)}
    expected |= {"monitor-0"} if manifest.spec.monitor.enabled else set()
    expected |= {"balancer-0"} if manifest.spec.balancer.enabled else set()
    door = manifest.spec.volunteers
    expected |= {"auth-0", *(f"relay-{i}" for i in range(door.relays))} if door.enabled else set()
    assert set(roles) == expected
    environ = {"POD_IP": "10.1.2.3"}
    for name, role in roles.items():
        component, index = name.rsplit("-", 1)
        args = launch.resolve(roles, component, int(index), environ)
        parsed = build_parser().parse_args(["run", *args])
        assert parsed.role == component and parsed.index == int(index)
        assert parsed.host == "0.0.0.0" and parsed.announce_host == "10.1.2.3"
        assert parsed.metrics_port == 9300 and parsed.p2p_port == 31337
        assert parsed.manifest == "/etc/hivekeeper/manifest.json"


def test_launcher_picks_the_pods_own_role(tmp_path, capsys):
    _, plan = plan_for(EXAMPLES / "swarm-digits.yaml")
    roles_file = tmp_path / "roles.json"
    roles_file.write_text(next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["roles.json"])
    assert launch.ordinal("digits-trainer-12") == 12
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POD_NAME", "digits-trainer-2")
        mp.setenv("POD_IP", "10.0.0.7")
        assert launch.main(["--component", "trainer", "--roles", str(roles_file), "--dry-run"]) == 0
    command = json.loads(capsys.readouterr().out)
    assert command[:3] == ["hivekeeper", "run", "trainer"]
    assert command[command.index("--index") + 1] == "2"
    assert command[command.index("--announce-host") + 1] == "10.0.0.7"
    with pytest.raises(SystemExit, match="no role 'trainer-9'"):
        launch.resolve(json.loads(roles_file.read_text()), "trainer", 9, {})
    assert launch.expand("$(POD_IP)/$(UNSET)", {"POD_IP": "1.2.3.4"}) == "1.2.3.4/$(UNSET)"


# Stands in for `hivekeeper run ROLE ... --run-dir DIR`: finishes the run (writes result.json,
# exits 0), fails, or serves until SIGTERM (exits 0 then, without a result, as the monitor does).
FAKE_ROLE = """#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --run-dir ] && run_dir=$2; shift; done
case "$FAKE_ROLE" in
  finish) cp "$FAKE_RESULT" "$run_dir/result.json"; exit 0 ;;
  fail) cp "$FAKE_RESULT" "$run_dir/result.json"; exit 3 ;;
  serve) trap 'exit 0' TERM; touch "$run_dir/started"; while :; do sleep 0.1; done ;;
esac
"""
FINAL = {"globalStep": 45, "reason": "target accuracy 0.95 reached", "metrics": {"accuracy": 0.969},
         "checkpoint": "/var/lib/hivekeeper/checkpoints/final.pt",
         "losses": {str(step): round(2.3 / step, 6) for step in range(1, 46)}}


@pytest.fixture
def fake_role(tmp_path, monkeypatch):
    """A `hivekeeper` on PATH, the roles file of a monitor pod, and its run dir."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run_dir.mkdir()
    (bin_dir / "hivekeeper").write_text(FAKE_ROLE)
    (bin_dir / "hivekeeper").chmod(0o755)
    (tmp_path / "result.json").write_text(json.dumps(FINAL))
    roles = tmp_path / "roles.json"
    roles.write_text(json.dumps({"monitor-0": {"component": "monitor",
                                               "args": ["monitor", "--index", "0", "--run-dir", str(run_dir)]}}))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_RESULT", str(tmp_path / "result.json"))
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")  # the monitor runs as an Indexed Job
    return ["--component", "monitor", "--index", "0", "--roles", str(roles),
            "--termination-log", str(tmp_path / "termination-log")], run_dir, tmp_path / "termination-log"


def test_a_finished_monitor_leaves_its_final_report_in_the_termination_message(fake_role, monkeypatch):
    args, run_dir, termination_log = fake_role
    (run_dir / "result.json").write_text("{}")  # an earlier container's, in the same emptyDir
    monkeypatch.setenv("FAKE_ROLE", "finish")
    assert launch.main(args) == 0
    report = readers.parse_final_report(termination_log.read_text())
    assert report == {"globalStep": 45, "reason": "target accuracy 0.95 reached", "metrics": {"accuracy": 0.969},
                      "loss": FINAL["losses"]["45"], "lossStep": 45}
    pod = {"metadata": {"ownerReferences": [{"kind": "Job", "uid": "job-1"}]},
           "status": {"containerStatuses": [{"state": {"terminated": {
               "exitCode": 0, "finishedAt": "2026-01-01T00:00:00Z", "message": termination_log.read_text()}}}]}}
    assert readers.final_report_of([pod], "job-1") == report
    assert readers.final_report_of([pod], "another-job") is None

    termination_log.unlink()
    monkeypatch.setenv("FAKE_ROLE", "fail")
    assert launch.main(args) == 3  # the Job controller sees the role's own exit code
    assert not termination_log.exists()
    assert launch.ends_run({"JOB_COMPLETION_INDEX": "0"}) and not launch.ends_run({})


def test_a_final_report_fits_a_termination_message():
    """The kubelet keeps 4 KiB of it: a long run's loss curve stays out, its last loss in."""
    long_run = {**FINAL, "losses": {str(step): 0.123456789 for step in range(1, 100_001)},
                "metrics": {f"metric{i}": 0.5 for i in range(500)}}
    message = readers.final_report_message(long_run)
    assert len(message.encode()) <= readers.MESSAGE_LIMIT
    assert readers.parse_final_report(message) == {"globalStep": 45, "loss": 0.123456789, "lossStep": 100_000}


def test_the_launcher_of_a_job_pod_passes_sigterm_on(fake_role, tmp_path):
    args, run_dir, termination_log = fake_role
    env = {**os.environ, "FAKE_ROLE": "serve"}
    process = subprocess.Popen([sys.executable, "-m", "hivekeeper_operator.launch", *args], env=env)
    try:
        deadline = time.monotonic() + 30
        while not (run_dir / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        # The role shut down cleanly (0), but stopped is not finished: the pod fails (128 +
        # SIGTERM), so that the Job starts the role again instead of counting the run done.
        assert process.wait(10) == 128 + signal.SIGTERM
        assert not termination_log.exists()  # nothing to report
    finally:
        if process.poll() is None:
            process.kill()


def test_scaling_changes_no_pod_template_and_completion_stops_every_peer():
    manifest, plan = plan_for(EXAMPLES / "swarm-digits.yaml")
    templates = {c["metadata"]["name"]: c["spec"]["template"] for c in plan.children if c["kind"] == "StatefulSet"}
    manifest.spec.trainers.replicas = 7
    manifest.spec.auxiliary.replicas = 0
    scaled = plan_of(manifest)
    assert {c["metadata"]["name"]: c["spec"]["template"] for c in scaled.children if c["kind"] == "StatefulSet"} == templates
    assert scaled.hashes == plan.hashes
    manifest.spec.optimizer.learning_rate = 0.01
    changed = plan_of(manifest)
    assert all(changed.hashes[c] != plan.hashes[c] for c in plan.hashes)
    done = plan_of(manifest, completed=True)
    assert {c["metadata"]["name"]: c["spec"]["replicas"] for c in done.children if c["kind"] == "StatefulSet"} == {
        "digits-backbone": 0, "digits-trainer": 0, "digits-auxiliary": 0, "digits-balancer": 0}
    job = next(c for c in done.children if c["kind"] == "Job")
    assert job["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH] == changed.hashes["monitor"]


def test_gpu_trainers_request_and_limit_gpus():
    manifest = load_manifest(EXAMPLES / "swarm-digits.yaml")
    manifest.spec.trainers.resources.gpu = 2
    plan = plan_of(manifest)
    sts = next(c for c in plan.children if c["metadata"]["name"] == "digits-trainer" and c["kind"] == "StatefulSet")
    resources = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": 2} and resources["requests"]["nvidia.com/gpu"] == 2


def test_conditions_keep_their_transition_time_until_they_change():
    first = render_conditions([Cond("Ready", False, "PeersNotReady")], None, 1, "2026-01-01T00:00:00Z")
    same = render_conditions([Cond("Ready", False, "PeersNotReady", "other text")], first, 2, "2026-01-01T00:05:00Z")
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and same[0]["observedGeneration"] == 2
    flipped = render_conditions([Cond("Ready", True, "AllPeersReady")], same, 2, "2026-01-01T00:06:00Z")
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:06:00Z"


def test_a_rollout_that_never_settles_is_degraded():
    manifest, plan = plan_for(EXAMPLES / "swarm-digits.yaml")
    settings = WorkloadSettings(progress_deadline_seconds=60)
    start = resource_status(kind="Swarm", generation=1, previous=None, now="2026-01-01T00:00:00Z", plan=plan,
                            workloads={}, settings=settings, name="digits")
    assert {c["type"]: c["reason"] for c in start["conditions"]}["Degraded"] == "AsExpected"
    later = resource_status(kind="Swarm", generation=1, previous=start, now="2026-01-01T00:02:00Z", plan=plan,
                            workloads={}, settings=settings, name="digits")
    degraded = next(c for c in later["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ProgressDeadlineExceeded"


# ---------------------------------------------------------------------------------------------
# The runtime image


def test_dockerfile_builds_one_non_root_image_with_the_hivekeeper_entrypoint():
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["hivekeeper"\]$', text, re.M)
    user = re.search(r"^USER (\S+)$", text, re.M).group(1)
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"  # numeric, for runAsNonRoot
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11", text, re.M)
    pinned = re.search(r'"torch==([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pinned)}$", text, re.M)
    assert "scripts/requirements.py operator" in text and "--only-binary=hivemind" in text
    listed = subprocess.run([sys.executable, str(REPO / "scripts/requirements.py"), "operator"], capture_output=True,
                            text=True, check=True).stdout.split()
    assert any(line.startswith("kopf==") for line in listed) and f"torch=={pinned}" in listed


def test_the_entrypoints_start():
    bin_dir = Path(sys.executable).parent
    out = subprocess.run([str(bin_dir / "hivekeeper"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "run" in out.stdout and "crds" in out.stdout
    out = subprocess.run([str(bin_dir / "hivekeeper-operator"), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--namespace" in out.stdout
    out = subprocess.run([sys.executable, "-m", "hivekeeper_operator.launch", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--component" in out.stdout


@pytest.mark.timeout(300)
def test_the_package_as_the_dockerfile_installs_it_has_both_source_roots(tmp_path):
    """`pip install .` (not editable) ships hivekeeper and hivekeeper_operator and both scripts."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=280)
    if result.returncode != 0 and "No module named" in result.stderr:
        pytest.skip(f"cannot build a wheel here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    wheel = next(tmp_path.glob("hivekeeper-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert {"hivekeeper/cli.py", "hivekeeper/spec/crd.py", "hivekeeper_operator/launch.py",
            "hivekeeper_operator/__main__.py"} <= names
    assert not any(n.startswith("operator/") for n in names)  # never a top-level `operator` package
    assert "hivekeeper = hivekeeper.cli:main" in entry_points
    assert "hivekeeper-operator = hivekeeper_operator.__main__:main" in entry_points


def plan_role_planned(manifest):
    return plan_of(manifest, {f"{n}.key": "a2V5" for n in peer_ids(manifest)}, service_monitor=True)


@pytest.mark.parametrize("path", [EXAMPLES / "blockserver.yaml", EXAMPLES / "expertpool.yaml"], ids=lambda p: p.name)
def test_role_planned_kinds_give_valid_objects_and_commands_the_cli_accepts(path):
    """BlockServer and ExpertPool are planned from their roles (plan.py): every child is a
    valid Kubernetes 1.33 object, and every pod's command parses, Job pods included (their
    index is the Indexed Job's completion index)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    plan = plan_role_planned(load_manifest(path))
    for child in plan.children:
        if child["kind"] != "ServiceMonitor":  # a CRD's kind: not in Kubernetes' schemas
            kubernetes_validate.validate(child, "1.33.0", strict=True)
    roles = json.loads(next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["roles.json"])
    for name in roles:
        component, index = name.rsplit("-", 1)
        parsed = build_parser().parse_args(["run", *launch.resolve(roles, component, int(index), {"POD_IP": "10.1.2.3"})])
        assert parsed.role == component and parsed.index == int(index)
        assert parsed.announce_host == "10.1.2.3" and parsed.manifest == "/etc/hivekeeper/manifest.json"


def test_a_job_pod_takes_its_completion_index(tmp_path, capsys):
    roles_file = tmp_path / "roles.json"
    roles_file.write_text(json.dumps({"block-client-0": {"component": "block-client", "args": ["block-client", "--index", "0"]}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POD_NAME", "tiny-llama-block-client-0-x7k2p")  # an Indexed Job pod's name has no ordinal at the end
        mp.setenv("JOB_COMPLETION_INDEX", "0")
        assert launch.main(["--component", "block-client", "--roles", str(roles_file), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out) == ["hivekeeper", "run", "block-client", "--index", "0"]


# ---------------------------------------------------------------------------------------------
# spec.volunteers: relays, the token service, invites


def _by_name(plan) -> dict:
    return {(c["kind"], c["metadata"]["name"]): c for c in plan.children}


def _pod_spec(children: dict, component: str, name: str = "digits-open") -> dict:
    return children[("StatefulSet", f"{name}-{component}")]["spec"]["template"]["spec"]


def test_volunteers_get_relays_and_a_gateway_outside_and_every_peer_an_invite():
    manifest = load_manifest(EXAMPLES / "swarm-digits-volunteers.yaml")
    manifest.spec.volunteers.relays = 2
    manifest.spec.volunteers.allowlist_secret = "alice-and-friends"
    hosts = ["203.0.113.7", None]  # relay 1's LoadBalancer has no address yet
    plan = plan_of(manifest, {"backbone-0.key": "a2V5"}, access=volunteer_access(manifest, hosts))
    children = _by_name(plan)
    relay0, gateway = children[("Service", "digits-open-relay-0")], children[("Service", "digits-open-gateway")]
    assert relay0["spec"]["type"] == "LoadBalancer" and relay0["spec"]["ports"][0]["port"] == 31337
    assert relay0["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "digits-open-relay-0"
    assert children[("Service", "digits-open-relay-1")]["spec"]["ports"][0]["port"] == 31338
    assert gateway["spec"]["ports"][0] == {"name": "grpc", "port": 31336, "targetPort": "grpc", "protocol": "TCP"}
    assert children[("StatefulSet", "digits-open-relay")]["spec"]["replicas"] == 2
    args = {role.name: role.args for role in plan.roles}
    assert args["relay-0"][args["relay-0"].index("--public-address") + 1] == "203.0.113.7:31337"
    assert "--public-address" not in args["relay-1"]  # announced once its address is known
    info = json.loads(children[("ConfigMap", "digits-open-config")]["data"]["swarm-info.json"])
    assert info["relays"] == [f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER}"] == plan.volunteer_relays
    assert info["manifest"]["spec"]["volunteers"]["enabled"] is True
    assert info["planSigner"] == PEER  # volunteers follow the balancer's plan like the swarm's own peers
    # Every peer signs with a token from the in-cluster token service, using its own invite.
    gateway_address = "digits-open-auth-0.digits-open-auth.default.svc.cluster.local:50051"
    for role in plan.roles:
        if role.component != "auth":
            assert args[role.name][args[role.name].index("--gateway") + 1] == gateway_address, role.name
            assert f"/var/run/hivekeeper/invites/{role.name}.invite" in args[role.name]
    for component in ("trainer", "relay", "backbone"):
        volumes = {v["name"]: v for v in _pod_spec(children, component)["volumes"]}
        assert volumes["invites"]["secret"]["secretName"] == "digits-open-invites" and "swarm-auth" not in volumes
    auth = _pod_spec(children, "auth")
    volumes = {v["name"]: v for v in auth["volumes"]}
    assert volumes["swarm-auth"]["secret"]["secretName"] == "digits-open-swarm-auth" and "invites" not in volumes
    assert volumes["allowlist"]["secret"] == {"secretName": "alice-and-friends", "defaultMode": 0o440,
                                              "items": [{"key": "allowlist", "path": "allowlist"}]}
    assert {"name": "grpc", "containerPort": 50051, "protocol": "TCP"} in auth["containers"][0]["ports"]
    status = resource_status(kind="Swarm", generation=1, previous=None, now="2026-11-23T00:00:00Z", plan=plan,
                             workloads={}, name="digits-open")
    assert status["volunteerRelays"] == plan.volunteer_relays and status["relays"]["desired"] == 2


def test_invites_are_signed_by_the_swarm_key_for_each_role_and_kept_across_reconciles():
    from cryptography.hazmat.primitives import serialization

    from hivekeeper.auth.keys import wrap_private_key
    from hivekeeper.auth.tokens import read_invite

    manifest = load_manifest(EXAMPLES / "swarm-digits-volunteers.yaml")
    roles = render_roles(manifest, peer_ids(manifest), SETTINGS, [None])
    auth, invites = volunteers.ensure_access(None, None, "digits-open", roles, generate=lambda: SWARM_KEY)
    key = wrap_private_key(serialization.load_pem_private_key(SWARM_KEY, password=None))
    assert set(invites) == {f"{r.name}.invite" for r in roles if r.component != "auth"}
    for name, data in invites.items():
        invite = read_invite(base64.b64decode(data).decode(), key.get_public_key())
        assert invite.identity == f"digits-open/{name.removesuffix('.invite')}" and invite.internal
    assert volunteers.ensure_access(auth, invites, "digits-open", roles) == (auth, invites)  # stable
    other = volunteers.generate_swarm_key()
    _, reissued = volunteers.ensure_access({"swarm-auth.pem": base64.b64encode(other).decode()}, invites,
                                           "digits-open", roles)
    assert all(reissued[name] != invites[name] for name in invites)  # a new key invalidates the old invites


def test_the_token_service_restarts_for_its_inputs_not_for_the_resources_bookkeeping():
    """A status write moves the resource's resourceVersion (and kopf's annotations): the swarm
    info volunteers get, and so the token service's config hash, must not follow it."""
    document = yaml.safe_load((EXAMPLES / "swarm-digits-volunteers.yaml").read_text())
    hashes = []
    for version in ("100", "101"):
        document["metadata"].update(resourceVersion=version, generation=1, uid="0000-1111",
                                    annotations={"kopf.zalando.org/last-handled-configuration": version})
        hashes.append(plan_of(parse_manifest(document)).hashes)
    assert hashes[0] == hashes[1]
    document["spec"]["volunteers"]["allowlist"].append("carol")  # what it serves does restart it
    document["spec"]["volunteers"]["labs"] = [{"name": "lab-b", "maxPeers": 2, "roles": ["trainer"]}]
    changed = plan_of(parse_manifest(document)).hashes
    # and it alone: a lab or a volunteer let in or taken off restarts no peer of the swarm
    assert {c for c in changed if changed[c] != hashes[0][c]} == {"auth"}


def test_nodeport_volunteers_need_a_public_host_and_ports_in_range():
    from hivekeeper.errors import UserError
    from hivekeeper.spec import parse_manifest

    document = yaml.safe_load((EXAMPLES / "swarm-digits-volunteers.yaml").read_text())
    document["spec"]["volunteers"]["serviceType"] = "NodePort"
    with pytest.raises(UserError, match="publicHost"):
        parse_manifest(document)
    document["spec"]["volunteers"].update(publicHost="node.example.org", relayPort=31000, gatewayPort=30999)
    manifest = parse_manifest(document)
    plan = plan_of(manifest)
    relay = _by_name(plan)[("Service", "digits-open-relay-0")]
    assert relay["spec"]["type"] == "NodePort" and relay["spec"]["ports"][0]["nodePort"] == 31000
    assert plan.volunteer_gateway == "node.example.org:30999"
    assert plan.volunteer_relays == [f"/dns4/node.example.org/tcp/31000/p2p/{PEER}"]
    document["spec"]["volunteers"]["relayPort"] = 29000
    with pytest.raises(UserError, match="30000-32767"):
        parse_manifest(document)


def test_volunteers_disabled_plans_none_of_it_and_the_owner_scan_finds_it_for_deletion():
    _, plan = plan_for(EXAMPLES / "swarm-digits.yaml")
    names = {c["metadata"]["name"] for c in plan.children}
    assert not names & {"digits-relay", "digits-auth", "digits-gateway", "digits-invites", "digits-swarm-auth"}
    assert pods.owned_secrets(plan.children[0]) == set()
    # Once volunteers close, the owner scan finds their Services and StatefulSets by listing
    # the kinds it scans, and their Secrets in the keys Secret's record (Secrets are never listed).
    _, opened = plan_for(EXAMPLES / "swarm-digits-volunteers.yaml")
    keys = next(c for c in opened.children if c["metadata"]["name"] == "digits-open-backbone-keys")
    assert pods.owned_secrets(keys) == {"digits-open-swarm-auth", "digits-open-invites"}
    assert {(c["apiVersion"], c["kind"]) for c in opened.children
            if c["kind"] not in ("Secret", "ConfigMap", "ServiceMonitor")} <= set(SCANNED)
    assert {"digits-open-relay", "digits-open-auth", "digits-open-gateway", "digits-open-relay-0"} <= {
        c["metadata"]["name"] for c in opened.children if (c["apiVersion"], c["kind"]) in SCANNED}


def test_expert_checkpoints_go_on_one_claim_every_server_mounts_where_it_saves():
    """spec.checkpoint.volumeClaim: a PersistentVolumeClaim owned by the pool, mounted by the expert
    servers (only) at their checkpoint directory; existingClaim: the user's claim, none made."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    from hivekeeper.spec import parse_manifest

    base = yaml.safe_load((EXAMPLES / "expertpool.yaml").read_text())

    def plan(checkpoint: dict):
        document = json.loads(json.dumps(base))
        document["spec"]["checkpoint"].update(checkpoint)
        return plan_role_planned(parse_manifest(document))

    def mounts(plan_) -> dict[str, list]:
        return {c["metadata"]["name"]: [(v, m) for v in c["spec"]["template"]["spec"]["volumes"]
                                        for m in c["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                                        if v["name"] == m["name"] == "checkpoints"]
                for c in plan_.children if c["kind"] == "StatefulSet"}

    def claims(plan_) -> list[dict]:
        return [c for c in plan_.children if c["kind"] == "PersistentVolumeClaim"]

    made = plan({"volumeClaim": {"size": "5Gi", "storageClassName": "nfs-client"}})
    [claim] = claims(made)
    kubernetes_validate.validate(claim, "1.33.0", strict=True)
    assert claim["metadata"]["name"] == "digits-moe-checkpoints"
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"  # deleted with the pool
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs-client",
                             "resources": {"requests": {"storage": "5Gi"}}}
    shared = ({"name": "checkpoints", "persistentVolumeClaim": {"claimName": "digits-moe-checkpoints"}},
              {"name": "checkpoints", "mountPath": "/var/lib/hivekeeper/experts"})  # RUN_DIR/experts: the servers'
    assert mounts(made) == {"digits-moe-expert-server": [shared], "digits-moe-backbone-experts": []}
    for child in made.children:
        if child["kind"] == "StatefulSet":
            kubernetes_validate.validate(child, "1.33.0", strict=True)

    theirs = plan({"existingClaim": "lab-nfs", "dir": "/checkpoints"})
    assert claims(theirs) == []
    assert mounts(theirs)["digits-moe-expert-server"] == [
        ({"name": "checkpoints", "persistentVolumeClaim": {"claimName": "lab-nfs"}},
         {"name": "checkpoints", "mountPath": "/checkpoints"})]

    # No claim (the example): checkpoints stay in each pod's run directory, as before.
    none = plan({})
    assert claims(none) == [] and all(m == [] for m in mounts(none).values())


@pytest.mark.parametrize("checkpoint", [{"volumeClaim": {}}, {"existingClaim": "lab-nfs", "dir": "/checkpoints"}],
                         ids=["volumeClaim", "existingClaim-dir"])
def test_an_expert_server_saves_where_the_operator_mounts_the_checkpoint_claim(checkpoint):
    """An expert server started from the arguments the operator renders keeps its checkpoints in
    the directory the claim is mounted at: both sides ask spec.checkpoint.directory(run dir)."""
    from hivekeeper.experts.common import ExpertMetrics
    from hivekeeper.experts.server import ExpertServer
    from hivekeeper.spec import parse_manifest
    from hivekeeper.runtime.context import RoleContext

    document = yaml.safe_load((EXAMPLES / "expertpool.yaml").read_text())
    document["spec"]["checkpoint"].update(checkpoint)
    manifest = parse_manifest(document)
    plan = plan_role_planned(manifest)
    [servers] = [c for c in plan.children
                 if c["kind"] == "StatefulSet" and c["metadata"]["name"].endswith("-expert-server")]
    [mount] = [m for m in servers["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
               if m["name"] == "checkpoints"]
    [config] = [c for c in plan.children if c["kind"] == "ConfigMap"]
    args = build_parser().parse_args(
        ["run", *launch.resolve(json.loads(config["data"]["roles.json"]), "expert-server", 0, {"POD_IP": "10.1.2.3"})])
    context = RoleContext("expert-server", args, manifest, metrics=ExpertMetrics())
    assert ExpertServer(context).checkpoint_dir == Path(mount["mountPath"])


@pytest.mark.parametrize("section, change, restarted", [
    ("trainers", {"batchSize": 24}, {"trainer", "balancer"}),
    ("monitor", {"evalEverySteps": 7}, {"monitor"}),
    ("stopping", {"targetSteps": 150}, {"monitor"}),  # a new target restarts no trainer
    ("auxiliary", {"bandwidth": {"uploadMbps": 50}}, {"auxiliary", "balancer"}),
    ("optimizer", {"learningRate": 0.01}, None),  # read by every component
])
def test_a_spec_change_restarts_only_the_components_that_read_it(tmp_path, section, change, restarted):
    """A pod rolls when its template's config hash changes: a section one component reads alone
    moves only that component's hash (the real cluster showed a trainer batch size restarting
    the backbone, the auxiliaries and the monitor's run)."""
    document = yaml.safe_load((EXAMPLES / "swarm-digits.yaml").read_text())
    document["spec"].setdefault("balancer", {})["enabled"] = True
    before = tmp_path / "before.yaml"
    before.write_text(yaml.safe_dump(document))
    document["spec"][section] = {**document["spec"].get(section, {}), **change}
    after = tmp_path / "after.yaml"
    after.write_text(yaml.safe_dump(document))
    old, new = plan_for(before)[1].hashes, plan_for(after)[1].hashes
    assert set(old) == {"backbone", "trainer", "auxiliary", "monitor", "balancer"}
    assert {c for c in old if old[c] != new[c]} == (set(old) if restarted is None else restarted)
