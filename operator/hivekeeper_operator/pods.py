"""Names, labels and the object shapes every kind's children share: the headless Service of a
component and the pod template its pods run (`python -m hivekeeper_operator.launch`, which
picks the pod's own role from the ConfigMap)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.spec.common import Resources
from hivekeeper.spec.volunteers import VolunteersSpec
from hivekeeper.topology import GRPC, METRICS, P2P, Role

from hivekeeper_operator import volunteers
from hivekeeper_operator.kube import LABEL_MANAGED_BY, MANAGED_BY
from hivekeeper_operator.network import (ALLOWLIST_DIR, CONFIG_DIR, GRPC_PORT, INVITES_DIR, KEYS_DIR, METRICS_PORT,
                                         P2P_PORT, RUN_DIR, SWARM_KEY_DIR)

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


@dataclass(frozen=True)
class WorkloadSettings:
    """How the operator runs pods: not part of a resource's spec, set when installing the operator."""

    image: str = "hivekeeper:latest"
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    cluster_domain: str = "cluster.local"
    shm_size: str = "1Gi"
    service_monitor_interval: str = "15s"
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
    if resources.gpu:
        requests["nvidia.com/gpu"] = resources.gpu
        out["limits"] = {"nvidia.com/gpu": resources.gpu}
    return out


def _secret_volume(volume: str, secret_name: str, mount_path: str,
                   **source: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return ({"name": volume, "secret": {"secretName": secret_name, "defaultMode": 0o440, **source}},
            {"name": volume, "mountPath": mount_path, "readOnly": True})


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


def pod_template(name: str, role: Role, config_hash: str, settings: WorkloadSettings, grace: int, *,
                 keys: bool, restart_policy: str = "Always", door: VolunteersSpec | None = None,
                 extra_volumes: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()) -> dict[str, Any]:
    """The pod of one of a component's roles (`role` stands for them all). `extra_volumes`:
    (volume, mount) pairs besides the usual ones (an ExpertPool's checkpoint claim)."""
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
    ports = [{"name": P2P, "containerPort": P2P_PORT, "protocol": "TCP"},
             {"name": METRICS, "containerPort": METRICS_PORT, "protocol": "TCP"}]
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
    return {"metadata": {"labels": labels(name, component), "annotations": {CONFIG_HASH: config_hash}}, "spec": spec}
