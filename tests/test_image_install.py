"""The runtime image without a Docker engine: the package installed as the Dockerfile installs
it (the files it copies into /src, its own `pip install` arguments, not editable) into a fresh
virtual environment, and from there the image's entrypoint, the operator's command and every
pod's command as the operator renders it.

The fresh environment downloads nothing: pip gets `--no-deps`, and the dependencies come from
this test's own environment through a .pth file that puts its site-packages AFTER the fresh
one's. Pods see their ConfigMap and Secrets where Kubernetes mounts them, only below a local
root, and the pod network is loopback (every pod its own ports; `$(POD_IP)` is 127.0.0.1)."""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import yaml

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")

from conftest import EXAMPLES, REPO, wait_for  # noqa: E402
import hivekeeper  # noqa: E402
from hivekeeper.kinds import runtime  # noqa: E402
from hivekeeper.local.supervisor import _is_ready as is_ready, _kill_group as kill_group  # noqa: E402
from hivekeeper.spec import load_manifest  # noqa: E402
from hivekeeper_operator import identity, plan, volunteers  # noqa: E402
from hivekeeper_operator.network import CONFIG_DIR, KubernetesNetwork  # noqa: E402

DOCKERFILE = (REPO / "Dockerfile").read_text()
SETTINGS = plan.WorkloadSettings(image="hivekeeper:test")
NAMESPACE = "default"
START_TIMEOUT = 180.0  # importing torch on a loaded machine, then joining the DHT


def dockerfile_install() -> tuple[list[str], list[str]]:
    """What the Dockerfile does in /src: the COPY instructions there (sources and destination
    of each) and the arguments of its `pip install`."""
    text = DOCKERFILE.replace("\\\n", " ")
    after_workdir = text.split("WORKDIR /src\n", 1)[1]
    copies = [line.split()[1:] for line in after_workdir.splitlines() if line.startswith("COPY ")]
    pip_line = re.search(r"^RUN (pip install .+?)(?:&&|$)", after_workdir, re.M).group(1)
    return copies, shlex.split(pip_line)


def copy_sources(copies: list[list[str]], src: Path) -> None:
    """`COPY a b ./` and `COPY dir ./dir` relative to the build context (the repository),
    leaving out what .dockerignore leaves out of it."""
    ignored = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for *sources, destination in copies:
        for pattern in sources:
            for match in map(Path, sorted(glob.glob(str(REPO / pattern)))):
                target = src / destination / match.name if destination.endswith("/") else src / destination
                if match.is_dir():
                    shutil.copytree(match, target, ignore=ignored)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(match, target)


@dataclass(frozen=True)
class ImageVenv:
    root: Path
    site: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, **extra: str) -> dict[str, str]:
        """The image's ENV (a minimal one: nothing of this test's environment leaks in)."""
        return {"PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin", "VIRTUAL_ENV": str(self.root),
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **extra}

    def run(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd="/",
                              env=self.env(HOME=str(self.root)))


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> ImageVenv:
    base = tmp_path_factory.mktemp("image")
    src, venv = base / "src", base / "venv"
    copies, pip_args = dockerfile_install()
    copy_sources(copies, src)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    # A bare path line, never `import site; site.addsitedir(...)`: that would run this
    # environment's own .pth files, and its editable hivekeeper's import hook would then
    # outrank the fresh install.
    (site / "zz-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --ignore-installed: pip sees this environment's hivekeeper on the path and must not
    # uninstall it; the Docker build has nothing installed.
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "--ignore-installed", "-q"]
    result = subprocess.run([str(venv / "bin" / "python"), "-m", *pip_args, *offline], cwd=src, capture_output=True,
                            text=True, timeout=300, env={"PATH": os.environ["PATH"], "HOME": str(base),
                                                         "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return ImageVenv(venv, site)


def test_the_install_is_the_fresh_one_with_every_dependency(image):
    # The source layer installs the package alone; its dependencies (pyproject's, the operator
    # extra's) come in a layer of their own before it.
    assert dockerfile_install()[1] == ["pip", "install", "--no-deps", "--no-build-isolation", "."]
    # Where each package comes from, and whether every requirement of `.[operator]` is met by
    # the environment the dependencies come from (else this test would hide a missing one).
    probe = """
import json, sys, hivekeeper, hivekeeper_operator
from importlib.metadata import distribution, version
from packaging.requirements import Requirement
unmet = []
for line in distribution("hivekeeper").requires:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": "operator"}):
        if not req.specifier.contains(version(req.name), prereleases=True):
            unmet.append(f"{req} (have {version(req.name)})")
print(json.dumps({"files": [hivekeeper.__file__, hivekeeper_operator.__file__],
                  "dist": str(distribution("hivekeeper").locate_file("")), "unmet": unmet,
                  "hooks": [type(f).__module__ for f in sys.meta_path]}))
"""
    result = image.run(str(image.bin / "python"), "-c", probe)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    for path in [*found["files"], found["dist"]]:
        assert Path(path).is_relative_to(image.site), path
    assert not any("editable" in hook for hook in found["hooks"]), found["hooks"]
    assert found["unmet"] == []


def test_the_entrypoint_and_the_operator_command_start(image):
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", DOCKERFILE, re.M).group(1))
    default_command = json.loads(re.search(r"^CMD (\[.*\])$", DOCKERFILE, re.M).group(1))
    assert entrypoint == ["hivekeeper"]
    executable = str(image.bin / entrypoint[0])
    result = image.run(executable, *default_command)  # `docker run IMAGE`
    assert result.returncode == 0 and "run" in result.stdout, result.stderr
    version = hivekeeper.__version__  # pyproject.toml reads it from there (tests/test_release.py)
    result = image.run(executable, "--version")
    assert result.stdout.strip() == f"hivekeeper {version}", result.stderr
    chart = (REPO / "charts" / "hivekeeper" / "templates" / "deployment.yaml").read_text()
    operator_command = json.loads(re.search(r"^\s+command: (\[.*\])$", chart, re.M).group(1))
    result = image.run(str(image.bin / operator_command[0]), *operator_command[1:], "--help")
    assert result.returncode == 0 and "--namespace" in result.stdout, result.stderr


# ---------------------------------------------------------------------------------------------
# Pods, as the operator plans them


def planned_children(path: Path, key: bytes) -> list[dict]:
    """The children the operator's reconcilers plan for an example, Secrets included (the calls
    of reconcile.py without an API server). Every role shares one peer key: what matters is
    that the peer IDs the pods name are those of the keys they hold."""
    manifest = load_manifest(path)
    owner = {"apiVersion": manifest.api_version, "kind": manifest.kind,
             "metadata": {"name": manifest.metadata.name, "namespace": NAMESPACE, "uid": "0000-1111"}}
    keys, ids = identity.ensure_role_keys(None, runtime(manifest.kind).identity_roles(manifest), lambda: key)
    access, door = None, plan.door_of(manifest)
    if door is not None:
        hosts = volunteers.public_hosts(door, [None] * door.relays)
        roles = plan.render_roles(manifest, ids, SETTINGS, hosts)
        auth, invites = volunteers.ensure_access(None, None, manifest.metadata.name, roles)
        access = volunteers.VolunteerAccess(relay_hosts=hosts, auth_data=auth, invites_data=invites)
    return plan.plan(plan.Request(owner, manifest, ids, keys, SETTINGS, access=access)).children


@dataclass
class Pod:
    name: str
    spec: dict  # the pod template's spec
    injected: dict[str, str]  # what Kubernetes itself adds to the environment (an Indexed Job's index)

    @property
    def container(self) -> dict:
        (container,) = self.spec["containers"]
        return container


def pods_of(children: list[dict]) -> Iterator[Pod]:
    """Every pod the children's workloads make, named as Kubernetes names them."""
    for child in children:
        name, spec = child["metadata"]["name"], child.get("spec") or {}
        if child["kind"] == "StatefulSet":
            for ordinal in range(spec["replicas"]):
                yield Pod(f"{name}-{ordinal}", spec["template"]["spec"], {})
        elif child["kind"] == "Job":
            indexed = spec.get("completionMode") == "Indexed"
            for index in range(spec.get("completions", 1)):
                yield Pod(f"{name}-{index}-x7k2p" if indexed else f"{name}-x7k2p", spec["template"]["spec"],
                          {"JOB_COMPLETION_INDEX": str(index)} if indexed else {})
        else:
            assert "template" not in spec, f"a workload kind this test does not start: {child['kind']}"


def local(path: str, root: Path, mounts: list[str]) -> str:
    """A path inside the pod, where this test put it (a path under no mount stays as it is)."""
    for mount in sorted(mounts, key=len, reverse=True):
        if path == mount or path.startswith(mount.rstrip("/") + "/"):
            return str(root) + path
    return path


def mount(pod: Pod, children: list[dict], root: Path) -> list[str]:
    """Project the pod's volumes below ROOT as the kubelet does (ConfigMap and Secret keys as
    files, Secret files with their defaultMode; emptyDirs empty). Returns the mount paths."""
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in children}
    volumes = {v["name"]: v for v in pod.spec["volumes"]}
    for volume_mount in pod.container["volumeMounts"]:
        volume, directory = volumes[volume_mount["name"]], Path(str(root) + volume_mount["mountPath"])
        directory.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            for key, text in by_name[("ConfigMap", volume["configMap"]["name"])]["data"].items():
                (directory / key).write_text(text)
        elif "secret" in volume:
            secret = by_name.get(("Secret", volume["secret"]["secretName"]))
            for key, data in ((secret or {}).get("data") or {}).items():  # absent: a user's Secret
                (directory / key).write_bytes(base64.b64decode(data))
                (directory / key).chmod(volume["secret"].get("defaultMode", 0o644))
    return [m["mountPath"] for m in pod.container["volumeMounts"]]


def pod_environment(pod: Pod, pod_ip: str, root: Path, mounts: list[str]) -> dict[str, str]:
    fields = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE, "status.podIP": pod_ip}
    environ = dict(pod.injected)
    for variable in pod.container.get("env", []):
        if "valueFrom" in variable:
            environ[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            environ[variable["name"]] = local(variable["value"], root, mounts)
    return environ


def launcher_command(pod: Pod, root: Path) -> list[str]:
    """The container's command and args, told where its ConfigMap's roles.json lies here."""
    roles = local(f"{CONFIG_DIR}/roles.json", root, [CONFIG_DIR])
    return [*pod.container["command"], *pod.container["args"], "--roles", roles]


def rewrite_roles(config_dir: Path, rewrite) -> None:
    path = config_dir / "roles.json"
    roles = json.loads(path.read_text())
    for role in roles.values():
        role["args"] = rewrite(role["args"])
    path.write_text(json.dumps(roles))


@pytest.fixture(scope="module")
def example_children() -> dict[str, list[dict]]:
    key = identity.generate_key()
    return {path.name: planned_children(path, key) for path in sorted(EXAMPLES.glob("*.yaml"))}


# Run by the fresh interpreter, once for every pod: the launcher up to its exec (--dry-run), then
# what `hivekeeper run` does before a role's own code runs: parse the command, import the role,
# and read the manifest from the ConfigMap.
POD_CHECK = """
import contextlib, importlib, io, json, os, sys
from hivekeeper.cli import build_parser
from hivekeeper.spec import load_manifest
from hivekeeper_operator import launch
base, results = dict(os.environ), []
for pod in json.load(open(sys.argv[1])):
    os.environ.clear()
    os.environ.update(base, **pod["env"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        launch.main([*pod["args"], "--dry-run"])
    command = json.loads(printed.getvalue())
    parsed = build_parser().parse_args(command[1:])
    module = importlib.import_module(parsed.role_module)
    results.append({"pod": pod["name"], "command": command, "role": f"{parsed.role}-{parsed.index}",
                    "module": module.__file__, "kind": load_manifest(parsed.manifest).kind})
print(json.dumps(results))
"""
LAUNCHER = ["python", "-m", "hivekeeper_operator.launch"]


def test_every_pod_of_every_example_resolves_parses_and_imports_its_role(image, example_children, tmp_path):
    pods, expected = [], {}
    for example, children in example_children.items():
        config = next(c for c in children if c["kind"] == "ConfigMap")
        expected[example] = set(json.loads(config["data"]["roles.json"]))
        for pod in pods_of(children):
            root = tmp_path / example / pod.name
            mounts = mount(pod, children, root)
            rewrite_roles(Path(local(CONFIG_DIR, root, mounts)),
                          lambda args, root=root, mounts=mounts: [local(a, root, mounts) for a in args])
            command = launcher_command(pod, root)
            assert command[:3] == LAUNCHER, command
            pods.append({"example": example, "name": pod.name, "args": command[3:],
                         "env": pod_environment(pod, "10.1.2.3", root, mounts)})
    listing = tmp_path / "pods.json"
    listing.write_text(json.dumps(pods))
    result = image.run(str(image.bin / "python"), "-c", POD_CHECK, str(listing), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    checked = json.loads(result.stdout)
    assert [r["pod"] for r in checked] == [p["name"] for p in pods]
    for pod, outcome in zip(pods, checked):
        assert outcome["command"][:2] == ["hivekeeper", "run"], outcome
        assert Path(outcome["module"]).is_relative_to(image.site), outcome
        assert outcome["kind"] == yaml.safe_load((EXAMPLES / pod["example"]).read_text())["kind"]
        assert "$(" not in " ".join(outcome["command"]), outcome  # every $(VAR) expanded
    for example, roles in expected.items():  # every rendered role has a pod that runs it
        started = {o["role"] for p, o in zip(pods, checked) if p["example"] == example}
        assert started == roles, example


# ---------------------------------------------------------------------------------------------
# Pods that really start: each kind's backbone, and the role doing the kind's work, which
# bootstraps from it (the peer ID it dials is that of the key the backbone's Secret holds)

STARTED = {"swarm-digits.yaml": ("backbone", "trainer"), "blockserver.yaml": ("backbone-blocks", "block-server"),
           "expertpool.yaml": ("backbone-experts", "expert-server")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_loopback(args: list[str], ports: dict[str, int], peers: dict[str, int]) -> list[str]:
    """A pod's arguments on loopback: listen on 127.0.0.1 on its own ports (PORTS: flag ->
    port), and dial a backbone pod's DNS name as 127.0.0.1 on that pod's p2p port (PEERS:
    host -> port)."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg == "--host":
            out[i + 1] = "127.0.0.1"
        elif arg in ports:
            out[i + 1] = str(ports[arg])
    for host, port in peers.items():
        out = [re.sub(rf"^/dns4/{re.escape(host)}/tcp/\d+/", f"/ip4/127.0.0.1/tcp/{port}/", a) for a in out]
    return out


def stop(processes) -> None:
    """SIGTERM to each process group (the role and its p2pd), then SIGKILL to what is left."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        kill_group(process.pid)
        process.wait()


@pytest.mark.swarm
@pytest.mark.timeout(420)
@pytest.mark.parametrize("example", sorted(STARTED))
def test_a_backbone_and_a_worker_pod_start_from_the_image_install(image, example_children, example, tmp_path,
                                                                  no_leaked_p2pd):
    children = example_children[example]
    name = yaml.safe_load((EXAMPLES / example).read_text())["metadata"]["name"]
    pods = {pod.name: pod for pod in pods_of(children)}
    started = {component: pods[f"{name}-{component}-0"] for component in STARTED[example]}
    ports = {c: {"--p2p-port": free_port(), "--metrics-port": free_port()} for c in started}
    network = KubernetesNetwork(name, NAMESPACE)
    backbones = {c["metadata"]["labels"]["hivekeeper.dev/component"] for c in children if c["kind"] == "PodDisruptionBudget"}
    peers = {network.backbone_host(0, c): ports[c]["--p2p-port"] for c in started if c in backbones}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for component, pod in started.items():
            root = tmp_path / pod.name
            mounts = mount(pod, children, root)
            rewrite_roles(Path(local(CONFIG_DIR, root, mounts)),
                          lambda args: on_loopback([local(a, root, mounts) for a in args], ports[component], peers))
            with (tmp_path / f"{component}.log").open("w") as log:
                processes[component] = subprocess.Popen(
                    launcher_command(pod, root), env=image.env(**pod_environment(pod, "127.0.0.1", root, mounts)),
                    cwd=local("/tmp", root, mounts), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)  # its own group: killpg takes its p2pd too

        def ready(component: str) -> bool:
            process = processes[component]
            assert process.poll() is None, (f"{component} exited with {process.returncode}:\n"
                                            + (tmp_path / f"{component}.log").read_text()[-4000:])
            return is_ready("127.0.0.1", ports[component]["--metrics-port"])  # the local runner's own check

        for component in started:
            wait_for(lambda: ready(component), START_TIMEOUT, f"{component} /readyz")
            # The launcher exec'd the image's `hivekeeper` in its place (a script: its interpreter first).
            argv = Path(f"/proc/{processes[component].pid}/cmdline").read_bytes().decode().split("\0")
            assert argv[1:4] == [str(image.bin / "hivekeeper"), "run", component], argv
    finally:
        stop(processes.values())
