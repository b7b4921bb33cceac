"""The one planner, for every kind: a parsed manifest in, the child objects out, as pure
functions (`reconcile.py` talks to the API). The roles come from the kind's runtime
(`hivekeeper.kinds`), the same function `hivekeeper up` calls, with a `KubernetesNetwork`; what
differs between kinds is data the runtime declares (status keys, section readers, scale
restarts, stop grace), never a branch on the kind here.

Children of a resource NAME (owned by it, labelled hivekeeper.dev/swarm=NAME), one function each:
  NAME-backbone-keys  Secret       keys of the identity roles (made once, so peer IDs are stable)
  NAME-config         ConfigMap    the rendered manifest and every role's `hivekeeper run` args
  NAME-COMPONENT      Service      headless, per component: per-pod DNS, scraped by Prometheus
  NAME-COMPONENT      StatefulSet  per component (a role's index is its pod's ordinal), or an
                                   Indexed Job for roles whose exit ends the run (index =
                                   completion index), so a successful exit is not restarted
  NAME-BACKBONE       PodDisruptionBudget (minAvailable: 1) for the bootstrap peers
  NAME-checkpoints    PersistentVolumeClaim (a monitor's or expert servers' volumeClaim, `storage.py`)
  volunteers          Secrets and external Services (spec.volunteers, `volunteers.py`)
  NAME-ROLE-public    Service      per peer of a group exposed by NodePort or LoadBalancer (`exposure.py`)
  NAME                ServiceMonitor, when the Prometheus Operator's CRD is installed

A pod template carries a hash of what its role reads at start (the spec sections it reads, less
the counts, resources and placement the template states, and its arguments), so a spec change
rolls exactly the components it concerns, and scaling rolls nothing."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from hivekeeper.kinds import KindRuntime, runtime
from hivekeeper.spec import Manifest
from hivekeeper.spec.crd import KINDS
from hivekeeper.spec.volunteers import VolunteersSpec
from hivekeeper.topology import METRICS, Role, lab_index_base, public_backbone_maddrs, relay_maddrs, volunteer_info

from hivekeeper_operator import exposure, pods, volunteers
from hivekeeper_operator.joining import HostSwarm, lab_components
from hivekeeper_operator.network import CONFIG_DIR, P2P_PORT, RUN_DIR, KubernetesNetwork
from hivekeeper_operator.pods import LABEL_INSTANCE, LABEL_METRICS, WorkloadSettings, child_name
from hivekeeper_operator.storage import Storage, storage_of
from hivekeeper_operator.volunteers import VolunteerAccess

MANIFEST_PATH = f"{CONFIG_DIR}/manifest.json"
SWARM_INFO = "swarm-info.json"
JOB_BACKOFF_LIMIT = 10
_UNKNOWN_PEER = "QmUnknownPeerOfAScaledUpSample"  # a sample's extra identity (never a pod's)
PLACEMENT = "placement"  # the spec-wide and every group's: stated by the pod template


@dataclass(frozen=True)
class Request:
    """What one reconcile plans from."""

    owner: dict[str, Any]  # the resource (apiVersion, kind, metadata with uid)
    manifest: Manifest
    peer_ids: dict[str, str]  # identity role -> peer ID
    keys_data: dict[str, str]  # the keys Secret's data
    settings: WorkloadSettings = WorkloadSettings()
    access: VolunteerAccess | None = None  # iff spec.volunteers is enabled
    completed: bool = False  # the run is over: stop every peer
    service_monitor: bool = False
    joined: HostSwarm | None = None  # spec.join: the swarm this lab takes part in (`manifest` is its plan)
    peer_hosts: dict[str, str] = field(default_factory=dict)  # role -> its LoadBalancer's address, once known


@dataclass
class Component:
    """The roles of one component and how Kubernetes runs them."""

    name: str
    roles: list[Role]  # those that run now (none while scaled to zero)
    template: Role  # stands for them in the pod template and config hash: index 0 of a count >= 1
    status_key: str
    job: bool  # an Indexed Job (its roles end the run) rather than a StatefulSet

    @property
    def replicas(self) -> int:
        return len(self.roles)

    @property
    def backbone(self) -> bool:
        return self.template.backbone


@dataclass
class Plan:
    children: list[dict[str, Any]]
    components: list[Component]
    hashes: dict[str, str]
    initial_peers: list[str]
    roles: list[Role] = field(default_factory=list)
    volunteer_gateway: str | None = None  # host:port for `hivekeeper join`, once known
    volunteer_relays: list[str] = field(default_factory=list)

    def component(self, name: str | None) -> Component | None:
        return next((c for c in self.components if c.name == name), None)


def door_of(manifest: Manifest) -> VolunteersSpec | None:
    """spec.volunteers, where the kind has it and it is enabled."""
    door = getattr(manifest.spec, "volunteers", None)
    return door if door is not None and door.enabled else None


def network_of(manifest: Manifest, settings: WorkloadSettings, relay_hosts: list[str | None] | None = None,
               joined: HostSwarm | None = None, peer_hosts: dict[str, str] | None = None) -> KubernetesNetwork:
    door = door_of(manifest)
    return KubernetesNetwork(manifest.metadata.name, manifest.metadata.namespace, settings.cluster_domain,
                             relay_public_hosts=relay_hosts or [], relay_port=door.relay_port if door else P2P_PORT,
                             entry_points=joined.entry_points if joined else (),
                             index_base=lab_index_base(joined.identity) if joined else 0,
                             peer_public_hosts=peer_hosts)


def render_roles(manifest: Manifest, peer_ids: dict[str, str], settings: WorkloadSettings,
                 relay_hosts: list[str | None] | None = None) -> list[Role]:
    return runtime(manifest.kind).roles(manifest, network_of(manifest, settings, relay_hosts), peer_ids,
                                        MANIFEST_PATH, RUN_DIR)


def rendered_manifest(manifest: Manifest) -> dict[str, Any]:
    """The manifest every pod reads: defaults filled in, Kubernetes metadata left out."""
    return {"apiVersion": manifest.api_version, "kind": manifest.kind,
            "metadata": {"name": manifest.metadata.name, "namespace": manifest.metadata.namespace},
            "spec": manifest.spec.model_dump(by_alias=True, mode="json", exclude_none=True)}


def _sample(manifest: Manifest) -> Manifest:
    """The manifest with every section's count at least one: a component scaled to zero keeps
    its workload (and template), and a count never changes a template."""
    sample = manifest.model_copy(deep=True)
    for name in type(sample.spec).model_fields:
        section = getattr(sample.spec, name)
        if isinstance(getattr(section, "replicas", None), int) and section.replicas < 1:
            section.replicas = 1
    return sample


def components_of(kind: KindRuntime, roles: list[Role], sample: list[Role]) -> list[Component]:
    out: dict[str, Component] = {}
    for role in sample:
        if role.component not in out:
            out[role.component] = Component(role.component, [], role, kind.status_keys.get(role.component, role.component),
                                            False)
        out[role.component].job |= role.completes_run
    for role in roles:
        out[role.component].roles.append(role)
    return [c for c in out.values() if c.roles or not c.job]  # a Job of no roles would end the run at once


def pods_manifest(request: Request) -> dict[str, Any]:
    """The manifest.json the pods read: the resource's own, or a joining lab's host's."""
    return request.joined.document if request.joined else rendered_manifest(request.manifest)


def config_hash(document: dict[str, Any], kind: KindRuntime, component: Component, info: dict[str, Any] | None) -> str:
    """What a component's pods read at start: the spec sections it reads (`section_readers`;
    every section, by default) of the manifest `document`, less the counts, resources and
    placement the template states, except for the counts of components whose roles depend on them
    (`scale_restarts`); its first role's arguments; and the swarm info, if its arguments name
    that file."""
    read: dict[str, Any] = {}
    for section, value in document["spec"].items():
        if section == PLACEMENT or component.name not in kind.section_readers.get(section, (component.name,)):
            continue
        if isinstance(value, dict):
            dropped = (("resources", PLACEMENT) if component.name in kind.scale_restarts
                       else ("resources", PLACEMENT, "replicas"))
            value = {k: v for k, v in value.items() if k not in dropped}
        read[section] = value
    payload: dict[str, Any] = {"spec": read, "args": list(component.template.args)}
    if info is not None and any(arg.endswith(SWARM_INFO) for arg in component.template.args):
        payload["swarmInfo"] = info  # what the token service hands volunteers (the relays' addresses)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Draft:
    """A plan in the making: what every child function reads."""

    request: Request
    kind: KindRuntime
    roles: list[Role]
    components: list[Component]
    hashes: dict[str, str]
    network: KubernetesNetwork
    door: VolunteersSpec | None
    info: dict[str, Any] | None
    storage: list[Storage]

    @property
    def name(self) -> str:
        return self.request.manifest.metadata.name

    def meta(self, name: str, component: str | None = None, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return pods.metadata(self.request.owner, name, component, extra)


# -- one function per child kind -----------------------------------------------------------------


def config_map(d: Draft) -> list[dict[str, Any]]:
    data = {"manifest.json": json.dumps(pods_manifest(d.request), indent=2, sort_keys=True),
            "roles.json": json.dumps({r.name: {"component": r.component, "args": list(r.args)} for r in d.roles},
                                     indent=2, sort_keys=True)}
    if d.info is not None:
        data[SWARM_INFO] = json.dumps(d.info, indent=2, sort_keys=True)
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": d.meta(pods.config_map_name(d.name)), "data": data}]


def access(d: Draft) -> list[dict[str, Any]]:
    granted = d.request.access
    if d.door is None or granted is None:
        return []
    name = d.name
    out = [pods.secret(d.meta(volunteers.swarm_auth_secret_name(name), volunteers.TOKEN_SERVICE), granted.auth_data),
           pods.secret(d.meta(volunteers.invites_secret_name(name)), granted.invites_data)]
    return out + volunteers.external_services(
        d.meta, name, d.door,
        lambda component, index: {**pods.selector_labels(name, component),
                                   "statefulset.kubernetes.io/pod-name": f"{child_name(name, component)}-{index}"})


def exposed(d: Draft) -> list[dict[str, Any]]:
    return exposure.exposed_services(
        d.meta, d.name, d.roles,
        lambda role: {**pods.selector_labels(d.name, role.component),
                      "statefulset.kubernetes.io/pod-name": f"{child_name(d.name, role.component)}-{role.index}"})


def claims(d: Draft) -> list[dict[str, Any]]:
    return [s.claim for s in d.storage if s.claim is not None]


def services(d: Draft) -> list[dict[str, Any]]:
    return [pods.service(d.meta(child_name(d.name, c.name), c.name, {LABEL_METRICS: "true"}), d.name, c.name, c.template)
            for c in d.components]


def workloads(d: Draft) -> list[dict[str, Any]]:
    out = []
    grace = d.kind.stop_grace_seconds(d.request.manifest)
    completed = d.request.completed
    for c in d.components:
        keys = c.template.name in d.request.peer_ids  # an identity role: its key is in the keys Secret
        meta = d.meta(child_name(d.name, c.name), c.name, c.template.placement.labels)
        if c.template.placement.annotations:
            meta["annotations"] = dict(c.template.placement.annotations)
        volumes = tuple((s.volume, s.mount) for s in d.storage if c.name in s.components)
        if d.request.joined is not None:
            volumes += (pods.join_invite_volume(d.request.manifest.spec.join.invite_secret),)
        if c.job:
            template = pods.pod_template(d.name, c.template, d.hashes[c.name], d.request.settings, grace, keys=keys,
                                         restart_policy="OnFailure", door=d.door, extra_volumes=volumes)
            out.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": {
                "completionMode": "Indexed", "completions": c.replicas, "parallelism": c.replicas,
                "backoffLimit": JOB_BACKOFF_LIMIT, "suspend": completed, "template": template}})
            continue
        template = pods.pod_template(d.name, c.template, d.hashes[c.name], d.request.settings, grace, keys=keys,
                                     door=d.door, extra_volumes=volumes)
        out.append({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": {
            "serviceName": child_name(d.name, c.name), "replicas": 0 if completed else c.replicas,
            "podManagementPolicy": "Parallel",  # backbone peers bootstrap from each other
            "selector": {"matchLabels": pods.selector_labels(d.name, c.name)},
            "updateStrategy": {"type": "RollingUpdate"}, "template": template}})
    return out


def disruption_budgets(d: Draft) -> list[dict[str, Any]]:
    return [{"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": d.meta(child_name(d.name, c.name), c.name),
             "spec": {"minAvailable": 1, "selector": {"matchLabels": pods.selector_labels(d.name, c.name)}}}
            for c in d.components if c.backbone and not c.job]


def service_monitor(d: Draft) -> list[dict[str, Any]]:
    if not d.request.service_monitor:
        return []
    meta = d.meta(d.name)
    # The configured labels (Prometheus's serviceMonitorSelector), never overriding a child's own.
    meta["labels"] = {**dict(d.request.settings.service_monitor_labels), **meta["labels"]}
    return [{"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": meta,
             "spec": {"selector": {"matchLabels": {LABEL_INSTANCE: d.name, LABEL_METRICS: "true"}},
                      "endpoints": [{"port": METRICS, "path": "/metrics",
                                     "interval": d.request.settings.service_monitor_interval}]}}]


CHILDREN: tuple[Callable[[Draft], list[dict[str, Any]]], ...] = (
    config_map, access, exposed, claims, services, workloads, disruption_budgets, service_monitor)
# What the owner scan lists to find children no longer planned. The ConfigMap and the
# ServiceMonitor (while its CRD is served) are always planned; Secrets are found through the keys
# Secret's record (never listed); a claim is never deleted while its owner exists.
SCANNED = (("v1", "Service"), ("apps/v1", "StatefulSet"), ("batch/v1", "Job"), ("policy/v1", "PodDisruptionBudget"))


def plan(request: Request) -> Plan:
    manifest, peer_ids = request.manifest, request.peer_ids
    kind = runtime(manifest.kind)
    door = door_of(manifest)
    assert (request.access is not None) == (door is not None), "volunteer access material iff volunteers are enabled"
    relay_hosts = request.access.relay_hosts if request.access else None
    joined = request.joined
    network = network_of(manifest, request.settings, relay_hosts, joined, request.peer_hosts)
    if joined is not None and joined.plan_signer:  # the host's: its peers follow the host's plan
        peer_ids = {**peer_ids, volunteers.PLAN_SIGNER: joined.plan_signer}
    roles = kind.roles(manifest, network, peer_ids, MANIFEST_PATH, RUN_DIR)
    sample = _sample(manifest)
    sample_ids = {**{n: _UNKNOWN_PEER for n in kind.identity_roles(sample)}, **peer_ids}
    sample_roles = kind.roles(sample, network, sample_ids, MANIFEST_PATH, RUN_DIR)
    if joined is not None:  # only what a lab contributes
        contributed = lab_components(kind)
        roles, sample_roles = ([r for r in group if r.component in contributed] for group in (roles, sample_roles))
    components = components_of(kind, roles, sample_roles)
    relays = volunteers.relay_ids(door, peer_ids) if door else []
    info = volunteer_info(manifest, network, relays, plan_signer=peer_ids.get(volunteers.PLAN_SIGNER),
                          backbones=public_backbone_maddrs(network, roles, peer_ids)) if door else None
    draft = Draft(request, kind, roles, components,
                  {c.name: config_hash(pods_manifest(request), kind, c, info) for c in components}, network, door, info,
                  storage_of(manifest, lambda name, component: pods.metadata(request.owner, name, component)))
    rest = [child for make in CHILDREN for child in make(draft)]
    secrets = [c["metadata"]["name"] for c in rest if c["kind"] == "Secret"]
    initial_peers = [network.backbone_maddr(r.index, P2P_PORT, peer_ids[r.name], r.component)
                     for c in components if c.backbone for r in c.roles if r.name in peer_ids]
    result = Plan(children=[pods.keys_secret(request.owner, request.keys_data, secrets), *rest],
                  components=components, hashes=draft.hashes, initial_peers=initial_peers, roles=roles)
    if door is not None:
        result.volunteer_relays = relay_maddrs(network, relays, public=True)
        result.volunteer_gateway = f"{door.public_host}:{door.gateway_port}" if door.public_host else None
    return result


def scaled_component(plan_: Plan, kind: str) -> Component | None:
    """The component `kubectl scale` scales (the CRD's scale subresource: .status.KEY.replicas)."""
    key = KINDS[kind].status_replicas_path.split(".")[2]
    return next((c for c in plan_.components if c.status_key == key), None)
