"""A thin, dict-based client over the official `kubernetes` client's connection (auth, TLS,
in-cluster or kubeconfig), and the apply of child objects.

Objects stay plain dicts from end to end: the children are built as dicts and server-side
applied with explicit content types (the generated client picks JSON-patch for every PATCH,
whatever the body)."""

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
FIELD_MANAGER = MANAGED_BY  # server-side apply: the fields the operator owns on its children
# On a replaced kind (a Job): the hash of its immutable pod template. A change that leaves the
# template as it is (a finished run's `suspend`) is applied: replacing the Job would start the
# run over, and on a real cluster the operator then looped, suspending and re-running it.
TEMPLATE_HASH_ANNOTATION = "hivekeeper.dev/template-hash"
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
    ("v1", "Event"): ("api/v1", "events"),
    ("coordination.k8s.io/v1", "Lease"): ("apis/coordination.k8s.io/v1", "leases"),
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

    def apply(self, obj: dict, field_manager: str = FIELD_MANAGER) -> dict:
        """Server-side apply: the object is created, or its fields are set to these values and the
        fields this manager set before and no longer sets are removed. `force` takes over fields
        another manager changed since (a hand edit), so they come back to the applied values."""
        meta = obj["metadata"]
        return self.request("PATCH", self.path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]),
                            body=obj, content_type="application/apply-patch+yaml",
                            query={"fieldManager": field_manager, "force": "true"})

    def replace(self, obj: dict) -> dict:
        """PUT: a whole-object update, refused (409) unless metadata.resourceVersion is still the live one."""
        meta = obj["metadata"]
        return self.request("PUT", self.path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]), body=obj)

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
# Apply


def object_hash(obj: dict) -> str:
    """A stable hash of a JSON-like value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _controller(meta: dict) -> dict | None:
    return next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)


def _resource_version(obj: dict | None) -> str | None:
    return ((obj or {}).get("metadata") or {}).get("resourceVersion")


class NameConflict(Exception):
    """An object with a child's name exists and is not managed by hivekeeper."""


@dataclass
class ApplyResult:
    kind: str
    name: str
    action: str  # created | patched | replaced | unchanged
    live: dict
    previous: dict | None = None  # the object before this apply (None: it did not exist)


class Applier:
    """Server-side apply of child objects with the operator as field manager: every apply sets
    the fields the operator wants and removes those it no longer wants, and leaves alone the
    fields other managers own (status, defaulted fields, others' labels and annotations). A hand
    edit of a field the operator sets is taken back at the next apply. A write that changes
    nothing leaves the resourceVersion as it was: `on_write(kind, action)` counts only the
    applies that created or changed an object, and deletes (metrics, tests).

    `recreate_kinds` are replaced (deleted and created) when their pod template changes: a Job's
    is immutable. `create_only_kinds` are made once and then left as they are: a bound claim's
    spec is immutable, and replacing it would lose its data."""

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
        live = self.kube.get(api_version, kind, namespace, name)
        if live is not None:
            self._check_ours(desired, live)
        if kind in self.create_only_kinds:
            if live is not None:
                return ApplyResult(kind, name, "unchanged", live, live)
            created = self.kube.create(desired)
            self.on_write(kind, "create")
            return ApplyResult(kind, name, "created", created)
        replaced = live is not None and kind in self.recreate_kinds and \
            (live["metadata"].get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION) != \
            meta["annotations"][TEMPLATE_HASH_ANNOTATION]
        if replaced:
            self.kube.delete(api_version, kind, namespace, name)
            self.on_write(kind, "delete")
        applied = self.kube.apply(desired)
        if live is None or replaced:
            self.on_write(kind, "create")
            return ApplyResult(kind, name, "replaced" if replaced else "created", applied, live)
        if _resource_version(applied) == _resource_version(live):
            return ApplyResult(kind, name, "unchanged", applied, live)
        self.on_write(kind, "patch")
        return ApplyResult(kind, name, "patched", applied, live)

    @staticmethod
    def _check_ours(desired: dict, live: dict) -> None:
        """Refuse an object someone else made under a child's name, or a child of another resource."""
        meta, live_meta = desired["metadata"], live.get("metadata", {})
        where = f"{desired['kind']} {meta['namespace']}/{meta['name']}"
        if (live_meta.get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
            raise NameConflict(f"{where} exists and is not managed by hivekeeper")
        wanted_owner, live_owner = _controller(meta), _controller(live_meta)
        if wanted_owner and live_owner and (live_owner.get("kind"), live_owner.get("name")) != (
                wanted_owner.get("kind"), wanted_owner.get("name")):
            raise NameConflict(f"{where} belongs to {live_owner.get('kind')} {live_owner.get('name')!r}")

    def delete_if_managed(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        live = self.kube.get(api_version, kind, namespace, name)
        if live is None or (live.get("metadata", {}).get("labels") or {}).get(LABEL_MANAGED_BY) != MANAGED_BY:
            return False
        deleted = self.kube.delete(api_version, kind, namespace, name)
        if deleted:
            self.on_write(kind, "delete")
        return deleted
