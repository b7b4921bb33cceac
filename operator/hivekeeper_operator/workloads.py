"""Kinds planned from their roles alone (BlockServer, ExpertPool), as pure functions: a parsed
manifest in, child objects and a status out. The roles come from the kind's runtime in
`hivekeeper.kinds`, the same function `hivekeeper up` calls, with a `KubernetesNetwork`.

Children of a resource NAME (owned by it, labelled hivekeeper.dev/swarm=NAME):
  NAME-backbone-keys  Secret       keys of the roles others must know in advance (made once)
  NAME-config         ConfigMap    the rendered manifest and every role's `hivekeeper run` args
  NAME-COMPONENT      StatefulSet  + headless Service, one per component (a role's index is its
                                   pod's ordinal); a component whose roles end the run is an
                                   Indexed Job instead (index = completion index), so that its
                                   successful exit is not restarted forever
  NAME-COMPONENT      PodDisruptionBudget (minAvailable: 1) for backbone components
  NAME-checkpoints    PersistentVolumeClaim (ExpertPool spec.checkpoint.volumeClaim): made once,
                      shared by the expert servers, kept until the pool goes (`storage.py`)
  NAME                ServiceMonitor, when the Prometheus Operator's CRD is installed
Pod templates, config hashes and conditions are the Swarm's (`swarm.py`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from hivekeeper.kinds import KindRuntime, runtime
from hivekeeper.spec import Manifest
from hivekeeper.spec.crd import KINDS, RoleStatus
from hivekeeper.topology import METRICS, Role

from hivekeeper_operator.network import CONFIG_DIR, METRICS_PORT, P2P_PORT, RUN_DIR, KubernetesNetwork
from hivekeeper_operator.storage import checkpoint_storage
from hivekeeper_operator.swarm import (
    LABEL_METRICS,
    LABEL_SWARM,
    MONITOR_BACKOFF_LIMIT,
    WorkloadSettings,
    _pod_template,
    _service,
    child_name,
    config_map_name,
    invalid_status,
    job_finished,
    keys_secret,
    labels,
    lifecycle,
    owner_reference,
    rendered_manifest,
    rolling_out,
    selector_labels,
)

# Figures a kind's status may take from its first backbone peer's /status (if its model has them).
LIVE_FIGURES_EXCLUDED = {"observedGeneration", "phase", "conditions", "readyPeers", "selector", "initialPeers"}


def is_backbone(component: str) -> bool:
    return component.startswith("backbone")


@dataclass
class Component:
    """The roles of one component and how Kubernetes runs them."""

    name: str
    roles: list[Role]
    job: bool  # an Indexed Job (its roles end the run) rather than a StatefulSet
    status_key: str

    @property
    def replicas(self) -> int:
        return len(self.roles)


@dataclass
class WorkloadPlan:
    children: list[dict[str, Any]]
    components: list[Component]
    hashes: dict[str, str]
    initial_peers: list[str]
    roles: list[Role] = field(default_factory=list)


def render_roles(manifest: Manifest, peer_ids: dict[str, str], settings: WorkloadSettings) -> list[Role]:
    network = KubernetesNetwork(manifest.metadata.name, manifest.metadata.namespace, settings.cluster_domain)
    return runtime(manifest.kind).roles(manifest, network, peer_ids, f"{CONFIG_DIR}/manifest.json", RUN_DIR)


def components_of(kind: KindRuntime, roles: list[Role]) -> list[Component]:
    out: dict[str, Component] = {}
    for role in roles:
        if role.component not in out:
            out[role.component] = Component(role.component, [], False, kind.status_keys.get(role.component, role.component))
        out[role.component].roles.append(role)
        out[role.component].job |= role.completes_run
    return list(out.values())


def config_hash(manifest: Manifest, component: Component, scale_restarts: tuple[str, ...] = ()) -> str:
    """What a component's pods read at start: the manifest, less the counts and resources the
    template states itself, and its first role's arguments (scaling rolls nothing), except for
    components whose roles depend on the counts (`KindRuntime.scale_restarts`)."""
    spec = rendered_manifest(manifest)["spec"]
    for section in spec.values():
        if isinstance(section, dict):
            if component.name not in scale_restarts:
                section.pop("replicas", None)
            section.pop("resources", None)
    payload = {"spec": spec, "args": list(component.roles[0].args)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def plan_workloads(owner: dict[str, Any], manifest: Manifest, peer_ids: dict[str, str], keys_data: dict[str, str],
                   settings: WorkloadSettings, *, completed: bool = False,
                   service_monitor: bool = False) -> WorkloadPlan:
    name, namespace = manifest.metadata.name, manifest.metadata.namespace
    kind = runtime(manifest.kind)
    roles = render_roles(manifest, peer_ids, settings)
    components = components_of(kind, roles)
    owner_ref = owner_reference(owner)
    hashes = {c.name: config_hash(manifest, c, kind.scale_restarts) for c in components}

    def meta(obj_name: str, component: str | None = None, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": obj_name, "namespace": namespace, "labels": {**labels(name, component), **(extra or {})},
                "ownerReferences": [owner_ref]}

    children: list[dict[str, Any]] = [
        keys_secret(owner, name, namespace, keys_data),
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(config_map_name(name)),
         "data": {"manifest.json": json.dumps(rendered_manifest(manifest), indent=2, sort_keys=True),
                  "roles.json": json.dumps({r.name: {"component": r.component, "args": list(r.args)} for r in roles},
                                           indent=2, sort_keys=True)}},
    ]
    storage = checkpoint_storage(manifest, meta)
    if storage is not None and storage.claim is not None:
        children.append(storage.claim)
    keyed = {name_.removesuffix(".key") for name_ in keys_data}
    grace = 60
    for component in components:
        children.append(_service(meta(child_name(name, component.name), component.name, {LABEL_METRICS: "true"}),
                                 name, component.name))
        has_keys = any(role.name in keyed for role in component.roles)
        resources = component.roles[0].resources
        replicas = 0 if completed else component.replicas
        if component.job:
            template = _pod_template(name, component.name, resources, hashes[component.name], settings, grace,
                                     keys=has_keys, restart_policy="OnFailure")
            children.append({
                "apiVersion": "batch/v1", "kind": "Job", "metadata": meta(child_name(name, component.name), component.name),
                "spec": {"completionMode": "Indexed", "completions": component.replicas,
                         "parallelism": component.replicas, "backoffLimit": MONITOR_BACKOFF_LIMIT,
                         "suspend": completed, "template": template},
            })
            continue
        extra = ((storage.volume, storage.mount),) if storage is not None and storage.component == component.name else ()
        template = _pod_template(name, component.name, resources, hashes[component.name], settings, grace,
                                 keys=has_keys, extra_volumes=extra)
        children.append({
            "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(child_name(name, component.name), component.name),
            "spec": {"serviceName": child_name(name, component.name), "replicas": replicas,
                     "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": selector_labels(name, component.name)},
                     "updateStrategy": {"type": "RollingUpdate"}, "template": template},
        })
        if is_backbone(component.name):
            children.append({
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": meta(child_name(name, component.name), component.name),
                "spec": {"minAvailable": 1, "selector": {"matchLabels": selector_labels(name, component.name)}},
            })
    if service_monitor:
        children.append({
            "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta(name),
            "spec": {"selector": {"matchLabels": {LABEL_SWARM: name, LABEL_METRICS: "true"}},
                     "endpoints": [{"port": METRICS, "path": "/metrics", "interval": settings.service_monitor_interval}]},
        })
    network = KubernetesNetwork(name, namespace, settings.cluster_domain)
    initial_peers = [network.backbone_maddr(r.index, P2P_PORT, peer_ids[r.name], r.component)
                     for c in components if is_backbone(c.name) for r in c.roles if r.name in peer_ids]
    return WorkloadPlan(children=children, components=components, hashes=hashes, initial_peers=initial_peers,
                        roles=roles)


def run_completed(plan: WorkloadPlan, workloads: dict[str, dict[str, Any] | None]) -> bool:
    """Every role that ends the run has succeeded (its index is among the Job's completed ones),
    in a Job of the current configuration."""
    enders = [c for c in plan.components if c.job]
    if not enders:
        return False
    for component in enders:
        job = workloads.get(component.name)
        template = ((job or {}).get("spec") or {}).get("template", {})
        if (template.get("metadata", {}).get("annotations") or {}).get("hivekeeper.dev/config-hash") != plan.hashes[component.name]:
            return False
        done = _indexes(((job or {}).get("status") or {}).get("completedIndexes") or "")
        if job_finished(job) != "Complete" and not all(r.index in done for r in component.roles if r.completes_run):
            return False
    return True


def _indexes(text: str) -> set[int]:
    """Kubernetes' completedIndexes ("0,2-4") as a set."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def workload_status(*, kind: str, generation: int | None, previous: dict[str, Any] | None, now: str,
                    plan: WorkloadPlan | None, workloads: dict[str, dict[str, Any] | None] | None,
                    reading: dict[str, Any] | None = None, completed: bool = False, invalid: str | None = None,
                    invalid_reason: str = "InvalidSpec", error: str | None = None, error_reason: str = "ReconcileError",
                    settings: WorkloadSettings = WorkloadSettings(), name: str = "") -> dict[str, Any]:
    """The whole .status of a role-planned resource; with `invalid`, only phase and conditions."""
    previous = previous or {}
    if invalid is not None:
        return invalid_status(generation, previous, now, invalid, invalid_reason)
    status: dict[str, Any] = {"observedGeneration": generation}
    assert plan is not None and workloads is not None
    counts = {}
    for component in plan.components:
        workload = (workloads.get(component.name) or {}).get("status") or {}
        desired = 0 if completed else component.replicas
        if component.job:
            counts[component.status_key] = {"desired": desired, "replicas": int(workload.get("active") or 0),
                                            "ready": int(workload.get("ready") or 0)}
        else:
            counts[component.status_key] = {"desired": desired, "replicas": int(workload.get("replicas") or 0),
                                             "ready": int(workload.get("readyReplicas") or 0)}
        status[component.status_key] = counts[component.status_key]
    desired_total = sum(c["desired"] for c in counts.values())
    ready_total = sum(min(c["ready"], c["desired"]) for c in counts.values())
    info = KINDS[kind]
    scaled = info.status_replicas_path.split(".")[2]  # .status.KEY.replicas
    scaled_component = next((c.name for c in plan.components if c.status_key == scaled), None)
    status["readyPeers"] = f"{ready_total}/{desired_total}"
    if scaled_component:
        status["selector"] = ",".join(f"{k}={v}" for k, v in selector_labels(name, scaled_component).items())
    status["initialPeers"] = plan.initial_peers
    failed = next((c for c in plan.components if c.job and job_finished(workloads.get(c.name)) == "Failed"), None)
    backbone_ready = all(counts[c.status_key]["ready"] >= 1 for c in plan.components if is_backbone(c.name))
    status.update(lifecycle(
        previous=previous, generation=generation, now=now, settings=settings, completed=completed,
        completed_message="the run is done; peers were stopped",
        failed=f"{failed.status_key} failed {MONITOR_BACKOFF_LIMIT} times" if failed else None,
        failed_reason="JobFailed", running=backbone_ready and ready_total > 0,
        not_ready=[f"{key} {c['ready']}/{c['desired']}" for key, c in counts.items() if c["ready"] < c["desired"]],
        rolling=[c.status_key for c in plan.components
                 if not c.job and rolling_out(workloads.get(c.name), 0 if completed else c.replicas)],
        ready_total=ready_total, desired_total=desired_total, error=error, error_reason=error_reason))
    status.update(live_figures(kind, reading, previous))
    return status


def live_figures(kind: str, reading: dict[str, Any] | None, previous: dict[str, Any]) -> dict[str, Any]:
    """Fields of the kind's status model found in a peer's /status (the last ones stay while it
    does not answer); a value the model refuses is dropped, not written."""
    model = KINDS[kind].status_model
    keys = [f.alias or n for n, f in model.model_fields.items()
            if (f.alias or n) not in LIVE_FIGURES_EXCLUDED and not _is_role_status(f)]
    if not reading:
        return {k: previous[k] for k in keys if k in previous}
    out = {}
    for key in keys:
        if key in reading:
            try:
                model.model_validate({key: reading[key]})
            except ValidationError:
                continue
            out[key] = reading[key]
    return out


def final_figures(kind: str, report: dict[str, Any] | None, previous: dict[str, Any]) -> dict[str, Any]:
    """A finished role's final report (`readers.final_report_of`) as the kind's status figures:
    an ExpertPool trainer's step, held-out metrics and loss; what the model has no field for is
    left out."""
    if not report:
        return {}
    reading = {"step": report.get("globalStep"), "globalStep": report.get("globalStep"),
               "evalMetrics": report.get("metrics"), "loss": report.get("loss")}
    return live_figures(kind, {k: v for k, v in reading.items() if v is not None}, previous)


def live_status_url(plan: WorkloadPlan, name: str, namespace: str, cluster_domain: str) -> str | None:
    """Where the first backbone peer serves /status (it sums up what the peers announce)."""
    backbone = next((c.name for c in plan.components if is_backbone(c.name)), None)
    if backbone is None:
        return None
    host = KubernetesNetwork(name, namespace, cluster_domain).backbone_host(0, backbone)
    return f"http://{host}:{METRICS_PORT}/status"


def _is_role_status(field_info: Any) -> bool:
    return RoleStatus in getattr(field_info.annotation, "__args__", (field_info.annotation,))
