"""Names, labels and the object shapes every kind's children share: the headless Service of a
component and the pod template its pods run (`python -m hivekeeper_operator.launch`, which
picks the pod's own role from the ConfigMap), placed as its role group's placement asks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.errors import UserError
from hivekeeper.spec.common import Resources
from hivekeeper.spec.join import INVITE_KEY
from hivekeeper.spec.placement import Placement
from hivekeeper.spec.volunteers import VolunteersSpec
from hivekeeper.topology import GRPC, JOIN_INVITE, METRICS, P2P, Role

from hivekeeper_operator import volunteers
from hivekeeper_operator.kube import LABEL_MANAGED_BY, MANAGED_BY
from hivekeeper_operator.network import (ALLOWLIST_DIR, CONFIG_DIR, GRPC_PORT, INVITES_DIR, JOIN_DIR, KEYS_DIR,
                                         METRICS_PORT, P2P_PORT, RUN_DIR, SWARM_KEY_DIR)

API = f"{API_GROUP}/{API_VERSION}"
CONFIG_HASH = "hivekeeper.dev/config-hash"
# The resource a child belongs to, for every kind. Named after the first kind; kept because it is
# in every StatefulSet's and PodDisruptionBudget's immutable selector, the status' scale
# selector, the ServiceMonitor's and dashboards' and alerts' queries.
LABEL_INSTANCE = "hivekeeper.dev/swarm"
LABEL_COMPONENT = "hivekeeper.dev/component"
LABEL_METRICS = "hivekeeper.dev/metrics"
# On the keys Secret: the other Secrets the resource owns. Secrets are never listed (the chart
# grants no `list` on them), so the owner scan finds the ones to delete here.
SECRETS_ANNOTATION = "hivekeeper.dev/owned-secrets"
RUN_AS = 10001
LAUNCHER_ENV = ("JOB_COMPLETION_INDEX",)  # set by Kubernetes in a Job's pods; the launcher reads it


class PlacementConflict(UserError):
    """A placement names a volume, mount path or variable hivekeeper's own pods use."""


@dataclass(frozen=True)
class WorkloadSettings:
    """How the operator runs pods: not part of a resource's spec, set when installing the operator."""

    image: str = "hivekeeper:latest"
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    cluster_domain: str = "cluster.local"
    shm_size: str = "1Gi"
    service_monitor_interval: str = "15s"
    # On each resource's ServiceMonitor, for Prometheus's serviceMonitorSelector (kube-prometheus-stack: release).
    service_monitor_labels: tuple[tuple[str, str], ...] = ()
    progress_deadline_seconds: float = 600.0


def child_name(name: str, component: str) -> str:
    return f"{name}-{component}"


def config_map_name(name: str) -> str:
    return f"{name}-config"


def keys_secret_name(name: str) -> str:
    return f"{name}-backbone-keys"


def selector_labels(name: str, component: str) -> dict[str, str]:
    return {LABEL_INSTANCE: name, LABEL_COMPONENT: component}


def selector(name: str, component: str | None = None) -> str:
    labels_ = selector_labels(name, component) if component else {LABEL_INSTANCE: name}
    return ",".join(f"{k}={v}" for k, v in labels_.items())


def labels(name: str, component: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "hivekeeper", "app.kubernetes.io/instance": name,
           "app.kubernetes.io/part-of": "hivekeeper", LABEL_MANAGED_BY: MANAGED_BY, LABEL_INSTANCE: name}
    if component:
        out["app.kubernetes.io/component"] = component
        out[LABEL_COMPONENT] = component
    return out


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": owner.get("apiVersion", API), "kind": owner["kind"], "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def metadata(owner: dict[str, Any], name: str, component: str | None = None,
             extra_labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A child's metadata: its labels and the owner reference that takes it with its owner."""
    meta = owner["metadata"]
    return {"name": name, "namespace": meta["namespace"],
            "labels": {**labels(meta["name"], component), **(extra_labels or {})},
            "ownerReferences": [owner_reference(owner)]}


def secret(meta: dict[str, Any], data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": dict(sorted(data.items()))}


def keys_secret(owner: dict[str, Any], keys_data: dict[str, str], owned_secrets: list[str]) -> dict[str, Any]:
    meta = metadata(owner, keys_secret_name(owner["metadata"]["name"]), "backbone")
    meta["annotations"] = {SECRETS_ANNOTATION: ",".join(sorted(owned_secrets))}
    return secret(meta, keys_data)


def owned_secrets(keys: dict[str, Any] | None) -> set[str]:
    text = (((keys or {}).get("metadata") or {}).get("annotations") or {}).get(SECRETS_ANNOTATION) or ""
    return set(filter(None, text.split(",")))


def service(meta: dict[str, Any], name: str, component: str, role: Role) -> dict[str, Any]:
    """The headless Service of a component: per-pod DNS, and Prometheus scrapes every pod."""
    ports = [{"name": METRICS, "port": METRICS_PORT, "targetPort": METRICS, "protocol": "TCP"}]
    if role.backbone:  # others dial the bootstrap peers by name
        ports.append({"name": P2P, "port": P2P_PORT, "targetPort": P2P, "protocol": "TCP"})
    if GRPC in role.ports:  # peers reach the token service by the pod's DNS name
        ports.append({"name": GRPC, "port": GRPC_PORT, "targetPort": GRPC, "protocol": "TCP"})
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"clusterIP": "None",
                     # Backbone peers dial each other by name before they are ready.
                     "publishNotReadyAddresses": role.backbone,
                     "selector": selector_labels(name, component), "ports": ports}}


def quantity_resources(resources: Resources) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": resources.cpu, "memory": resources.memory}
    out: dict[str, Any] = {"requests": requests}
    if resources.gpu:  # an extended resource: its request must equal its limit
        requests[resources.gpu_resource] = resources.gpu
        out["limits"] = {resources.gpu_resource: resources.gpu}
    return out


def _secret_volume(volume: str, secret_name: str, mount_path: str,
                   **source: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return ({"name": volume, "secret": {"secretName": secret_name, "defaultMode": 0o440, **source}},
            {"name": volume, "mountPath": mount_path, "readOnly": True})


def join_invite_volume(secret_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A joining lab's invite (the user's Secret named by spec.join.inviteSecret): every pod asks
    the host's token service for its own token with it."""
    return _secret_volume("join-invite", secret_name, JOIN_DIR, items=[{"key": INVITE_KEY, "path": JOIN_INVITE}])


def _access_volumes(name: str, role: Role, door: VolunteersSpec) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Where volunteers are admitted, every pod gets its invite; the token service gets the
    signing key and the allowlist Secret instead."""
    if role.component != volunteers.TOKEN_SERVICE:
        return [_secret_volume("invites", volunteers.invites_secret_name(name), INVITES_DIR)]
    out = [_secret_volume("swarm-auth", volunteers.swarm_auth_secret_name(name), SWARM_KEY_DIR)]
    if door.allowlist_secret:  # the user's Secret; edits reach the file, and the service re-reads it
        out.append(_secret_volume("allowlist", door.allowlist_secret, ALLOWLIST_DIR,
                                  items=[{"key": "allowlist", "path": "allowlist"}]))
    return out


def check_own_names(component: str, pairs: list[tuple[dict[str, Any], dict[str, Any]]], env: list[dict[str, Any]],
                    placement: Placement) -> None:
    """A placement's volumes, mounts and variables beside the pod's own: no name or mount path
    taken twice, and no mount inside a read-only volume of the pod's own (it could not be made)."""
    where = f"placement of the {component} pods"
    own_volumes = sorted(volume["name"] for volume, _ in pairs)
    for volume in placement.volumes:
        if volume.name in own_volumes:
            raise PlacementConflict(f"{where}: volume {volume.name!r} is one of hivekeeper's own "
                                    f"({', '.join(own_volumes)}); rename it")
    for mount in placement.volume_mounts:
        for _, own in pairs:
            inside = mount.mount_path.startswith(own["mountPath"].rstrip("/") + "/") and own.get("readOnly")
            if mount.mount_path == own["mountPath"] or inside:
                raise PlacementConflict(f"{where}: mountPath {mount.mount_path} is {'inside ' if inside else ''}"
                                        f"hivekeeper's own {own['name']} volume at {own['mountPath']}; mount elsewhere")
    own_env = sorted({variable["name"] for variable in env} | set(LAUNCHER_ENV))
    for variable in placement.env:
        if variable.name in own_env:
            raise PlacementConflict(f"{where}: env {variable.name} is set by hivekeeper ({', '.join(own_env)})")


def _place(template: dict[str, Any], placement: Placement) -> None:
    """The placement's scheduling fields, labels, annotations, variables and volumes onto a pod
    template whose own names it was checked against."""
    meta, spec = template["metadata"], template["spec"]
    container = spec["containers"][0]
    meta["labels"] = {**placement.labels, **meta["labels"]}
    meta["annotations"] = {**placement.annotations, **meta["annotations"]}
    if placement.node_selector:
        spec["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in placement.tolerations]
    if placement.affinity is not None:
        spec["affinity"] = placement.affinity
    if placement.priority_class_name:
        spec["priorityClassName"] = placement.priority_class_name
    if placement.scheduler_name:
        spec["schedulerName"] = placement.scheduler_name
    container["env"] += [e.model_dump(by_alias=True, exclude_none=True) for e in placement.env]
    container["volumeMounts"] += [m.model_dump(by_alias=True, exclude_none=True) for m in placement.volume_mounts]
    spec["volumes"] += [v.model_dump(by_alias=True) for v in placement.volumes]


def pod_template(name: str, role: Role, config_hash: str, settings: WorkloadSettings, grace: int, *,
                 keys: bool, restart_policy: str = "Always", door: VolunteersSpec | None = None,
                 extra_volumes: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()) -> dict[str, Any]:
    """The pod of one of a component's roles (`role` stands for them all), with its placement.
    `extra_volumes`: (volume, mount) pairs besides the usual ones (the kind's `storage`)."""
    component = role.component
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"name": "config", "configMap": {"name": config_map_name(name)}},
         {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}),
        ({"name": "run", "emptyDir": {}}, {"name": "run", "mountPath": RUN_DIR}),
        ({"name": "tmp", "emptyDir": {}}, {"name": "tmp", "mountPath": "/tmp"}),
        ({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}},
         {"name": "shm", "mountPath": "/dev/shm"}),
    ]
    if keys:
        pairs.append(_secret_volume("keys", keys_secret_name(name), KEYS_DIR))
    pairs += list(extra_volumes)
    if door is not None:
        pairs += _access_volumes(name, role, door)
    p2p: dict[str, Any] = {"name": P2P, "containerPort": P2P_PORT, "protocol": "TCP"}
    if role.exposure.expose == "HostPort":  # one peer of the group per node: the scheduler sees to it
        p2p["hostPort"] = role.exposure.public_port(role.index)
    ports = [p2p, {"name": METRICS, "containerPort": METRICS_PORT, "protocol": "TCP"}]
    if GRPC in role.ports:
        ports.append({"name": GRPC, "containerPort": GRPC_PORT, "protocol": "TCP"})

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": METRICS}, "periodSeconds": period, "failureThreshold": failures,
                "timeoutSeconds": 5}

    container = {
        "name": component, "image": settings.image, "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-m", "hivekeeper_operator.launch"], "args": ["--component", component],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
            # the node's IP, which a peer exposed at a node or host port announces
            *([{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]
              if role.exposure.expose in ("NodePort", "HostPort") else []),
        ],
        "ports": ports, "resources": quantity_resources(role.resources),
        "startupProbe": probe("/healthz", 5, 120),  # importing torch and building a model takes a while
        "livenessProbe": probe("/healthz", 10, 6),
        "readinessProbe": probe("/readyz", 5, 3),
        "volumeMounts": [mount for _, mount in pairs],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "automountServiceAccountToken": False,  # peers never talk to the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace,  # finish or abandon the averaging round
        "securityContext": {"runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS, "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [volume for volume, _ in pairs],
    }
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    check_own_names(component, pairs, container["env"], role.placement)
    template = {"metadata": {"labels": labels(name, component), "annotations": {CONFIG_HASH: config_hash}},
                "spec": spec}
    _place(template, role.placement)
    return template
