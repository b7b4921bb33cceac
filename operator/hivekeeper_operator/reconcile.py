"""Reconcilers: read a resource, ask the kind's pure planner what should exist, apply it,
and write what was observed back as status. One reconciler per kind, in `controllers()`;
the kopf handlers and the periodic resync both call `Reconciler.reconcile(namespace, name)`.

The Swarm has its own planner (`swarm.py`); BlockServer and ExpertPool are planned from their
roles alone (`workloads.py`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.errors import UserError
from hivekeeper.spec import parse_manifest
from hivekeeper.spec.crd import KINDS

from hivekeeper.kinds import runtime
from hivekeeper_operator import identity, readers, swarm, volunteers, workloads
from hivekeeper_operator.conditions import now_rfc3339
from hivekeeper_operator.kube import Applier, Kube, KubeError, NameConflict, register_resource
from hivekeeper_operator.metrics import OperatorMetrics
from hivekeeper_operator.readers import StatusReader, http_status_reader, monitor_url

log = logging.getLogger("hivekeeper.operator")
API = f"{API_GROUP}/{API_VERSION}"


@dataclass
class OperatorConfig:
    settings: swarm.WorkloadSettings = field(default_factory=swarm.WorkloadSettings)
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    resync_seconds: float = 15.0
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 8080  # None: no HTTP endpoint (tests)
    service_monitors: str = "auto"  # auto: when the CRD is served; off: never
    status_reader: StatusReader = field(default_factory=http_status_reader)
    key_generator: identity.KeyGenerator = identity.generate_key
    kubeconfig: str | None = None
    kinds: tuple[str, ...] = ("Swarm", "BlockServer", "ExpertPool")


class Reconciler:
    """What every kind shares: locking per object, metrics, status writes."""

    kind: str = ""

    def __init__(self, kube: Kube, config: OperatorConfig, metrics: OperatorMetrics):
        self.kube = kube
        self.config = config
        self.metrics = metrics
        self.info = KINDS[self.kind]
        register_resource(API, self.kind, self.info.plural)
        self.applier = Applier(kube, on_write=lambda child, action: metrics.writes.labels(self.kind, child, action).inc())
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._unreported: set[tuple[str, str]] = set()  # resources whose final report could not be read

    @property
    def plural(self) -> str:
        return self.info.plural

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
            try:
                obj = self.kube.get(API, self.kind, namespace, name)
                if obj is None or obj.get("metadata", {}).get("deletionTimestamp"):
                    result = None  # gone or going: owner references take the children with it
                else:
                    result = self.reconcile_object(obj)
            except Exception as e:
                reason = type(e).__name__ if not isinstance(e, KubeError) else f"HTTP{e.status}"
                self.metrics.errors.labels(self.kind, reason).inc()
                self.metrics.reconciles.labels(self.kind, "error").inc()
                raise
            finally:
                self.metrics.duration.labels(self.kind).observe(time.perf_counter() - started)
        self.metrics.reconciles.labels(self.kind, "success").inc()
        return result

    def reconcile_object(self, obj: dict[str, Any]) -> str | None:
        raise NotImplementedError

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


    def final_report(self, namespace: str, name: str, component: str,
                     job: dict[str, Any] | None) -> dict[str, Any] | None:
        """A finished Job's final report (its run's last figures), from the termination message
        of the Job's pod: the role's result.json went with the pod's emptyDir."""
        selector = f"{swarm.LABEL_SWARM}={name},{swarm.LABEL_COMPONENT}={component}"
        try:
            pods = self.kube.list("v1", "Pod", namespace, selector=selector)
        except KubeError as e:  # e.g. 403: the status keeps the last live figures
            if (namespace, name) not in self._unreported:  # once, not at every resync
                self._unreported.add((namespace, name))
                log.warning("cannot read a finished role's final report",
                            extra={"fields": {"resource": f"{self.kind} {namespace}/{name}", "error": str(e)}})
            return None
        return readers.final_report_of(pods, ((job or {}).get("metadata") or {}).get("uid"))


class SwarmReconciler(Reconciler):
    kind = "Swarm"

    def reconcile_object(self, obj: dict[str, Any]) -> str | None:
        meta = obj["metadata"]
        name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
        settings = self.config.settings
        now = now_rfc3339()
        document = {k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj}
        try:
            manifest = parse_manifest(document, source=f"{self.kind} {namespace}/{name}")
        except UserError as e:
            status = swarm.swarm_status(generation=generation, previous=obj.get("status"), now=now, plan=None,
                                        observed=None, invalid=str(e), settings=settings, swarm=name)
            self.write_status(obj, status)
            log.warning("invalid spec", extra={"fields": {"swarm": f"{namespace}/{name}", "error": str(e)}})
            return "Invalid"
        spec = manifest.spec

        # Peer keys first: everyone's arguments name the backbone's, the balancer's and the relays' peer IDs.
        secret = self.kube.get("v1", "Secret", namespace, swarm.keys_secret_name(name))
        existing = (secret or {}).get("data") if _managed(secret) else None
        identities = runtime(self.kind).identity_roles(manifest)
        keys_data, ids = identity.ensure_role_keys(existing, identities, self.config.key_generator)
        if secret is None or keys_data != existing:
            # Store new keys before anything names them; if another writer (an operator instance
            # that is shutting down) stored different ones first, theirs win.
            try:
                live = self.applier.apply(swarm.keys_secret(obj, name, namespace, keys_data)).live
            except NameConflict as e:
                live = None
                error = str(e)
            else:
                error = None
                keys_data, ids = identity.ensure_role_keys(live.get("data"), identities, self.config.key_generator)
            if error:
                status = swarm.swarm_status(generation=generation, previous=obj.get("status"), now=now, plan=None,
                                            observed=None, invalid=error, invalid_reason="NameConflict",
                                            settings=settings, swarm=name)
                self.write_status(obj, status)
                return "Invalid"

        peer_ids = [ids[f"backbone-{i}"] for i in range(spec.backbone.replicas)]
        balancer_id = ids.get("balancer-0")
        access = self._volunteer_access(obj, manifest, peer_ids, balancer_id, ids) if spec.volunteers.enabled else None

        service_monitor = self.config.service_monitors == "auto" and self.kube.serves(
            "monitoring.coreos.com/v1", "servicemonitors")
        job = self.kube.get("batch/v1", "Job", namespace, swarm.child_name(name, "monitor")) if spec.monitor.enabled else None
        plan = swarm.plan_swarm(obj, manifest, peer_ids, keys_data, settings, balancer_id=balancer_id,
                                service_monitor=service_monitor, access=access)
        completed = spec.monitor.enabled and swarm.run_completed(job, plan.hashes["monitor"])
        if completed:
            plan = swarm.plan_swarm(obj, manifest, peer_ids, keys_data, settings, balancer_id=balancer_id, completed=True,
                                    service_monitor=service_monitor, access=access)

        observed = swarm.Observed(workloads={})
        for child in plan.children:
            try:
                result = self.applier.apply(child)
            except NameConflict as e:
                observed.error, observed.error_reason = str(e), "NameConflict"
                continue
            component = child["metadata"]["labels"].get(swarm.LABEL_COMPONENT)
            if child["kind"] in ("StatefulSet", "Job"):
                observed.workloads[component] = result.live
            if child["metadata"]["name"] == volunteers.gateway_service_name(name) and not plan.volunteer_gateway:
                host = spec.volunteers.public_host or volunteers.ingress_host(result.live)
                plan.volunteer_gateway = f"{host}:{spec.volunteers.gateway_port}" if host else None
        wanted = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in plan.children}
        for api_version, kind, child in swarm.all_children(name):
            if (api_version, kind, child) in wanted:
                continue
            if kind == "ServiceMonitor" and not service_monitor:
                continue
            self.applier.delete_if_managed(api_version, kind, namespace, child)

        monitor = observed.workloads.get("monitor")
        if monitor is not None and int((monitor.get("status") or {}).get("active") or 0) > 0:
            observed.monitor = self.config.status_reader(
                namespace, name, monitor_url(name, namespace, settings.cluster_domain))
            self.metrics.monitor_reads.labels("ok" if observed.monitor else "unavailable").inc()

        if completed:
            observed.final_report = self.final_report(namespace, name, "monitor", job)

        status = swarm.swarm_status(generation=generation, previous=obj.get("status"), now=now, plan=plan,
                                    observed=observed, completed=completed, settings=settings, swarm=name)
        self.write_status(obj, status)
        return status["phase"]

    def _volunteer_access(self, obj: dict[str, Any], manifest: Any, peer_ids: list[str], balancer_id: str | None,
                          ids: dict[str, str]) -> "swarm.VolunteerAccess":
        """The signing key and invites (made once, kept in Secrets) and each relay's public host."""
        name, namespace = manifest.metadata.name, manifest.metadata.namespace
        door = manifest.spec.volunteers
        secrets = [self.kube.get("v1", "Secret", namespace, secret_name) for secret_name in
                   (volunteers.swarm_auth_secret_name(name), volunteers.invites_secret_name(name))]
        services = [self.kube.get("v1", "Service", namespace, volunteers.relay_service_name(name, i))
                    for i in range(door.relays)]
        hosts = volunteers.public_hosts(door, services)
        roles = swarm.render_roles(manifest, peer_ids, self.config.settings, balancer_id, hosts)
        auth_data, invites_data = volunteers.ensure_access(
            *[(s or {}).get("data") if _managed(s) else None for s in secrets], name, roles)
        return swarm.VolunteerAccess(relay_ids=[ids[f"relay-{i}"] for i in range(door.relays)], relay_hosts=hosts,
                                     auth_data=auth_data, invites_data=invites_data)


class WorkloadReconciler(Reconciler):
    """A kind planned from its roles alone (`workloads.py`): BlockServer, ExpertPool."""

    CHILD_TYPES = (("v1", "Service"), ("apps/v1", "StatefulSet"), ("batch/v1", "Job"),
                   ("policy/v1", "PodDisruptionBudget"))

    def reconcile_object(self, obj: dict[str, Any]) -> str | None:
        meta = obj["metadata"]
        name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
        settings, now = self.config.settings, now_rfc3339()

        def invalid(message: str, reason: str = "InvalidSpec") -> str:
            self.write_status(obj, workloads.workload_status(
                kind=self.kind, generation=generation, previous=obj.get("status"), now=now, plan=None,
                workloads=None, invalid=message, invalid_reason=reason, settings=settings, name=name))
            log.warning("invalid spec", extra={"fields": {"resource": f"{self.kind} {namespace}/{name}",
                                                          "error": message}})
            return "Invalid"

        document = {k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj}
        try:
            manifest = parse_manifest(document, source=f"{self.kind} {namespace}/{name}")
        except UserError as e:
            return invalid(str(e))
        identities = runtime(self.kind).identity_roles(manifest)
        secret = self.kube.get("v1", "Secret", namespace, swarm.keys_secret_name(name))
        existing = (secret or {}).get("data") if _managed(secret) else None
        keys_data, peer_ids = identity.ensure_role_keys(existing, identities, self.config.key_generator)
        if secret is None or keys_data != existing:
            try:  # keys first: everyone's arguments name these peer IDs
                live = self.applier.apply(swarm.keys_secret(obj, name, namespace, keys_data)).live
            except NameConflict as e:
                return invalid(str(e), "NameConflict")
            keys_data, peer_ids = identity.ensure_role_keys(live.get("data"), identities, self.config.key_generator)

        service_monitor = self.config.service_monitors == "auto" and self.kube.serves(
            "monitoring.coreos.com/v1", "servicemonitors")
        plan = workloads.plan_workloads(obj, manifest, peer_ids, keys_data, settings, service_monitor=service_monitor)
        jobs = {c.name: self.kube.get("batch/v1", "Job", namespace, swarm.child_name(name, c.name))
                for c in plan.components if c.job}
        completed = workloads.run_completed(plan, jobs)
        if completed:
            plan = workloads.plan_workloads(obj, manifest, peer_ids, keys_data, settings, completed=True,
                                            service_monitor=service_monitor)

        observed: dict[str, dict[str, Any] | None] = {}
        error, error_reason = None, "ReconcileError"
        for child in plan.children:
            try:
                result = self.applier.apply(child)
            except NameConflict as e:
                error, error_reason = str(e), "NameConflict"
                continue
            if child["kind"] in ("StatefulSet", "Job"):
                observed[child["metadata"]["labels"][swarm.LABEL_COMPONENT]] = result.live
        self._delete_unwanted(obj, plan)

        reading = None
        backbone = next((c for c in plan.components if workloads.is_backbone(c.name)), None)
        url = workloads.live_status_url(plan, name, namespace, settings.cluster_domain)
        if backbone and url and int(((observed.get(backbone.name) or {}).get("status") or {}).get("readyReplicas") or 0):
            reading = self.config.status_reader(namespace, name, url)
            self.metrics.monitor_reads.labels("ok" if reading else "unavailable").inc()
        status = workloads.workload_status(
            kind=self.kind, generation=generation, previous=obj.get("status"), now=now, plan=plan, workloads=observed,
            reading=reading, completed=completed, error=error, error_reason=error_reason, settings=settings, name=name)
        if completed:  # the roles that ended the run left their last figures behind
            for component in (c for c in plan.components if c.job):
                report = self.final_report(namespace, name, component.name, jobs.get(component.name))
                status.update(workloads.final_figures(self.kind, report, status))
        self.write_status(obj, status)
        return status["phase"]

    def _delete_unwanted(self, owner: dict[str, Any], plan: "workloads.WorkloadPlan") -> None:
        """Children of this resource that the plan no longer has (a component switched off)."""
        meta = owner["metadata"]
        wanted = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in plan.children}
        for api_version, kind in self.CHILD_TYPES:
            for child in self.kube.list(api_version, kind, meta["namespace"]):
                child_meta = child.get("metadata") or {}
                owned = any(ref.get("uid") == meta.get("uid") for ref in child_meta.get("ownerReferences") or [])
                if owned and (api_version, kind, child_meta.get("name")) not in wanted:
                    self.applier.delete_if_managed(api_version, kind, meta["namespace"], child_meta["name"])


class BlockServerReconciler(WorkloadReconciler):
    kind = "BlockServer"


class ExpertPoolReconciler(WorkloadReconciler):
    kind = "ExpertPool"


def _managed(obj: dict[str, Any] | None) -> bool:
    from hivekeeper_operator.kube import LABEL_MANAGED_BY, MANAGED_BY

    return bool(obj) and (obj.get("metadata", {}).get("labels") or {}).get(LABEL_MANAGED_BY) == MANAGED_BY


CONTROLLER_CLASSES: dict[str, Callable[..., Reconciler]] = {
    "Swarm": SwarmReconciler, "BlockServer": BlockServerReconciler, "ExpertPool": ExpertPoolReconciler}


def controllers(kube: Kube, config: OperatorConfig, metrics: OperatorMetrics) -> dict[str, Reconciler]:
    unknown = [k for k in config.kinds if k not in CONTROLLER_CLASSES]
    if unknown:
        raise ValueError(f"no reconciler for kinds: {', '.join(unknown)}")
    return {kind: CONTROLLER_CLASSES[kind](kube, config, metrics) for kind in config.kinds}
