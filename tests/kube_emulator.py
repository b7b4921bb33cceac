"""A Kubernetes API for the operator's tests: kmock's `KubernetesEmulator` with the small shim the operator
needs (below), served on 127.0.0.1 from a thread of its own, with a kubeconfig that both kopf and
the official client read.

The shim does what a kube-apiserver does and the emulator does not:
- on create: fill metadata.namespace, uid, resourceVersion, generation, creationTimestamp;
- on every write: bump resourceVersion (kopf JSON-patches with a `test` on it);
- bump metadata.generation when a write changes `spec`;
- keep a `/status` write off everything but `status`, and a main-resource write off `status`
  for kinds that have the status subresource;
- garbage-collect objects whose owners (by ownerReferences uid) are all gone, as the real
  garbage collector does (`propagationPolicy: Background`), also for objects created late
  for an owner already deleted;
- serve a custom resource's `/scale` (GET and PATCH) as an autoscaling/v1 Scale mapped onto the
  CRD's specReplicasPath, statusReplicasPath and labelSelectorPath (`kubectl scale`, an HPA):
  the emulator would merge a Scale patch into the object as it is;
- server-side apply (PATCH application/apply-patch+yaml with a fieldManager): create the object
  if it is absent; else remove the fields this manager applied last time and no longer applies
  (its managedFields entry records them), and merge the applied fields over the live object, so
  that a hand edit of an applied field is set back and other fields stay. Simplified: lists are
  atomic (the real one merges lists keyed by name, port...), other managers' ownership is not
  tracked (force is assumed), and an apply that changes nothing writes nothing (no new
  resourceVersion, no watch event), as in the real one;
- PUT (a whole-object update) with the resourceVersion precondition: 409 if it is not the live one.
It validates nothing against CRD schemas: tests check that with `hivekeeper.spec.crd`.

kmock and attrs are test dependencies: importing this module needs the `operator-test` extra.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import threading
import uuid
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpointer
import kmock
import yaml
from kmock._internal import enums

# Resources the operator reads or writes, with their discovery information.
CORE_RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": dict(kind="Namespace", namespaced=False),
    "v1/events": dict(kind="Event", namespaced=True),
    "v1/configmaps": dict(kind="ConfigMap", namespaced=True),
    "v1/secrets": dict(kind="Secret", namespaced=True),
    "v1/services": dict(kind="Service", namespaced=True),
    "v1/persistentvolumeclaims": dict(kind="PersistentVolumeClaim", namespaced=True, subresources={"status"}),
    "v1/pods": dict(kind="Pod", namespaced=True),
    "apps/v1/statefulsets": dict(kind="StatefulSet", namespaced=True, subresources={"status", "scale"}),
    "apps/v1/deployments": dict(kind="Deployment", namespaced=True, subresources={"status", "scale"}),
    "batch/v1/jobs": dict(kind="Job", namespaced=True, subresources={"status"}),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", namespaced=True, subresources={"status"}),
    "coordination.k8s.io/v1/leases": dict(kind="Lease", namespaced=True),
}
# How long a test waits for the emulator's loop to run one of its calls (see Emulator.call).
CALL_TIMEOUT = 60.0
SERVICE_MONITORS = {"monitoring.coreos.com/v1/servicemonitors": dict(kind="ServiceMonitor", namespaced=True)}

_ABSENT = object()
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ShimmedEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with the apiserver behaviour listed in the module docstring."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(2), init=False)
    _status_kinds: set = attrs.field(factory=set, init=False)
    _scales: dict = attrs.field(factory=dict, init=False)  # resource -> the CRD's scale subresource paths

    def declare(self, resources: dict[str, dict[str, Any]]) -> None:
        for key, info in resources.items():
            info = dict(info)
            subresources = set(info.pop("subresources", set()))
            scale = info.pop("scale", None)
            if scale:
                self._scales[kmock.resource(key)] = scale
            self.resources[key] = kmock.ResourceInfo(verbs=VERBS, subresources=subresources, **info)
            if "status" in subresources:
                self._status_kinds.add(kmock.resource(key))

    async def _handle(self, request):  # type: ignore[override]
        resource = request.resource
        if resource is not None and request.name is not None and request.subresource is None:
            if request.action == enums.action.UPDATE and \
                    request.headers.get("Content-Type", "").startswith("application/apply-patch"):
                return aiohttp.web.json_response(await self._server_side_apply(request))
            if request.method == "PUT":
                return aiohttp.web.json_response(await self._replace(request))
        scale = self._scale_paths(request) if request.subresource == "scale" else None
        if scale is not None and request.action == enums.action.FETCH:
            return aiohttp.web.json_response(self._scale_of(request, scale))
        if scale is not None and request.action == enums.action.UPDATE:
            await self._patch_scale(request, scale)
            return aiohttp.web.json_response(self._scale_of(request, scale))
        if resource is not None and request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            meta["uid"] = str(uuid.uuid4())
            meta["resourceVersion"] = str(next(self._versions))
            meta["generation"] = 1
            meta["creationTimestamp"] = _now()
            request.data.pop("status", None) if self._has_status(resource) else None
        elif resource is not None and request.action == enums.action.UPDATE and request.name is not None:
            self._check_json_patch_tests(request)
            self._shim_update((request.resource, request.namespace, request.name), request.subresource, request.data)
        response = await super()._handle(request)
        if resource is not None and request.action in (enums.action.DELETE, enums.action.CREATE, enums.action.UPDATE):
            # The real garbage collector also removes objects created (late) for an owner that is gone.
            await self._collect_garbage()
        return response

    async def _server_side_apply(self, request: Any) -> dict[str, Any]:
        manager = request.params.get("fieldManager")
        if not manager:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="fieldManager is required for apply")
        applied = copy.deepcopy(request.data) if isinstance(request.data, dict) else None
        if not applied or applied.get("metadata", {}).get("name") != request.name:
            raise kmock.KubernetesError(status=400, reason="BadRequest", message="apply needs the object, named as in the URL")
        key = (request.resource, request.namespace, request.name)
        if self._has_status(request.resource):
            applied.pop("status", None)
        entry = {"manager": manager, "operation": "Apply", "apiVersion": applied.get("apiVersion"), "time": _now(),
                 "fieldsType": "FieldsV1", "fieldsV1": _fields(applied)}
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                meta = applied.setdefault("metadata", {})
                meta.update(namespace=request.namespace, uid=str(uuid.uuid4()), resourceVersion=str(next(self._versions)),
                            generation=1, creationTimestamp=_now(), managedFields=[entry])
                if key in self.objects:
                    self.objects[key].create(applied)
                else:
                    self.objects[key] = applied
                event = "ADDED"
            else:
                current = copy.deepcopy(self.objects[key].raw)
                entries = current.get("metadata", {}).get("managedFields") or []
                previous = next((e["fieldsV1"] for e in entries if e.get("manager") == manager
                                 and e.get("operation") == "Apply"), {})
                merged = _merge(_without(current, previous, entry["fieldsV1"]), applied)
                merged["metadata"]["managedFields"] = [e for e in entries if e.get("manager") != manager
                                                       or e.get("operation") != "Apply"] + [entry]
                if _same(merged, current):
                    return current
                merged["metadata"]["resourceVersion"] = str(next(self._versions))
                if merged.get("spec") != current.get("spec"):
                    merged["metadata"]["generation"] = int(current["metadata"].get("generation") or 1) + 1
                self.objects[key].create(merged)
                event = "MODIFIED"
            raw = self.objects[key].raw
            await self._buses[request.resource].put({"type": event, "object": raw})
        await self._collect_garbage()
        return raw

    async def _replace(self, request: Any) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        new = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
            current = self.objects[key].raw
            meta, live_meta = new.setdefault("metadata", {}), current["metadata"]
            if meta.get("resourceVersion") != live_meta.get("resourceVersion"):
                raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                    f"the object has been modified: resourceVersion {meta.get('resourceVersion')!r} is not the live "
                    f"{live_meta.get('resourceVersion')!r}"))
            for field in ("uid", "creationTimestamp", "namespace", "name"):
                meta[field] = live_meta.get(field)
            if self._has_status(request.resource):
                new["status"] = current.get("status")
            meta["resourceVersion"] = str(next(self._versions))
            meta["generation"] = int(live_meta.get("generation") or 1) + (new.get("spec") != current.get("spec"))
            self.objects[key].create(new)
            raw = self.objects[key].raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return raw

    async def _patch_scale(self, request: Any, paths: dict[str, str]) -> None:
        """A Scale patch becomes a patch of the CRD's specReplicasPath, as the apiserver makes it."""
        key = (request.resource, request.namespace, request.name)
        data = _nested(paths["specReplicasPath"], _scale_replicas(request.data))
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
            self._shim_update(key, None, data)
            self.objects[key].patch(data)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": self.objects[key].raw})

    def _scale_paths(self, request: Any) -> dict[str, str] | None:
        return next((paths for resource, paths in self._scales.items() if request.resource == resource), None)

    def _scale_of(self, request: Any, paths: dict[str, str]) -> dict[str, Any]:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
        obj = self.objects[key].raw
        meta = obj.get("metadata", {})
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": _lookup(obj, paths["specReplicasPath"]) or 0},
                "status": {"replicas": _lookup(obj, paths["statusReplicasPath"]) or 0,
                           "selector": _lookup(obj, paths.get("labelSelectorPath", "")) or ""}}

    def _has_status(self, resource: Any) -> bool:
        return any(resource == known for known in self._status_kinds)

    def _check_json_patch_tests(self, request: Any) -> None:
        """A failed `test` op is 422 Unprocessable Entity, as kopf expects (the emulator says 500)."""
        key = (request.resource, request.namespace, request.name)
        if not isinstance(request.data, list) or key not in self.objects or self.objects[key].deleted:
            return
        current = self.objects[key].raw
        for op in request.data:
            if op.get("op") != "test":
                continue
            try:
                value = jsonpointer.resolve_pointer(current, op["path"])
            except jsonpointer.JsonPointerException:
                value = _ABSENT
            if value != op.get("value"):
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message=f"test failed at {op['path']}: {value!r} != {op.get('value')!r}")

    def _shim_update(self, key: tuple[Any, str | None, str], subresource: str | None, data: Any) -> None:
        """Bump resourceVersion (and generation on a spec change) and keep `status` apart, in `data`."""
        if key not in self.objects or self.objects[key].deleted:
            return  # the emulator answers 404
        current = self.objects[key]
        version = str(next(self._versions))
        generation = int(current.get("metadata", {}).get("generation") or 1)
        status_only = subresource == "status"
        keep_status_off = not status_only and self._has_status(key[0])
        if isinstance(data, dict):
            if status_only:
                for k in [k for k in data if k != "status"]:
                    del data[k]
            elif keep_status_off:
                data.pop("status", None)
            meta = data.setdefault("metadata", {}) if not status_only else None
            if "spec" in data and data["spec"] != current.get("spec"):
                generation += 1
            data.setdefault("metadata", meta or {})["resourceVersion"] = version
            data["metadata"]["generation"] = generation
        elif isinstance(data, list):
            if status_only:
                data[:] = [op for op in data if op.get("op") == "test" or str(op.get("path", "")).startswith("/status")]
            elif keep_status_off:
                data[:] = [op for op in data if not str(op.get("path", "")).startswith("/status")]
            if any(str(op.get("path", "")).startswith("/spec") and op.get("op") != "test" for op in data):
                generation += 1
            data.append({"op": "add", "path": "/metadata/resourceVersion", "value": version})
            data.append({"op": "add", "path": "/metadata/generation", "value": generation})

    async def _collect_garbage(self) -> None:
        """Delete (recursively) every object whose owners are all gone."""
        while True:
            async with self._lock:
                alive = {obj.get("metadata", {}).get("uid") for obj in self.objects.values() if not obj.deleted}
                orphans = []
                for (resource, namespace, name), obj in self.objects.items():
                    if obj.deleted:
                        continue
                    owners = obj.get("metadata", {}).get("ownerReferences") or []
                    if owners and not any(o.get("uid") in alive for o in owners):
                        orphans.append((resource, namespace, name))
                for key in orphans:
                    obj = self.objects[key]
                    raw = copy.deepcopy(obj.raw)
                    obj.delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})
            if not orphans:
                return


def _fields(applied: Any) -> dict[str, Any]:
    """The fields an applied object sets, as a FieldsV1 set: {"f:spec": {"f:replicas": {}}}.
    A list, a scalar and an empty map are leaves."""
    if isinstance(applied, dict) and applied:
        return {f"f:{key}": _fields(value) for key, value in applied.items()}
    return {}


def _without(live: dict[str, Any], previous: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """`live` less the fields in the `previous` set that are not in the `now` set."""
    out = dict(live)
    for field, below in previous.items():
        key = field.removeprefix("f:")
        if field not in now:
            out.pop(key, None)
        elif below and now[field] and isinstance(out.get(key), dict):
            out[key] = _without(out[key], below, now[field])
    return out


def _merge(live: Any, applied: Any) -> Any:
    """`applied` over `live`: maps merge, anything else is replaced."""
    if not (isinstance(live, dict) and isinstance(applied, dict)):
        return copy.deepcopy(applied)
    out = dict(live)
    for key, value in applied.items():
        out[key] = _merge(live.get(key), value)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal but for the managedFields' times (a no-op apply leaves those as they were)."""
    def clean(obj: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        for entry in out.get("metadata", {}).get("managedFields") or []:
            entry.pop("time", None)
        return out

    return clean(a) == clean(b)


def _lookup(obj: dict[str, Any], json_path: str) -> Any:
    """The value at a CRD's simple JSON path (".spec.servers.replicas"), or None."""
    node: Any = obj
    for part in filter(None, json_path.split(".")):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _nested(json_path: str, value: Any) -> dict[str, Any]:
    """{"spec": {"servers": {"replicas": value}}} for ".spec.servers.replicas"."""
    out: Any = value
    for part in reversed(json_path.strip(".").split(".")):
        out = {part: out}
    return out


def _scale_replicas(patch: Any) -> int:
    """spec.replicas from a Scale merge patch or JSON patch (what `kubectl scale` and an HPA send)."""
    if isinstance(patch, dict) and isinstance((patch.get("spec") or {}).get("replicas"), int):
        return patch["spec"]["replicas"]
    for op in patch if isinstance(patch, list) else []:
        if op.get("op") in ("add", "replace") and op.get("path") == "/spec/replicas" and isinstance(op.get("value"), int):
            return op["value"]
    raise kmock.KubernetesError(status=422, reason="Invalid", message="a Scale patch sets spec.replicas")


class EmulatedCluster:
    """The shimmed emulator on 127.0.0.1 in a background thread, plus a kubeconfig for it.

        with EmulatedCluster(tmp_path) as cluster:
            os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
            ...
            cluster.object("apps/v1/statefulsets", "default", "digits-trainer")
    """

    def __init__(self, directory: Path, crds: list[dict[str, Any]] | None = None, service_monitors: bool = False):
        self.directory = Path(directory)
        self.kubeconfig = self.directory / f"kubeconfig-{id(self):x}.yaml"
        self._crds = crds or []
        self._service_monitors = service_monitors
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="kube-emulator", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.emulator: ShimmedEmulator | None = None
        self.url = ""
        self._error: BaseException | None = None

    def __enter__(self) -> "EmulatedCluster":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        if self._error:
            raise self._error
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "test",
                                                          "namespace": "default"}}],
            "current-context": "emulator",
        }))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.loop and self._stop:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _serve(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            async with ShimmedEmulator() as emulator, kmock.Server(emulator) as server:
                emulator.declare(CORE_RESOURCES)
                if self._service_monitors:
                    emulator.declare(SERVICE_MONITORS)
                for crd in self._crds:
                    emulator.declare(crd_resources(crd))
                self.emulator = emulator
                self.url = str(server.url).rstrip("/")
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(main())
        except BaseException as e:  # surfaced by __enter__
            self._error = e
            self._ready.set()

    def call(self, fn: Any) -> Any:
        """Run `fn()` in the emulator's loop (its state is not thread-safe) and return the result.
        The loop shares the test process with the operator under test, and on two saturated
        cores (the unit tier beside the cluster tier) it waited its turn over 10 s in CI: the
        wait allowed is the tests' longest, so only a loop that is gone fails it."""
        assert self.loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(CALL_TIMEOUT)

    def object(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The stored object, or None if it does not exist (or was deleted)."""

        def read() -> dict[str, Any] | None:
            key = (kmock.resource(resource), namespace, name)
            if key not in self.emulator.objects or self.emulator.objects[key].deleted:
                return None
            return copy.deepcopy(self.emulator.objects[key].raw)

        return self.call(read)

    def objects(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every live object of a resource (in a namespace, if given)."""

        def read() -> list[dict[str, Any]]:
            wanted = kmock.resource(resource)
            return [copy.deepcopy(obj.raw) for (res, ns, _), obj in self.emulator.objects.items()
                    if res == wanted and not obj.deleted and (namespace is None or ns == namespace)]

        return self.call(read)

    def set_status(self, resource: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """What a controller (the StatefulSet or Job controller) would write."""

        def write() -> None:
            obj = self.emulator.objects[kmock.resource(resource), namespace, name]
            obj.patch({"status": status, "metadata": {"resourceVersion": str(next(self.emulator._versions))}})

        self.call(write)


def crd_resources(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The discovery entry the emulator needs for a CustomResourceDefinition document."""
    spec = crd["spec"]
    out = {}
    for version in spec["versions"]:
        key = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
        out[key] = dict(
            kind=spec["names"]["kind"],
            namespaced=spec["scope"] == "Namespaced",
            singular=spec["names"].get("singular"),
            shortnames=set(spec["names"].get("shortNames", [])),
            categories=set(spec["names"].get("categories", [])),
            subresources=set(version.get("subresources", {})),
            scale=version.get("subresources", {}).get("scale"),
        )
    return out
