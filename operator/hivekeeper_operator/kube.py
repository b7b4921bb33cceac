"""A thin, dict-based client over the official `kubernetes` client's connection (auth, TLS,
in-cluster or kubeconfig), and the idempotent apply of child objects.

Objects stay plain dicts from end to end: the children are built as dicts, compared by hash,
and patched with explicit content types (the generated client picks JSON-patch for every
PATCH, whatever the body)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("hivekeeper.operator")

MANAGED_BY = "hivekeeper-operator"
HASH_ANNOTATION = "hivekeeper.dev/applied-hash"
# On a replaced kind (a Job): the hash of its immutable pod template. A change that leaves the
# template as it is (a finished run's `suspend`) is patched: replacing the Job would start the
# run over, and on a real cluster the operator then looped, suspending and re-running it.
TEMPLATE_HASH_ANNOTATION = "hivekeeper.dev/template-hash"
MUTABLE_SPEC_FIELDS = {"Job": ("suspend", "parallelism")}
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

# apiVersion/kind -> (API prefix, plural)
RESOURCES: dict[tuple[str, str], tuple[str, str]] = {
    ("v1", "ConfigMap"): ("api/v1", "configmaps"),
    ("v1", "Secret"): ("api/v1", "secrets"),
    ("v1", "Service"): ("api/v1", "services"),
    ("v1", "PersistentVolumeClaim"): ("api/v1", "persistentvolumeclaims"),
    ("v1", "Pod"): ("api/v1", "pods"),
    ("apps/v1", "StatefulSet"): ("apis/apps/v1", "statefulsets"),
    ("apps/v1", "Deployment"): ("apis/apps/v1", "deployments"),
    ("batch/v1", "Job"): ("apis/batch/v1", "jobs"),
    ("policy/v1", "PodDisruptionBudget"): ("apis/policy/v1", "poddisruptionbudgets"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("apis/monitoring.coreos.com/v1", "servicemonitors"),
}


def register_resource(api_version: str, kind: str, plural: str) -> None:
    """Make a kind (a hivekeeper CRD) addressable by `Kube`."""
    prefix = "api/v1" if api_version == "v1" else f"apis/{api_version}"
    RESOURCES[(api_version, kind)] = (prefix, plural)


class KubeError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        self.reason = ""
        self.message = body[:500]
        try:
            parsed = json.loads(body)
            self.reason = parsed.get("reason", "") or ""
            self.message = parsed.get("message", "") or self.message
        except ValueError:
            pass
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")


class Kube:
    """Plain-dict requests through a `kubernetes.client.ApiClient`."""

    def __init__(self, api_client: Any, request_timeout: float = 15.0):
        self.api_client, self.request_timeout = api_client, request_timeout
        self._discovery: dict[str, tuple[float, set[str]]] = {}
        self._discovery_lock = threading.Lock()

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> "Kube":
        """In-cluster config when running in a pod, else $KUBECONFIG / ~/.kube/config."""
        import kubernetes

        configuration = kubernetes.client.Configuration()
        try:
            if kubeconfig:
                raise kubernetes.config.ConfigException("kubeconfig given")
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return cls(kubernetes.client.ApiClient(configuration))

    # -- raw requests ------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: dict[str, str] | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        params = self.api_client.param_serialize(
            method=method, resource_path="/" + path.lstrip("/"), query_params=list((query or {}).items()),
            header_params=headers, body=body, auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*params, _request_timeout=self.request_timeout)
        response.read()
        text = response.data.decode() if isinstance(response.data, bytes) else (response.data or "")
        if not 200 <= response.status < 300:
            raise KubeError(response.status, method, path, text)
        return json.loads(text) if text else None

    # -- objects -----------------------------------------------------------------------------

    @staticmethod
    def path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        prefix, plural = RESOURCES[(api_version, kind)]
        base = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
        path = f"{base}/{name}" if name else base
        return f"{path}/{subresource}" if subresource else path

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             selector: str | None = None) -> list[dict]:
        """Every object of a kind (with these labels), in one namespace or (namespace None) the whole cluster."""
        query = {"labelSelector": selector} if selector else None
        listing = self.request("GET", self.path(api_version, kind, namespace), query=query)
        return list((listing or {}).get("items") or [])

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self.request("GET", self.path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def create(self, obj: dict) -> dict:
        return self.request("POST", self.path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"]), body=obj)

    def json_patch(self, api_version: str, kind: str, namespace: str, name: str, ops: list[dict]) -> dict:
        return self.request("PATCH", self.path(api_version, kind, namespace, name), body=ops,
                            content_type="application/json-patch+json")

    def merge_patch(self, path: str, patch: dict) -> dict:
        return self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            self.request("DELETE", self.path(api_version, kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except KubeError as e:
            if e.status == 404:
                return False
            raise

    def serves(self, group_version: str, plural: str, ttl: float = 60.0) -> bool:
        """Whether the API serves a resource (e.g. the ServiceMonitor CRD is installed)."""
        now = time.monotonic()
        with self._discovery_lock:
            cached = self._discovery.get(group_version)
            if cached and now - cached[0] < ttl:
                return plural in cached[1]
        try:
            listing = self.request("GET", f"apis/{group_version}")
            plurals = {r.get("name", "") for r in (listing or {}).get("resources", [])}
        except KubeError as e:
            if e.status not in (404, 503):
                raise
            plurals = set()
        with self._discovery_lock:
            self._discovery[group_version] = (now, plurals)
        return plural in plurals


# ---------------------------------------------------------------------------------------------
# Idempotent apply


def object_hash(obj: dict) -> str:
    """A stable hash of what the operator wants an object to be (its own annotation excluded)."""
    clean = json.loads(json.dumps(obj))
    clean.get("metadata", {}).get("annotations", {}).pop(HASH_ANNOTATION, None)
    return hashlib.sha256(json.dumps(clean, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _controller(meta: dict) -> dict | None:
    return next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)


class NameConflict(Exception):
    """An object with a child's name exists and is not managed by hivekeeper."""


@dataclass
class ApplyResult:
    kind: str
    name: str
    action: str  # created | patched | replaced | unchanged
    live: dict


class Applier:
    """Create or update child objects so they match what the operator wants, touching nothing
    that already matches (the hash annotation records what was last applied), and leaving
    fields other controllers own (status, defaulted fields, others' labels) alone.

    `recreate_kinds` are replaced (deleted and created) on change: a Job's pod template is
    immutable. `create_only_kinds` are made once and then left as they are: a bound claim's spec
    is immutable, and replacing it would lose its data. `on_write(kind, action)` counts writes
    for metrics and tests."""

    def __init__(self, kube: Kube, recreate_kinds: frozenset[str] = frozenset({"Job"}),
                 create_only_kinds: frozenset[str] = frozenset({"PersistentVolumeClaim"}),
                 on_write: Callable[[str, str], None] | None = None):
        self.kube, self.recreate_kinds, self.create_only_kinds = kube, recreate_kinds, create_only_kinds
        self.on_write = on_write or (lambda kind, action: None)

    def apply(self, desired: dict) -> ApplyResult:
        desired = json.loads(json.dumps(desired))
        meta = desired["metadata"]
        api_version, kind, namespace, name = desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"]
        if kind in self.recreate_kinds:
            meta.setdefault("annotations", {})[TEMPLATE_HASH_ANNOTATION] = object_hash(desired["spec"]["template"])
        digest = object_hash(desired)
        meta.setdefault("annotations", {})[HASH_ANNOTATION] = digest
        live = self.kube.get(api_version, kind, namespace, name)
        if live is None:
            return self._create(desired)
        live_meta = live.get("metadata", {})
        if (live_meta.get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
            raise NameConflict(f"{kind} {namespace}/{name} exists and is not managed by hivekeeper")
        wanted_owner, live_owner = _controller(meta), _controller(live_meta)
        if wanted_owner and live_owner and (live_owner.get("kind"), live_owner.get("name")) != (
                wanted_owner.get("kind"), wanted_owner.get("name")):
            raise NameConflict(f"{kind} {namespace}/{name} belongs to {live_owner.get('kind')} "
                               f"{live_owner.get('name')!r}")
        if (live_meta.get("annotations") or {}).get(HASH_ANNOTATION) == digest or kind in self.create_only_kinds:
            return ApplyResult(kind, name, "unchanged", live)
        ops = self._metadata_ops(meta, live_meta)
        if kind in self.recreate_kinds:
            same_template = (live_meta.get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION) == \
                meta["annotations"][TEMPLATE_HASH_ANNOTATION]
            if not same_template:
                self.kube.delete(api_version, kind, namespace, name)
                self.on_write(kind, "delete")
                result = self._create(desired)
                result.action = "replaced"
                return result
            ops += [{"op": "add", "path": f"/spec/{field}", "value": desired["spec"][field]}
                    for field in MUTABLE_SPEC_FIELDS.get(kind, ()) if field in desired["spec"]]
        else:
            ops += [{"op": "add", "path": f"/{field}", "value": value} for field, value in desired.items()
                    if field not in ("apiVersion", "kind", "metadata", "status")]
        live = self.kube.json_patch(api_version, kind, namespace, name, ops)
        self.on_write(kind, "patch")
        return ApplyResult(kind, name, "patched", live)

    @staticmethod
    def _metadata_ops(meta: dict, live_meta: dict) -> list[dict]:
        """Our labels, annotations and owners onto the live object, keeping everyone else's."""
        ops = []
        for field in ("labels", "annotations"):
            if live_meta.get(field) is None:
                ops.append({"op": "add", "path": f"/metadata/{field}", "value": {}})
            for key, value in (meta.get(field) or {}).items():  # the key as a JSON pointer token
                ops.append({"op": "add", "path": f"/metadata/{field}/{key.replace('~', '~0').replace('/', '~1')}",
                            "value": value})
        ops.append({"op": "add", "path": "/metadata/ownerReferences", "value": meta.get("ownerReferences", [])})
        return ops

    def _create(self, desired: dict) -> ApplyResult:
        meta = desired["metadata"]
        try:
            live = self.kube.create(desired)
        except KubeError as e:
            if e.status != 409:
                raise
            # Another writer (a previous operator instance) got there first: converge on the next pass.
            live = self.kube.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"]) or desired
            return ApplyResult(desired["kind"], meta["name"], "unchanged", live)
        self.on_write(desired["kind"], "create")
        return ApplyResult(desired["kind"], meta["name"], "created", live)

    def delete_if_managed(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        live = self.kube.get(api_version, kind, namespace, name)
        if live is None or (live.get("metadata", {}).get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
            return False
        deleted = self.kube.delete(api_version, kind, namespace, name)
        if deleted:
            self.on_write(kind, "delete")
        return deleted
