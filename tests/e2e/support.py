"""Fixtures and helpers of the real-cluster tier (a pytest plugin: tests/conftest.py loads it).

The tier: a Kubernetes built and started by `scripts/cluster.sh up`, the operator
installed by `helm install` with the image built from the Dockerfile, and every resource applied
with `kubectl apply`, as a user would. Runs only when the cluster is up (its `.cluster/env`, or
$KUBECONFIG with $HIVEKEEPER_E2E_IMAGE), and skips otherwise; `make test` brings one up where it
can (root, Go) and takes it down afterwards.

The files run in name order and share one cluster and one release: the operator, then each kind,
then `helm uninstall`. Where labs pool their clusters, a second cluster stands for lab B
(`scripts/cluster.sh up b`), joined to the first through a WAN (`scripts/cluster.sh wan up`):
the `lab_b` fixture, with the chart installed there too. Each lab reaches the other only at its
public address (`Cluster.public_ip`), as two labs' clusters reach each other over the internet."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
RELEASE = "hivekeeper"
OPERATOR_NAMESPACE = "hivekeeper-system"
LEASE = f"{RELEASE}-leader"  # the operator replicas' leader Lease (the chart's hivekeeper.leaseName)
NAMESPACE = "e2e"  # where the resources under test live


def _cluster_env(state: str = ".cluster", environ: bool = True) -> dict[str, str]:
    """What `scripts/cluster.sh up` wrote to STATE/env; with `environ`, overridden by this
    process's environment (a cluster started some other way)."""
    env_file = REPO / state / "env"
    found: dict[str, str] = {}
    if env_file.exists():
        for line in env_file.read_text().splitlines():
            key, _, value = line.partition("=")
            found[key] = value
    for key in ("KUBECONFIG", "HIVEKEEPER_E2E_IMAGE", "HIVEKEEPER_KUBECTL") if environ else ():
        if os.environ.get(key):
            found[key] = os.environ[key]
    return found


ENV = _cluster_env()
ENV_B = _cluster_env(".cluster-b", environ=False)  # lab B's cluster: `scripts/cluster.sh up b`
WAN = Path("/run/netns/hk-wan")  # `scripts/cluster.sh wan up`


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if ENV.get("KUBECONFIG") and ENV.get("HIVEKEEPER_E2E_IMAGE"):
        return
    skip = pytest.mark.skip(reason="no cluster: `scripts/cluster.sh up` (or set KUBECONFIG and HIVEKEEPER_E2E_IMAGE)")
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(skip)


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """`condition()` once it is truthy, asked every `interval` s for at most `timeout` s. Each wait
    prints how long it took (pytest shows it with a failure's output, or with -s)."""
    start = time.monotonic()
    deadline = start + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                print(f"waited {time.monotonic() - start:.0f} s of {timeout:.0f} for {what}")
                return value
        except subprocess.CalledProcessError as e:  # a transient API error
            last_error = e
        time.sleep(interval)
    detail = f" (last error: {last_error.stderr.strip() if last_error else ''})" if last_error else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")


class CommandFailed(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{' '.join(self.cmd)} exited {self.returncode}: {(self.stderr or '').strip()[-2000:]}"


class Cluster:
    """kubectl and helm against the cluster, with JSON in and out."""

    def __init__(self, env: dict[str, str]):
        self.kubeconfig = env["KUBECONFIG"]
        self.kubectl_bin = env.get("HIVEKEEPER_KUBECTL") or "kubectl"
        self.image = env["HIVEKEEPER_E2E_IMAGE"]
        self.helm_bin = str(REPO / ".tools" / "bin" / "helm")
        # the node's address on the WAN between the labs (scripts/cluster.sh wan up)
        self.public_ip = env.get("HIVEKEEPER_E2E_PUBLIC_IP", "")

    def _env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": self.kubeconfig}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        result = subprocess.run([self.kubectl_bin, *args], input=input, capture_output=True, text=True,
                                env=self._env(), timeout=timeout)
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, ["kubectl", *args], result.stdout, result.stderr)
        return result

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([self.helm_bin, *args], capture_output=True, text=True, env=self._env(), timeout=300)
        if check and result.returncode != 0:
            raise CommandFailed(result.returncode, ["helm", *args], result.stdout, result.stderr)
        return result

    def get(self, kind: str, name: str | None = None, namespace: str | None = NAMESPACE,
            selector: str | None = None) -> Any:
        args = ["get", kind, "-o", "json"]
        if name:
            args.insert(2, name)
        if namespace:
            args += ["-n", namespace]
        if selector:
            args += ["-l", selector]
        return json.loads(self.kubectl(*args).stdout)

    def apply(self, document: dict[str, Any], namespace: str = NAMESPACE, check: bool = True) -> subprocess.CompletedProcess:
        return self.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(document), check=check)

    def pods(self, selector: str, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        return self.get("pods", namespace=namespace, selector=selector)["items"]

    def status(self, kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        return self.get(kind, name, namespace).get("status") or {}

    def logs(self, pod: str, namespace: str = NAMESPACE, previous: bool = False) -> str:
        args = ["logs", pod, "-n", namespace] + (["--previous"] if previous else [])
        return self.kubectl(*args, check=False).stdout

    def describe_failure(self, namespace: str = NAMESPACE, components: Sequence[str] = ()) -> str:
        """What a person would look at when a wait fails: pods, events, the operator's log, and
        the logs of the pods of each of `components` (`expert-trainer`)."""
        parts = [self.kubectl("get", "all", "-n", namespace, "-o", "wide", check=False).stdout,
                 self.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout[-3000:],
                 self.kubectl("logs", "-n", OPERATOR_NAMESPACE, operator_pod(self)["metadata"]["name"], "--tail=40",
                              check=False).stdout]
        parts += [self.kubectl("logs", "-n", namespace, "-l", f"hivekeeper.dev/component={component}", "--tail=60",
                               "--prefix", check=False).stdout for component in components]
        return "\n".join(parts)


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def example(name: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """An example manifest as shipped, with `changes` merged in."""
    return merged(yaml.safe_load((EXAMPLES / name).read_text()), changes or {})


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    return Cluster(ENV)


def install_release(cluster: Cluster) -> None:
    """The chart installed as a user would, with the image built from the Dockerfile, and the
    namespace the resources under test go to."""
    repository, _, tag = cluster.image.rpartition(":")
    cluster.helm("upgrade", "--install", RELEASE, str(REPO / "charts" / "hivekeeper"), "--namespace", OPERATOR_NAMESPACE,
                 "--create-namespace", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
                 "--set", "image.pullPolicy=Never", "--set", "resyncSeconds=5", "--wait", "--timeout", "5m")
    # A namespace left terminating by an earlier session refuses new objects: wait it out.
    wait_for(lambda: cluster.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0
             or "Terminating" not in cluster.kubectl("get", "namespace", NAMESPACE).stdout, 300,
             f"namespace {NAMESPACE} to finish terminating")
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)


def uninstall_release(cluster: Cluster) -> None:
    if cluster.helm("status", RELEASE, "-n", OPERATOR_NAMESPACE, check=False).returncode == 0:
        cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", check=False)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", check=False, timeout=300)


@pytest.fixture(scope="session")
def release(cluster: Cluster):
    install_release(cluster)
    yield RELEASE
    uninstall_release(cluster)


@pytest.fixture(scope="session")
def lab_b(cluster: Cluster) -> Iterator[Cluster]:
    """Lab B's cluster, with hivekeeper installed as lab B's admin would (`helm install`), joined
    to lab A's through the WAN. The real-cluster tier brings both up (scripts/test.sh); a tier
    run by hand against one cluster fails here, naming what is missing."""
    missing = [what for what, there in (("`scripts/cluster.sh up b`", ENV_B.get("KUBECONFIG")),
                                        ("`scripts/cluster.sh wan up`", WAN.exists())) if not there]
    assert not missing, f"lab B's cluster is not up: run {' and '.join(missing)}"
    b = Cluster(ENV_B)
    assert b.public_ip and cluster.public_ip, "no public addresses in .cluster*/env: run `scripts/cluster.sh up` again"
    install_release(b)
    yield b
    uninstall_release(b)


@contextmanager
def partitioned() -> Iterator[None]:
    """No packet crosses the WAN between the labs until the block ends (a rule that drops all
    the WAN namespace forwards, ahead of the delay line's)."""
    def wan_iptables(*args: str) -> None:
        subprocess.run(["ip", "netns", "exec", WAN.name, "iptables", "-w", *args], check=True)

    wan_iptables("-I", "FORWARD", "1", "-j", "DROP")
    try:
        yield
    finally:
        wan_iptables("-D", "FORWARD", "-j", "DROP")


def restarts(cluster: Cluster, selector: str) -> int:
    """Container restarts of the pods `selector` picks: a crash loop shows here."""
    return sum(s.get("restartCount", 0) for pod in cluster.pods(selector)
               for s in (pod.get("status") or {}).get("containerStatuses") or [])


def logged_entry(log: str, msg: str) -> dict[str, Any] | None:
    """The last structured (JSON) log entry with this message."""
    for line in reversed(log.splitlines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == msg:
            return entry
    return None


def node_ip(cluster: Cluster) -> str:
    node = cluster.get("nodes", namespace=None)["items"][0]
    return next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")


def swarm_key(cluster: Cluster, name: str, directory: Path) -> Path:
    """A resource's signing key, as an admin reads it from its Secret to mint invites."""
    pem = base64.b64decode(cluster.get("secret", f"{name}-swarm-auth")["data"]["swarm-auth.pem"])
    path = directory / "swarm-auth.pem"
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


def hivekeeper(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`hivekeeper ARGS` run to its end; one still running after `timeout` s (a hang guard: it
    took over 120 s once beside the swarm tier) fails with what it wrote meanwhile."""
    try:
        return subprocess.run([sys.executable, "-m", "hivekeeper", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        written = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"hivekeeper {args[0]} still running after {timeout:.0f} s; "
                             f"it wrote: {written[-3000:]}") from None


INVITE_SECRET = "lab-a-invite"  # where a joining lab keeps the invite the host minted for it


def joining(kind: str, name: str, gateway: str, **spec: Any) -> dict[str, Any]:
    """A lab's joining resource: its own part (`spec`), the rest from the host at `gateway`."""
    return {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": kind, "metadata": {"name": name},
            "spec": {"join": {"gateway": gateway, "inviteSecret": INVITE_SECRET}, **spec}}


@contextmanager
def lab_joined(host: Cluster, resource: str, lab: Cluster, identity: str, part: dict[str, Any],
               tmp_path: Path) -> Iterator[None]:
    """Lab `identity` joins the host's `resource` from cluster `lab`: the host mints its invite,
    the lab keeps it in INVITE_SECRET and applies `part` (`joining`); both are deleted after."""
    invite = hivekeeper("invite", "--key-file", str(swarm_key(host, resource, tmp_path)), "--identity", identity)
    assert invite.returncode == 0, invite.stderr
    try:
        lab.kubectl("create", "secret", "generic", INVITE_SECRET, "-n", NAMESPACE,
                    f"--from-literal=invite={invite.stdout.strip()}")
        lab.apply(part)
        yield
    finally:
        lab.kubectl("delete", part["kind"].lower(), part["metadata"]["name"], "-n", NAMESPACE, "--wait=true",
                    timeout=300, check=False)
        lab.kubectl("delete", "secret", INVITE_SECRET, "-n", NAMESPACE, check=False)


@contextmanager
def applied(cluster: Cluster, manifest: dict[str, Any]) -> Iterator[None]:
    """The resource applied for the block's checks; what a person would look at printed if one
    fails; deleted afterwards, and its pods waited out (they hold CPU requests the next test needs)."""
    kind, name = manifest["kind"].lower(), manifest["metadata"]["name"]
    cluster.apply(manifest)
    try:
        yield
    except AssertionError:
        print(cluster.describe_failure())
        raise
    finally:
        cluster.kubectl("delete", kind, name, "-n", NAMESPACE, "--wait=true", timeout=180, check=False)
    wait_for(lambda: not cluster.pods(f"hivekeeper.dev/swarm={name}"), 180, f"the {manifest['kind']}'s pods to go")


def operator_pods(cluster: Cluster) -> list[dict[str, Any]]:
    """The operator's replicas (not those terminating)."""
    return [p for p in cluster.pods(f"app.kubernetes.io/instance={RELEASE}", OPERATOR_NAMESPACE)
            if not p["metadata"].get("deletionTimestamp")]


def lease_holder(cluster: Cluster) -> str | None:
    """The identity in the leader Lease (POD-NAME_UUID), or None while nobody holds it."""
    found = cluster.kubectl("get", "lease", LEASE, "-n", OPERATOR_NAMESPACE, "-o", "json", check=False)
    if found.returncode != 0:
        return None
    return (json.loads(found.stdout).get("spec") or {}).get("holderIdentity") or None


def operator_pod(cluster: Cluster) -> dict[str, Any]:
    """The replica that leads (holds the Lease); while none does, any replica."""
    pods = operator_pods(cluster)
    assert pods, "no operator pod"
    leader = (lease_holder(cluster) or "").rpartition("_")[0]
    return next((p for p in pods if p["metadata"]["name"] == leader), pods[0])


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])
