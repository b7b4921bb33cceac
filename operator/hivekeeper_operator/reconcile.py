"""The reconciler, one for every kind: read a resource, ask the planner what should exist,
apply it, delete what its owner scan finds no longer planned, write what was observed back as
status, and tell what changed or failed in Events on the resource. The kopf handlers and the
periodic resync both call `Reconciler.reconcile`."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from hivekeeper.errors import UserError
from hivekeeper.kinds import runtime
from hivekeeper.spec import Manifest, parse_manifest
from hivekeeper.spec.crd import KINDS

from hivekeeper_operator import exposure, identity, joining, pods, readers, volunteers
from hivekeeper_operator.conditions import Cond, condition, now_rfc3339
from hivekeeper_operator.events import NORMAL, WARNING, EventRecorder
from hivekeeper_operator.kube import (LABEL_MANAGED_BY, MANAGED_BY, Applier, ApplyResult, Kube, KubeError, NameConflict,
                                     register_resource)
from hivekeeper_operator.leader import LeaderElection
from hivekeeper_operator.metrics import OperatorMetrics
from hivekeeper_operator.plan import SCANNED, Plan, Request, door_of, plan, render_roles
from hivekeeper_operator.pods import API, WorkloadSettings
from hivekeeper_operator.status import invalid_status, not_joined_status, resource_status, role_counts, run_completed

log = logging.getLogger("hivekeeper.operator")
JOINED_CONDITION = "Joined"  # a joining resource's (spec.join): admitted by the host's token service


@dataclass
class OperatorConfig:
    settings: WorkloadSettings = field(default_factory=WorkloadSettings)
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    resync_seconds: float = 15.0
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 8080  # None: no HTTP endpoint (tests)
    service_monitors: str = "auto"  # auto: when the CRD is served; off: never
    status_reader: readers.StatusReader = field(default_factory=readers.http_status_reader)
    key_generator: identity.KeyGenerator = identity.generate_key
    kubeconfig: str | None = None
    kinds: tuple[str, ...] = ("Swarm", "BlockServer", "ExpertPool")
    leader_election: LeaderElection | None = None  # None: this replica always leads
    join_prober: joining.Prober = joining.subprocess_prober  # asks a host's token service (spec.join)


def _managed(obj: dict[str, Any] | None) -> bool:
    return bool(obj) and (obj.get("metadata", {}).get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY


class Reconciler:
    """One kind's resources: locking per object, metrics, status writes, Events."""

    def __init__(self, kind: str, kube: Kube, config: OperatorConfig, metrics: OperatorMetrics,
                 events: EventRecorder):
        self.kind, self.kube, self.config, self.metrics, self.events = kind, kube, config, metrics, events
        self.plural = KINDS[kind].plural
        register_resource(API, kind, self.plural)
        self.applier = Applier(kube, on_write=lambda child, action: metrics.writes.labels(kind, child, action).inc())
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._unreported: set[tuple[str, str]] = set()  # resources whose final report could not be read
        self.probes = joining.ProbeCache(config.join_prober)

    def _lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def list(self) -> list[dict[str, Any]]:
        if not self.config.namespaces:
            return self.kube.list(API, self.kind)
        return [obj for ns in self.config.namespaces for obj in self.kube.list(API, self.kind, ns)]

    def reconcile(self, namespace: str, name: str) -> str | None:
        """Bring one resource's children and status up to date; returns its phase."""
        started = time.perf_counter()
        with self._lock(namespace, name):
            obj = None
            try:
                obj = self.kube.get(API, self.kind, namespace, name)
                if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
                    result = None  # gone or going: owner references take the children with it
                    self.probes.forget((namespace, name))
                else:
                    result = self.reconcile_object(obj)
                    self._phase_event(obj, result)
            except Exception as e:
                reason = type(e).__name__ if not isinstance(e, KubeError) else f"HTTP{e.status}"
                self.metrics.errors.labels(self.kind, reason).inc()
                self.metrics.reconciles.labels(self.kind, "error").inc()
                if obj is not None:
                    self.events.warning(obj, "ReconcileError", str(e))
                raise
            finally:
                self.metrics.duration.labels(self.kind).observe(time.perf_counter() - started)
        self.metrics.reconciles.labels(self.kind, "success").inc()
        return result

    def write_status(self, obj: dict[str, Any], status: dict[str, Any]) -> bool:
        """Merge-patch the status subresource with the top-level keys that changed (none: no write)."""
        previous = obj.get("status") or {}
        changes = {k: v for k, v in status.items() if previous.get(k) != v}
        if not changes:
            return False
        meta = obj["metadata"]
        self.kube.merge_patch(self.kube.path(API, self.kind, meta["namespace"], meta["name"], "status"),
                              {"status": changes})
        self.metrics.status_writes.labels(self.kind).inc()
        return True

    def _phase_event(self, obj: dict[str, Any], phase: str | None) -> None:
        previous = (obj.get("status") or {}).get("phase")
        if phase and phase != previous:
            self.events.record(obj, WARNING if phase in ("Failed", "Invalid") else NORMAL, "PhaseChanged",
                               f"{previous} -> {phase}" if previous else phase)

    def _invalid(self, obj: dict[str, Any], message: str, reason: str = "InvalidSpec") -> str:
        meta = obj["metadata"]
        self.write_status(obj, invalid_status(meta.get("generation"), obj.get("status"), now_rfc3339(), message, reason))
        self.events.warning(obj, reason, message)
        log.warning("invalid spec", extra={"fields": {"resource": f"{self.kind} {meta['namespace']}/{meta['name']}",
                                                      "error": message}})
        return "Invalid"

    def reconcile_object(self, obj: dict[str, Any]) -> str | None:
        meta = obj["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        document = {k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj}
        try:
            manifest = parse_manifest(document, source=f"{self.kind} {namespace}/{name}")
        except UserError as e:
            return self._invalid(obj, str(e))
        kind = runtime(self.kind)
        joined, extra = None, ()
        if getattr(manifest.spec, "join", None) is not None:
            outcome = self._join(obj, manifest)
            if outcome.host is None:
                return self._not_joined(obj, outcome)
            joined, manifest = outcome.host, outcome.host.manifest
            extra = (Cond(JOINED_CONDITION, True, outcome.reason, outcome.message),)

        # Keys first: everyone's arguments name the identity roles' peer IDs.
        secret = self.kube.get("v1", "Secret", namespace, pods.keys_secret_name(name))
        existing = (secret or {}).get("data") if _managed(secret) else None
        identities = kind.identity_roles(manifest)
        if joined is not None:  # the host's own (its balancer's key) are not this lab's to make
            identities = [n for n in identities if n.rsplit("-", 1)[0] in joining.lab_components(kind)]
        keys_data, peer_ids = identity.ensure_role_keys(existing, identities, self.config.key_generator)
        recorded = pods.owned_secrets(secret if _managed(secret) else None)
        if secret is None or keys_data != existing:
            # Stored before anything names them, and read back from what was stored.
            try:
                live = self.applier.apply(pods.keys_secret(obj, keys_data, sorted(recorded))).live
            except NameConflict as e:
                return self._invalid(obj, str(e), "NameConflict")
            keys_data, peer_ids = identity.ensure_role_keys(live.get("data"), identities, self.config.key_generator)

        service_monitor = self.config.service_monitors == "auto" and self.kube.serves(
            "monitoring.coreos.com/v1", "servicemonitors")
        request = Request(obj, manifest, peer_ids, keys_data, self.config.settings,
                          access=self._volunteer_access(manifest, peer_ids), service_monitor=service_monitor,
                          joined=joined, peer_hosts=self._peer_hosts(manifest, peer_ids))
        try:
            wanted = plan(request)
        except UserError as e:  # a placement naming a volume, mount or variable of the pods' own
            return self._invalid(obj, str(e))
        jobs = {c.name: self.kube.get("batch/v1", "Job", namespace, pods.child_name(name, c.name))
                for c in wanted.components if c.job}
        completed = run_completed(wanted, jobs)
        if completed:
            wanted = plan(replace(request, completed=True))

        workloads, error, error_reason = self._apply(wanted, request)
        if error:
            self.events.warning(obj, error_reason, error)
        self._delete_unwanted(obj, wanted, recorded)
        status = resource_status(
            kind=self.kind, generation=meta.get("generation"), previous=obj.get("status"), now=now_rfc3339(),
            plan=wanted, workloads=workloads, name=name, reading=self._reading(manifest, wanted, workloads, completed),
            reports=self._final_reports(namespace, name, wanted, jobs) if completed else [], completed=completed,
            error=error, error_reason=error_reason, settings=self.config.settings, extra=extra)
        self.write_status(obj, status)
        return status["phase"]

    def _join(self, obj: dict[str, Any], manifest: Manifest) -> joining.JoinOutcome:
        """What the host's token service says of this lab's invite (asked a while ago, or now),
        told in an Event when the Joined condition changes."""
        meta, join = obj["metadata"], manifest.spec.join
        secret = self.kube.get("v1", "Secret", meta["namespace"], join.invite_secret)
        invite, why = joining.invite_of(secret, join.invite_secret)
        if invite is None:
            outcome = joining.JoinOutcome(None, joining.INVITE_MISSING, why)
        else:
            answer = self.probes.answer((meta["namespace"], meta["name"]), join.gateway, invite)
            outcome = joining.join(manifest, answer)
        before = condition(obj.get("status"), JOINED_CONDITION) or {}
        if (before.get("status") == "True") != (outcome.host is not None) or before.get("reason") != outcome.reason:
            if outcome.host is None:
                self.events.warning(obj, outcome.reason, outcome.message)
            else:
                self.events.normal(obj, outcome.reason, outcome.message)
        return outcome

    def _not_joined(self, obj: dict[str, Any], outcome: joining.JoinOutcome) -> str:
        """A lab not admitted: its peers stop (they would only be refused, over and over), unless
        the gateway does not answer, when they run on and retry as the host's peers do."""
        meta = obj["metadata"]
        if not outcome.keeps_peers:
            self._delete_unwanted(obj, Plan(children=[], components=[], hashes={}, initial_peers=[]), set())
        status = not_joined_status(meta.get("generation"), obj.get("status"), now_rfc3339(),
                                   Cond(JOINED_CONDITION, False, outcome.reason, outcome.message),
                                   stopped=not outcome.keeps_peers)
        self.write_status(obj, status)
        return status["phase"]

    def _apply(self, wanted: Plan, request: Request) -> tuple[dict[str, Any], str | None, str]:
        """Apply every child; the live workloads by component, and a name conflict if one was met."""
        workloads: dict[str, Any] = {}
        error, reason = None, "ReconcileError"
        door = door_of(request.manifest)
        gateway = volunteers.gateway_service_name(request.manifest.metadata.name)
        for child in wanted.children:
            try:
                result = self.applier.apply(child)
            except NameConflict as e:
                error, reason = str(e), "NameConflict"
                continue
            if child["kind"] in ("StatefulSet", "Job"):
                component = child["metadata"]["labels"][pods.LABEL_COMPONENT]
                workloads[component] = result.live
                self._scale_event(request.owner, component, result)
            if door is not None and child["kind"] == "Service" and child["metadata"]["name"] == gateway \
                    and not wanted.volunteer_gateway:
                host = volunteers.ingress_host(result.live)
                wanted.volunteer_gateway = f"{host}:{door.gateway_port}" if host else None
        return workloads, error, reason

    def _scale_event(self, owner: dict[str, Any], component: str, result: ApplyResult) -> None:
        """A component's pod count changed: the resource was scaled, a run ended (zero), or a
        hand-scaled StatefulSet was set back to the resource's count."""
        if result.kind != "StatefulSet" or result.previous is None:
            return
        before, after = result.previous["spec"].get("replicas"), result.live["spec"].get("replicas")
        if before != after:
            self.events.normal(owner, "Scaled", f"{component}: {before} -> {after} replicas")

    def _delete_unwanted(self, owner: dict[str, Any], wanted: Plan, recorded_secrets: set[str]) -> None:
        """The owner scan: children of this resource the plan no longer has (a component
        switched off, volunteers closed)."""
        meta = owner["metadata"]
        namespace = meta["namespace"]
        planned = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in wanted.children}
        for api_version, kind in SCANNED:
            for child in self.kube.list(api_version, kind, namespace, selector=pods.selector(meta["name"])):
                child_meta = child.get("metadata") or {}
                owned = any(ref.get("uid") == meta.get("uid") for ref in child_meta.get("ownerReferences") or [])
                if owned and (api_version, kind, child_meta.get("name")) not in planned:
                    self.applier.delete_if_managed(api_version, kind, namespace, child_meta["name"])
        for secret in sorted(recorded_secrets - {name for _, kind, name in planned if kind == "Secret"}):
            live = self.kube.get("v1", "Secret", namespace, secret)
            refs = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
            if any(ref.get("uid") == meta.get("uid") for ref in refs):
                self.applier.delete_if_managed("v1", "Secret", namespace, secret)

    def _volunteer_access(self, manifest: Manifest, peer_ids: dict[str, str]) -> volunteers.VolunteerAccess | None:
        """The signing key and invites (made once, kept in Secrets) and each relay's public host."""
        door = door_of(manifest)
        if door is None:
            return None
        name, namespace = manifest.metadata.name, manifest.metadata.namespace
        secrets = [self.kube.get("v1", "Secret", namespace, secret_name) for secret_name in
                   (volunteers.swarm_auth_secret_name(name), volunteers.invites_secret_name(name))]
        services = [self.kube.get("v1", "Service", namespace, volunteers.relay_service_name(name, i))
                    for i in range(door.relays)]
        hosts = volunteers.public_hosts(door, services)
        roles = render_roles(manifest, peer_ids, self.config.settings, hosts)
        auth_data, invites_data = volunteers.ensure_access(
            *[(s or {}).get("data") if _managed(s) else None for s in secrets], name, roles)
        return volunteers.VolunteerAccess(relay_hosts=hosts, auth_data=auth_data, invites_data=invites_data)

    def _peer_hosts(self, manifest: Manifest, peer_ids: dict[str, str]) -> dict[str, str]:
        """The address of each LoadBalancer-exposed peer's Service, once it has one."""
        awaited = exposure.awaited_hosts(render_roles(manifest, peer_ids, self.config.settings))
        if not awaited:
            return {}
        name, namespace = manifest.metadata.name, manifest.metadata.namespace
        return exposure.public_hosts(name, awaited, lambda service: self.kube.get("v1", "Service", namespace, service))

    def _reading(self, manifest: Manifest, wanted: Plan, workloads: dict[str, Any], completed: bool) -> dict | None:
        """The reporter's /status (a Swarm's monitor; by default, and in a lab that joins another's
        swarm, the first backbone peer), once it runs."""
        reporter = runtime(self.kind).status_component
        source = wanted.component(reporter) if reporter else None
        if source is None:  # no reporter, or one that this resource does not run (a joining lab's)
            source = next((c for c in wanted.components if c.backbone), None)
        if source is None or role_counts(source, workloads.get(source.name), completed)["ready"] < 1:
            return None
        meta = manifest.metadata
        reading = self.config.status_reader(meta.namespace, meta.name, readers.status_url(
            meta.name, meta.namespace, self.config.settings.cluster_domain, source.name, source.job))
        self.metrics.monitor_reads.labels("ok" if reading else "unavailable").inc()
        return reading

    def _final_reports(self, namespace: str, name: str, wanted: Plan, jobs: dict[str, Any]) -> list[dict[str, Any]]:
        """The final reports (the run's last figures) of the roles that ended it, from the
        termination messages of their Jobs' pods: result.json went with the pod's emptyDir."""
        reports = []
        for component in (c for c in wanted.components if c.job):
            try:
                found = self.kube.list("v1", "Pod", namespace, selector=pods.selector(name, component.name))
            except KubeError as e:  # e.g. 403: the status keeps the last live figures
                if (namespace, name) not in self._unreported:  # once, not at every resync
                    self._unreported.add((namespace, name))
                    log.warning("cannot read a finished role's final report",
                                extra={"fields": {"resource": f"{self.kind} {namespace}/{name}", "error": str(e)}})
                continue
            report = readers.final_report_of(found, ((jobs.get(component.name) or {}).get("metadata") or {}).get("uid"))
            if report is not None:
                reports.append(report)
        return reports


def controllers(kube: Kube, config: OperatorConfig, metrics: OperatorMetrics,
                events: EventRecorder | None = None) -> dict[str, Reconciler]:
    unknown = [k for k in config.kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"no reconciler for kinds: {', '.join(unknown)}")
    events = events or EventRecorder(kube)
    return {kind: Reconciler(kind, kube, config, metrics, events) for kind in config.kinds}
