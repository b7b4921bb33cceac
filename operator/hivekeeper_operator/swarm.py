"""The Swarm kind in Kubernetes, as pure functions: a parsed manifest in, child objects and a
status out. Nothing here talks to the API; `reconcile.py` does, through these.

Children of a Swarm NAME (all owned by it, all labelled hivekeeper.dev/swarm=NAME):
  NAME-backbone-keys  Secret       backbone and balancer keys (generated once, so peer IDs are stable)
  NAME-config         ConfigMap    the rendered manifest and every role's `hivekeeper run` args
  NAME-backbone       StatefulSet  + headless Service: stable DNS NAME-backbone-I.NAME-backbone.NS.svc
  NAME-trainer        StatefulSet  + headless Service (each trainer's ordinal is its --index)
  NAME-auxiliary      StatefulSet  + headless Service
  NAME-balancer       StatefulSet  + headless Service: one pod; its key signs the averaging plan
  NAME-monitor        Job          + headless Service: the monitor's successful exit ends the run,
                                   as with `hivekeeper up` (a Deployment would restart it forever)
  NAME-relay          StatefulSet  + headless Service (spec.volunteers): circuit relays, keys as the backbone's
  NAME-auth           StatefulSet  + headless Service (spec.volunteers): the token service, one pod
                      and the volunteers' Secrets and external Services (`volunteers.py`)
  NAME-backbone       PodDisruptionBudget (minAvailable: 1)
  NAME                ServiceMonitor, when the Prometheus Operator's CRD is installed

Every pod's arguments come from `hivekeeper.topology.swarm_roles` with a `KubernetesNetwork`:
the same function the local runner calls. A pod template carries a config hash of what its
role reads (the manifest, less the replica counts and resources that the template itself
states, and its own arguments), so a spec change rolls exactly the roles it concerns, and
scaling rolls nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.spec import Manifest
from hivekeeper.spec.swarm import Resources, SwarmSpec
from hivekeeper.spec.volunteers import VolunteersSpec
from hivekeeper.topology import GRPC, METRICS, P2P, Role, relay_maddrs, swarm_roles, volunteer_info

from hivekeeper_operator.conditions import Cond, render_conditions, seconds_in_state
from hivekeeper_operator import volunteers
from hivekeeper_operator.kube import LABEL_MANAGED_BY, MANAGED_BY
from hivekeeper_operator.network import (
    ALLOWLIST_DIR,
    CONFIG_DIR,
    GRPC_PORT,
    INVITES_DIR,
    KEYS_DIR,
    METRICS_PORT,
    P2P_PORT,
    RUN_DIR,
    SWARM_KEY_DIR,
    KubernetesNetwork,
)

KIND = "Swarm"
API = f"{API_GROUP}/{API_VERSION}"
COMPONENTS = ("backbone", "trainer", "auxiliary", "monitor", "balancer", "relay", "auth")
STATEFUL = ("backbone", "trainer", "auxiliary", "balancer", "relay", "auth")
WITH_KEYS = ("backbone", "balancer", "relay")
STATUS_KEY = {"backbone": "backbone", "trainer": "trainers", "auxiliary": "auxiliary", "monitor": "monitor",
              "balancer": "balancer", "relay": "relays", "auth": "auth"}
CONFIG_HASH = "hivekeeper.dev/config-hash"
LABEL_SWARM = "hivekeeper.dev/swarm"
LABEL_COMPONENT = "hivekeeper.dev/component"
LABEL_METRICS = "hivekeeper.dev/metrics"
RUN_AS = 10001
MONITOR_BACKOFF_LIMIT = 10


@dataclass(frozen=True)
class WorkloadSettings:
    """How the operator runs pods: not part of a Swarm's spec, set when installing the operator."""

    image: str = "hivekeeper:latest"
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    cluster_domain: str = "cluster.local"
    shm_size: str = "1Gi"
    service_monitor_interval: str = "15s"
    progress_deadline_seconds: float = 600.0


# ---------------------------------------------------------------------------------------------
# Names and labels


def child_name(swarm: str, component: str) -> str:
    return f"{swarm}-{component}"


def config_map_name(swarm: str) -> str:
    return f"{swarm}-config"


def keys_secret_name(swarm: str) -> str:
    return f"{swarm}-backbone-keys"


def selector_labels(swarm: str, component: str) -> dict[str, str]:
    return {LABEL_SWARM: swarm, LABEL_COMPONENT: component}


def labels(swarm: str, component: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "hivekeeper",
        "app.kubernetes.io/instance": swarm,
        "app.kubernetes.io/part-of": "hivekeeper",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_SWARM: swarm,
    }
    if component:
        out["app.kubernetes.io/component"] = component
        out[LABEL_COMPONENT] = component
    return out


def trainer_selector(swarm: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(swarm, "trainer").items())


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {"apiVersion": owner.get("apiVersion", API), "kind": owner.get("kind", KIND), "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def all_children(swarm: str) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every child a Swarm can have, to delete the ones not wanted."""
    out = [("v1", "Secret", keys_secret_name(swarm)), ("v1", "ConfigMap", config_map_name(swarm)),
           ("v1", "Secret", volunteers.swarm_auth_secret_name(swarm)), ("v1", "Secret", volunteers.invites_secret_name(swarm)),
           ("v1", "Service", volunteers.gateway_service_name(swarm))]
    out += [("v1", "Service", volunteers.relay_service_name(swarm, i)) for i in range(volunteers.MAX_RELAYS)]
    for component in COMPONENTS:
        out.append(("v1", "Service", child_name(swarm, component)))
    out += [("apps/v1", "StatefulSet", child_name(swarm, c)) for c in STATEFUL]
    out += [("batch/v1", "Job", child_name(swarm, "monitor")),
            ("policy/v1", "PodDisruptionBudget", child_name(swarm, "backbone")),
            ("monitoring.coreos.com/v1", "ServiceMonitor", swarm)]
    return out


# ---------------------------------------------------------------------------------------------
# Roles and configuration


def rendered_manifest(manifest: Manifest) -> dict[str, Any]:
    """The manifest every pod reads: defaults filled in, Kubernetes metadata left out."""
    return {
        "apiVersion": manifest.api_version,
        "kind": manifest.kind,
        "metadata": {"name": manifest.metadata.name, "namespace": manifest.metadata.namespace},
        "spec": manifest.spec.model_dump(by_alias=True, mode="json", exclude_none=True),
    }


def network_of(manifest: Manifest, settings: WorkloadSettings,
               relay_hosts: list[str | None] | None = None) -> KubernetesNetwork:
    return KubernetesNetwork(manifest.metadata.name, manifest.metadata.namespace, settings.cluster_domain,
                             relay_public_hosts=relay_hosts or [], relay_port=manifest.spec.volunteers.relay_port)


def render_roles(manifest: Manifest, peer_ids: list[str], settings: WorkloadSettings,
                 balancer_id: str | None = None, relay_hosts: list[str | None] | None = None) -> list[Role]:
    return swarm_roles(manifest, network_of(manifest, settings, relay_hosts), peer_ids, f"{CONFIG_DIR}/manifest.json",
                       RUN_DIR, balancer_peer_id=balancer_id)


# The spec sections only some components read: a change to one restarts those alone (a new
# trainer batch size leaves the backbone, the auxiliaries and the monitor running). Every other
# section (task, optimizer, averaging, stopping, ...) is read by all. What a section changes in
# another component's command line (the backbone's replicas in everyone's initial peers, the
# balancer's identity) is in that component's args, hashed too.
SECTION_READERS: dict[str, tuple[str, ...]] = {
    "backbone": ("backbone",),
    "trainers": ("trainer", "balancer"),  # the balancer caps what it plans by trainers.bandwidth
    "auxiliary": ("auxiliary", "balancer"),
    "monitor": ("monitor",),
    "balancer": ("balancer",),
}


def config_hashes(manifest: Manifest, settings: WorkloadSettings, peer_ids: list[str],
                  balancer_id: str | None = None, relay_hosts: list[str | None] | None = None,
                  swarm_info: dict[str, Any] | None = None) -> dict[str, str]:
    """Per component: a hash of what its pods read at start. Replica counts and resources are
    left out (the pod template states those itself), so scaling rolls nothing, not even from
    or to zero (the arguments hashed are those of index 0, whatever the count)."""
    sample = manifest.model_copy(deep=True)
    sample.spec.trainers.replicas = max(1, sample.spec.trainers.replicas)
    sample.spec.auxiliary.replicas = max(1, sample.spec.auxiliary.replicas)
    roles = render_roles(sample, peer_ids, settings, balancer_id, relay_hosts)
    spec = rendered_manifest(manifest)["spec"]
    for section in ("trainers", "auxiliary"):
        spec.get(section, {}).pop("replicas", None)
        spec.get(section, {}).pop("resources", None)
    out = {}
    for component in COMPONENTS:
        first = next((r for r in roles if r.component == component), None)
        read = {k: v for k, v in spec.items() if component in SECTION_READERS.get(k, (component,))}
        payload = {"spec": read, "args": list(first.args) if first else None}
        if component == "auth":
            payload["swarmInfo"] = swarm_info  # what it hands volunteers (the relays' public addresses)
        out[component] = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return out


def desired_replicas(spec: SwarmSpec, completed: bool) -> dict[str, int]:
    if completed:  # as `hivekeeper up` does: the run is over, stop the peers (GPUs go free)
        return {component: 0 for component in COMPONENTS}
    door = spec.volunteers.enabled
    return {"backbone": spec.backbone.replicas, "trainer": spec.trainers.replicas,
            "auxiliary": spec.auxiliary.replicas, "monitor": 1 if spec.monitor.enabled else 0,
            "balancer": 1 if spec.balancer.enabled else 0,
            "relay": spec.volunteers.relays if door else 0, "auth": 1 if door else 0}


def enabled_components(spec: SwarmSpec) -> list[str]:
    return [c for c in COMPONENTS if (c != "monitor" or spec.monitor.enabled) and (c != "balancer" or spec.balancer.enabled)
            and (c not in ("relay", "auth") or spec.volunteers.enabled)]


# ---------------------------------------------------------------------------------------------
# Children


@dataclass
class SwarmPlan:
    """What one reconcile wants to exist for a Swarm."""

    children: list[dict[str, Any]]
    hashes: dict[str, str]
    replicas: dict[str, int]
    initial_peers: list[str]
    roles: list[Role] = field(default_factory=list)
    volunteer_gateway: str | None = None  # host:port for `hivekeeper join`, once known
    volunteer_relays: list[str] = field(default_factory=list)


@dataclass
class VolunteerAccess:
    """What a Swarm with spec.volunteers needs besides its roles (see `volunteers.py`)."""

    relay_ids: list[str]  # peer IDs of the relays (their keys are in the keys Secret)
    relay_hosts: list[str | None]  # public host of each relay, None while unknown
    auth_data: dict[str, str]  # Secret data: the signing key
    invites_data: dict[str, str]  # Secret data: every role's invite


def plan_swarm(owner: dict[str, Any], manifest: Manifest, peer_ids: list[str], keys_data: dict[str, str],
               settings: WorkloadSettings, *, balancer_id: str | None = None, completed: bool = False,
               service_monitor: bool = False, access: VolunteerAccess | None = None) -> SwarmPlan:
    spec: SwarmSpec = manifest.spec
    name, namespace = manifest.metadata.name, manifest.metadata.namespace
    assert (access is not None) == spec.volunteers.enabled, "volunteer access material iff volunteers are enabled"
    relay_hosts = access.relay_hosts if access else None
    roles = render_roles(manifest, peer_ids, settings, balancer_id, relay_hosts)
    network = network_of(manifest, settings, relay_hosts)
    info = volunteer_info(manifest, network, access.relay_ids, plan_signer=balancer_id) if access else None
    hashes = config_hashes(manifest, settings, peer_ids, balancer_id, relay_hosts, info)
    replicas = desired_replicas(spec, completed)
    owner_ref = owner_reference(owner)

    def meta(obj_name: str, component: str | None = None, extra_labels: dict[str, str] | None = None) -> dict:
        return {"name": obj_name, "namespace": namespace, "labels": {**labels(name, component), **(extra_labels or {})},
                "ownerReferences": [owner_ref]}

    config = {
        "manifest.json": json.dumps(rendered_manifest(manifest), indent=2, sort_keys=True),
        "roles.json": json.dumps({r.name: {"component": r.component, "args": list(r.args)} for r in roles},
                                 indent=2, sort_keys=True),
    }
    if info is not None:
        config["swarm-info.json"] = json.dumps(info, indent=2, sort_keys=True)
    children: list[dict[str, Any]] = [
        keys_secret(owner, name, namespace, keys_data),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(config_map_name(name)), "data": config},
    ]
    if access is not None:
        children += [_secret(meta(volunteers.swarm_auth_secret_name(name), "auth"), access.auth_data),
                     _secret(meta(volunteers.invites_secret_name(name)), access.invites_data)]
        children += volunteers.external_services(
            meta, name, spec.volunteers,
            lambda component, index: {**selector_labels(name, component),
                                       "statefulset.kubernetes.io/pod-name": f"{child_name(name, component)}-{index}"})
    components = enabled_components(spec)
    for component in components:
        children.append(_service(meta(child_name(name, component), component, {LABEL_METRICS: "true"}),
                                 name, component))
    resources = {component: _role_resources(roles, component, Resources(cpu="500m", memory="1Gi"))
                 for component in ("backbone", "monitor", "balancer", "relay", "auth")}
    resources.update({"trainer": spec.trainers.resources, "auxiliary": spec.auxiliary.resources})
    grace = int(spec.averaging.timeout_seconds + spec.averaging.matchmaking_seconds + 30)
    door = spec.volunteers if spec.volunteers.enabled else None
    for component in STATEFUL:
        if component not in components:
            continue
        template = _pod_template(name, component, resources[component], hashes[component], settings, grace,
                                 keys=component in WITH_KEYS, door=door)
        children.append({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(child_name(name, component), component),
            "spec": {
                "serviceName": child_name(name, component),
                "replicas": replicas[component],
                "podManagementPolicy": "Parallel",  # backbone peers bootstrap from each other
                "selector": {"matchLabels": selector_labels(name, component)},
                "updateStrategy": {"type": "RollingUpdate"},
                "template": template,
            },
        })
    if spec.monitor.enabled:
        template = _pod_template(name, "monitor", resources["monitor"], hashes["monitor"], settings, grace,
                                 restart_policy="OnFailure", index=0, door=door)
        children.append({
            "apiVersion": "batch/v1", "kind": "Job", "metadata": meta(child_name(name, "monitor"), "monitor"),
            "spec": {"backoffLimit": MONITOR_BACKOFF_LIMIT, "template": template},
        })
    children.append({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(child_name(name, "backbone"), "backbone"),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": selector_labels(name, "backbone")}},
    })
    if service_monitor:
        children.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta(name),
            "spec": {
                "selector": {"matchLabels": {LABEL_SWARM: name, LABEL_METRICS: "true"}},
                "endpoints": [{"port": METRICS, "path": "/metrics", "interval": settings.service_monitor_interval}],
            },
        })
    initial_peers = [network.backbone_maddr(i, P2P_PORT, pid) for i, pid in enumerate(peer_ids)]
    plan = SwarmPlan(children=children, hashes=hashes, replicas=replicas, initial_peers=initial_peers, roles=roles)
    if access is not None:
        plan.volunteer_relays = relay_maddrs(network, access.relay_ids, public=True)
        host = spec.volunteers.public_host
        plan.volunteer_gateway = f"{host}:{spec.volunteers.gateway_port}" if host else None
    return plan


def _secret(metadata: dict[str, Any], data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "data": dict(sorted(data.items()))}


def keys_secret(owner: dict[str, Any], swarm: str, namespace: str, keys_data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": keys_secret_name(swarm), "namespace": namespace, "labels": labels(swarm, "backbone"),
                         "ownerReferences": [owner_reference(owner)]},
            "type": "Opaque", "data": dict(sorted(keys_data.items()))}


def _role_resources(roles: list[Role], component: str, default: Resources) -> Resources:
    return next((r.resources for r in roles if r.component == component), default)


def _service(metadata: dict, swarm: str, component: str) -> dict:
    backbone = component.startswith("backbone")  # every kind's bootstrap peers
    ports = [{"name": METRICS, "port": METRICS_PORT, "targetPort": METRICS, "protocol": "TCP"}]
    if backbone:
        ports.append({"name": P2P, "port": P2P_PORT, "targetPort": P2P, "protocol": "TCP"})
    if component == "auth":  # peers reach the token service by the pod's DNS name
        ports.append({"name": GRPC, "port": GRPC_PORT, "targetPort": GRPC, "protocol": "TCP"})
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata,
        "spec": {
            "clusterIP": "None",  # headless: per-pod DNS, and Prometheus scrapes every pod
            # Backbone peers dial each other by name before they are ready.
            "publishNotReadyAddresses": backbone,
            "selector": selector_labels(swarm, component),
            "ports": ports,
        },
    }


def _quantity_resources(resources: Resources) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": resources.cpu, "memory": resources.memory}
    out: dict[str, Any] = {"requests": requests}
    if resources.gpu:
        requests["nvidia.com/gpu"] = resources.gpu
        out["limits"] = {"nvidia.com/gpu": resources.gpu}
    return out


def _pod_template(swarm: str, component: str, resources: Resources, config_hash: str, settings: WorkloadSettings,
                  grace: int, *, keys: bool = False, restart_policy: str = "Always",
                  index: int | None = None, door: VolunteersSpec | None = None,
                  extra_volumes: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()) -> dict[str, Any]:
    """With `door` (spec.volunteers), every pod gets its invite; the token service gets the
    signing key, the allowlist Secret and its gRPC port instead. `extra_volumes`: (volume, mount)
    pairs besides these (an ExpertPool's checkpoint claim)."""
    args = ["--component", component]
    if index is not None:
        args += ["--index", str(index)]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "run", "mountPath": RUN_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(swarm)}},
        {"name": "run", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}},
    ]
    if keys:
        mounts.append({"name": "keys", "mountPath": KEYS_DIR, "readOnly": True})
        volumes.append({"name": "keys", "secret": {"secretName": keys_secret_name(swarm), "defaultMode": 0o440}})
    for volume, mount in extra_volumes:
        volumes.append(volume)
        mounts.append(mount)
    ports = [{"name": P2P, "containerPort": P2P_PORT, "protocol": "TCP"},
             {"name": METRICS, "containerPort": METRICS_PORT, "protocol": "TCP"}]
    if door is not None and component == "auth":
        mounts.append({"name": "swarm-auth", "mountPath": SWARM_KEY_DIR, "readOnly": True})
        volumes.append({"name": "swarm-auth", "secret": {"secretName": volunteers.swarm_auth_secret_name(swarm),
                                                         "defaultMode": 0o440}})
        if door.allowlist_secret:  # the user's Secret; edits reach the file, and the service re-reads it
            mounts.append({"name": "allowlist", "mountPath": ALLOWLIST_DIR, "readOnly": True})
            volumes.append({"name": "allowlist", "secret": {"secretName": door.allowlist_secret, "defaultMode": 0o440,
                                                            "items": [{"key": "allowlist", "path": "allowlist"}]}})
        ports.append({"name": GRPC, "containerPort": GRPC_PORT, "protocol": "TCP"})
    elif door is not None:
        mounts.append({"name": "invites", "mountPath": INVITES_DIR, "readOnly": True})
        volumes.append({"name": "invites", "secret": {"secretName": volunteers.invites_secret_name(swarm),
                                                      "defaultMode": 0o440}})

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": METRICS}, "periodSeconds": period, "failureThreshold": failures,
                "timeoutSeconds": 5}

    container = {
        "name": component,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["python", "-m", "hivekeeper_operator.launch"],
        "args": args,
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HOME", "value": "/tmp"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "ports": ports,
        "resources": _quantity_resources(resources),
        "startupProbe": probe("/healthz", 5, 120),  # importing torch and building a model takes a while
        "livenessProbe": probe("/healthz", 10, 6),
        "readinessProbe": probe("/readyz", 5, 3),
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    spec: dict[str, Any] = {
        "restartPolicy": restart_policy,
        "automountServiceAccountToken": False,  # peers never talk to the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace,  # finish or abandon the averaging round
        "securityContext": {"runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS, "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in settings.image_pull_secrets]
    return {
        "metadata": {"labels": {**labels(swarm, component), **selector_labels(swarm, component)},
                     "annotations": {CONFIG_HASH: config_hash}},
        "spec": spec,
    }


# ---------------------------------------------------------------------------------------------
# Status


def job_finished(job: dict[str, Any] | None) -> str | None:
    """'Complete' or 'Failed' when a Job has that condition, else None."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"]
    return None


def job_config_hash(job: dict[str, Any] | None) -> str | None:
    return (((job or {}).get("spec") or {}).get("template", {}).get("metadata", {}).get("annotations") or {}).get(CONFIG_HASH)


def run_completed(job: dict[str, Any] | None, monitor_hash: str) -> bool:
    """The monitor of the current configuration finished the run (a Job of an older
    configuration is replaced instead)."""
    return job_finished(job) == "Complete" and job_config_hash(job) == monitor_hash


def role_status(component: str, workload: dict[str, Any] | None, desired: int) -> dict[str, int]:
    status = (workload or {}).get("status") or {}
    if component == "monitor":
        if job_finished(workload) == "Complete":
            return {"desired": desired, "replicas": 0, "ready": 0}
        return {"desired": desired, "replicas": int(status.get("active") or 0), "ready": int(status.get("ready") or 0)}
    return {"desired": desired, "replicas": int(status.get("replicas") or 0), "ready": int(status.get("readyReplicas") or 0)}


def rolling_out(workload: dict[str, Any] | None, desired: int) -> bool:
    """A StatefulSet whose controller has not caught up with its spec or its template yet."""
    if workload is None:
        return desired > 0
    meta, status = workload.get("metadata") or {}, workload.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 1):
        return True
    return int(status.get("updatedReplicas") or 0) < desired


@dataclass
class Observed:
    """What one reconcile saw of a Swarm's children and its monitor."""

    workloads: dict[str, dict[str, Any] | None]  # component -> StatefulSet (or the monitor's Job)
    monitor: dict[str, Any] | None = None  # the monitor's /status JSON, if it answered
    final_report: dict[str, Any] | None = None  # the finished monitor's result (`readers.final_report_of`)
    error: str | None = None  # an error applying children (e.g. a name conflict)
    error_reason: str = "ReconcileError"


def swarm_status(*, generation: int | None, previous: dict[str, Any] | None, now: str,
                 plan: SwarmPlan | None, observed: Observed | None, completed: bool = False,
                 invalid: str | None = None, invalid_reason: str = "InvalidSpec",
                 settings: WorkloadSettings = WorkloadSettings(), swarm: str = "") -> dict[str, Any]:
    """The whole .status of a Swarm. With `invalid` (the spec failed validation) only the
    conditions and phase change: children are left as they were."""
    previous = previous or {}
    if invalid is not None:
        return invalid_status(generation, previous, now, invalid, invalid_reason)
    status: dict[str, Any] = {"observedGeneration": generation}
    assert plan is not None and observed is not None

    roles = {c: role_status(c, observed.workloads.get(c), plan.replicas[c]) for c in COMPONENTS}
    for component, value in roles.items():
        status[STATUS_KEY[component]] = value
    desired_total = sum(r["desired"] for r in roles.values())
    ready_total = sum(min(r["ready"], r["desired"]) for r in roles.values())
    status["readyPeers"] = f"{ready_total}/{desired_total}"
    status["selector"] = trainer_selector(swarm)
    status["initialPeers"] = plan.initial_peers
    if plan.volunteer_gateway:
        status["volunteerGateway"] = plan.volunteer_gateway
    if plan.volunteer_relays:
        status["volunteerRelays"] = plan.volunteer_relays

    monitor_failed = job_finished(observed.workloads.get("monitor")) == "Failed"
    not_ready = [f"{STATUS_KEY[c]} {r['ready']}/{r['desired']}" for c, r in roles.items() if r["ready"] < r["desired"]]
    rolling = [STATUS_KEY[c] for c in STATEFUL if rolling_out(observed.workloads.get(c), plan.replicas[c])]
    running = roles["backbone"]["ready"] >= 1 and (roles["trainer"]["ready"] >= 1 or roles["trainer"]["desired"] == 0)
    status.update(lifecycle(
        previous=previous, generation=generation, now=now, settings=settings, completed=completed,
        completed_message="the monitor finished the run; peers were stopped",
        failed=f"the monitor Job failed {MONITOR_BACKOFF_LIMIT} times" if monitor_failed else None,
        failed_reason="MonitorFailed", running=running, not_ready=not_ready, rolling=rolling,
        ready_total=ready_total, desired_total=desired_total, error=observed.error,
        error_reason=observed.error_reason))
    if observed.final_report is not None:
        status.update(_final_figures(observed.final_report, previous, now))
    else:
        status.update(_monitor_figures(observed.monitor, previous, now))
    return status


def invalid_status(generation: int | None, previous: dict[str, Any], now: str, message: str,
                   reason: str) -> dict[str, Any]:
    """The status of a resource whose spec failed validation: children are left as they were."""
    return {"observedGeneration": generation, "phase": "Invalid", "conditions": render_conditions([
        Cond("Ready", False, reason, message),
        Cond("Progressing", False, reason, "nothing was changed"),
        Cond("Degraded", True, reason, message),
    ], previous.get("conditions"), generation, now)}


def lifecycle(*, previous: dict[str, Any], generation: int | None, now: str, settings: WorkloadSettings,
              completed: bool, completed_message: str, failed: str | None, failed_reason: str, running: bool,
              not_ready: list[str], rolling: list[str], ready_total: int, desired_total: int,
              error: str | None, error_reason: str) -> dict[str, Any]:
    """phase and the Ready / Progressing / Degraded conditions, the same for every kind."""
    if completed:
        phase = "Succeeded"
        ready = Cond("Ready", False, "Completed", completed_message)
        progressing = Cond("Progressing", False, "Completed", "")
    elif failed:
        phase = "Failed"
        ready = Cond("Ready", False, failed_reason, failed)
        progressing = Cond("Progressing", False, failed_reason, "")
    else:
        phase = "Running" if running else "Pending"
        if not_ready:
            ready = Cond("Ready", False, "PeersNotReady", "not ready: " + ", ".join(not_ready))
        else:
            ready = Cond("Ready", True, "AllPeersReady", f"{ready_total}/{desired_total} pods ready")
        if rolling:
            progressing = Cond("Progressing", True, "RollingOut", "updating: " + ", ".join(rolling))
        elif not_ready:
            progressing = Cond("Progressing", True, "WaitingForPeers", "starting: " + ", ".join(not_ready))
        else:
            progressing = Cond("Progressing", False, "Stable", "every role runs its current configuration")

    if error:
        degraded = Cond("Degraded", True, error_reason, error)
    elif failed:
        degraded = Cond("Degraded", True, failed_reason, failed)
    elif progressing.status and seconds_in_state(previous, "Progressing", "True", now) > settings.progress_deadline_seconds:
        degraded = Cond("Degraded", True, "ProgressDeadlineExceeded",
                        f"no steady state after {int(settings.progress_deadline_seconds)}s: {progressing.message}")
    else:
        degraded = Cond("Degraded", False, "AsExpected", "")
    return {"phase": phase,
            "conditions": render_conditions([ready, progressing, degraded], previous.get("conditions"), generation, now)}


def _final_figures(report: dict[str, Any], previous: dict[str, Any], now: str) -> dict[str, Any]:
    """The run's final figures (the monitor's result.json) over the last live reading: the
    monitor evaluates once more as it finishes, after the operator's last read."""
    reading = {"globalStep": report.get("globalStep"), "loss": report.get("loss"), "evalMetrics": report.get("metrics")}
    return {**_monitor_figures(None, previous, now), **_monitor_figures(reading, previous, now)}


def _monitor_figures(reading: dict[str, Any] | None, previous: dict[str, Any], now: str) -> dict[str, Any]:
    """Live figures from the monitor's /status; the last reading stays while it does not answer."""
    keys = ("globalStep", "samplesPerSecond", "stepsPerSecond", "plannedStepsPerSecond", "loss", "evalMetrics",
            "peersAlive")
    if not reading:
        return {k: previous[k] for k in keys + ("lastMonitorUpdate",) if k in previous}
    figures: dict[str, Any] = {}
    if isinstance(reading.get("globalStep"), int):
        figures["globalStep"] = max(0, reading["globalStep"])
    if isinstance(reading.get("samplesPerSecond"), (int, float)):
        figures["samplesPerSecond"] = round(max(0.0, float(reading["samplesPerSecond"])), 1)
    if isinstance(reading.get("stepsPerSecond"), (int, float)):
        figures["stepsPerSecond"] = round(max(0.0, float(reading["stepsPerSecond"])), 4)
    planned = (reading.get("plan") or {}).get("stepsPerSecond") if isinstance(reading.get("plan"), dict) else None
    if isinstance(planned, (int, float)):
        figures["plannedStepsPerSecond"] = round(max(0.0, float(planned)), 4)
    if isinstance(reading.get("loss"), (int, float)):
        figures["loss"] = round(float(reading["loss"]), 6)
    if isinstance(reading.get("evalMetrics"), dict):
        figures["evalMetrics"] = {k: float(v) for k, v in reading["evalMetrics"].items() if isinstance(v, (int, float))}
    if isinstance(reading.get("peersAlive"), dict):
        figures["peersAlive"] = {k: int(v) for k, v in reading["peersAlive"].items() if isinstance(v, int)}
    changed = any(previous.get(k) != v for k, v in figures.items())
    figures["lastMonitorUpdate"] = now if changed or "lastMonitorUpdate" not in previous else previous["lastMonitorUpdate"]
    return figures
