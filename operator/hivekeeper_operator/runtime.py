"""The operator process: kopf watches the hivekeeper resources and reacts to every change at
once; a resync loop reconciles every resource every few seconds (pods become ready, the
monitor's figures move, a child is deleted or edited by hand). Both call the same reconcilers,
which server-side apply every child: a deleted child is made again, a hand edit of a field the
operator sets is set back. An HTTP endpoint serves /metrics, /healthz and /readyz.

With leader election, only the replica that holds the Lease runs kopf and the resync loop; the
others stand by (alive and ready) until it is theirs. A leader that loses the Lease stops
reconciling at once; one that stops cleanly finishes its reconciles and releases the Lease.

kopf's timers would add a finalizer to every resource (deleting one would then need a running
operator); the resync loop needs none: children go with their owner through ownerReferences."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Any, Callable

import kopf

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.service import ServiceEndpoint

from hivekeeper_operator.events import EventRecorder
from hivekeeper_operator.kube import Kube
from hivekeeper_operator.leader import LeaderElector, Leadership, LeadershipLost
from hivekeeper_operator.metrics import OperatorMetrics
from hivekeeper_operator.reconcile import OperatorConfig, Reconciler, controllers

log = logging.getLogger("hivekeeper.operator")
LIVENESS_SECONDS = 60.0
RELEASE_WAIT_SECONDS = 5.0  # a stopping leader waits this long for its reconciles, then for the release


def authorization_header(configuration: Any) -> str | None:
    """The Authorization header the official client itself sends. Its loaders keep the whole
    header ("bearer TOKEN", "Basic ...") under api_key['BearerToken'] (client >= 36; before:
    'authorization'); asking through auth_settings() runs the refresh hook, which re-reads a
    rotated service-account token file or an expired exec / auth-provider token."""
    value = (configuration.auth_settings().get("BearerToken") or {}).get("value")
    return value.strip() if isinstance(value, str) and value.strip() else None


def connection_info(configuration: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from a `kubernetes.client.Configuration`, however it was loaded:
    in-cluster, a kubeconfig token, exec or auth-provider plugin, client certificate, basic auth."""
    header = authorization_header(configuration)
    scheme, _, token = header.partition(" ") if header else ("", "", "")
    if scheme and not token:  # a bare token (api_key set by hand, without a prefix)
        scheme, token = "Bearer", scheme
    basic = not header  # kopf prefers username/password to a token; the client sends its header alone
    return kopf.ConnectionInfo(
        server=configuration.host, ca_path=configuration.ssl_ca_cert, insecure=not configuration.verify_ssl,
        username=(configuration.username or None) if basic else None,
        password=(configuration.password or None) if basic else None, scheme=scheme or None,
        token=token.strip() or None, certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file, proxy_url=configuration.proxy)


class OperatorEndpoint(ServiceEndpoint):
    """/healthz fails when the operator's event loop stops beating (stuck or dead)."""

    beat = time.monotonic()

    @property  # type: ignore[override]
    def alive(self) -> bool:
        return time.monotonic() - self.beat < LIVENESS_SECONDS

    @alive.setter
    def alive(self, value: bool) -> None:
        pass


class Operator:
    """`on_lost_leadership(error)` is called when the Lease is lost; by default the operator
    stops and `stop()` raises the error. The command line ends the process instead."""

    def __init__(self, config: OperatorConfig, kube: Kube | None = None,
                 on_lost_leadership: Callable[[LeadershipLost], None] | None = None):
        self.config = config
        self.kube = kube or Kube.from_environment(config.kubeconfig)
        self.metrics = OperatorMetrics()
        election = config.leader_election
        self.elector = LeaderElector(Kube(self.kube.api_client, request_timeout=election.renew_deadline / 2),
                                     election) if election else None
        self.leadership = Leadership()
        self.on_lost_leadership = on_lost_leadership or self._stop_for
        self.events = EventRecorder(self.kube, instance=election.identity if election else None)
        self.controllers: dict[str, Reconciler] = controllers(self.kube, config, self.metrics, self.events)
        self.registry = self._build_registry()
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.resynced = threading.Event()
        self.endpoint: OperatorEndpoint | None = None
        self.last_resync: float | None = None
        self._phases_exported: dict[str, set[str]] = {}  # kind -> phases it has a resources series for
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- kopf wiring -------------------------------------------------------------------------

    def _build_registry(self) -> kopf.OperatorRegistry:
        registry = kopf.OperatorRegistry()
        configuration = self.kube.api_client.configuration

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:  # again on every 401: a rotated token is read then
            return connection_info(configuration)

        for controller in self.controllers.values():
            self._register(registry, controller)
        return registry

    def _register(self, registry: kopf.OperatorRegistry, controller: Reconciler) -> None:
        def handle(namespace: str, name: str, **_: Any) -> None:
            try:
                self.reconcile(controller, namespace, name)
            except Exception as e:
                raise kopf.TemporaryError(f"{controller.kind} {namespace}/{name}: {e}", delay=10) from e

        resource = (API_GROUP, API_VERSION, controller.plural)
        kind = controller.kind.lower()
        for event in (kopf.on.resume, kopf.on.create, kopf.on.update):
            event(*resource, id=f"{kind}-{event.__name__}", registry=registry)(handle)

    def kopf_settings(self) -> kopf.OperatorSettings:
        settings = kopf.OperatorSettings()
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=API_GROUP, key="last-handled-configuration")
        settings.persistence.finalizer = f"{API_GROUP}/finalizer"  # used only if a handler ever needs one
        settings.posting.enabled = False  # the reconcilers write the Events, one per repeated failure
        settings.execution.max_workers = 4
        settings.networking.request_timeout = 30
        settings.watching.server_timeout = 300
        # The CRDs come with the chart before the operator starts: no need to watch
        # CustomResourceDefinitions (a cluster-scoped permission a namespaced install lacks).
        settings.scanning.disabled = True
        return settings

    # -- reconciling, while leading ----------------------------------------------------------

    def reconcile(self, controller: Reconciler, namespace: str, name: str) -> str | None:
        """One resource's reconcile, if this replica leads (else None)."""
        if not self.leadership.enter():
            return None
        try:
            return controller.reconcile(namespace, name)
        finally:
            self.leadership.leave()

    async def _lead(self) -> None:
        """Renew the Lease while the operator runs; at a clean stop, release it once the
        reconciles under way are done (one still running after a while: it expires instead)."""
        assert self.elector is not None
        try:
            await self.elector.keep(self.stop_flag)
        except LeadershipLost as e:
            self.leadership.end()
            log.error("leadership lost", extra={"fields": {"error": str(e)}})
            self.on_lost_leadership(e)
            return
        self.leadership.end()
        if await asyncio.to_thread(self.leadership.wait_idle, RELEASE_WAIT_SECONDS):
            try:
                await asyncio.wait_for(asyncio.to_thread(self.elector.release), RELEASE_WAIT_SECONDS)
            except Exception as e:  # it expires instead
                log.warning("cannot release the leader lease", extra={"fields": {"error": str(e)}})

    def _stop_for(self, error: LeadershipLost) -> None:
        self._error = error
        self.stop_flag.set()

    # -- the resync loop ---------------------------------------------------------------------

    async def _resync_loop(self) -> None:
        while not self.ready_flag.is_set():  # kopf has logged in and started
            await asyncio.sleep(0.05)
        self._stop_on_signals()  # kopf has put its own handlers in place of ours by now
        while not self.stop_flag.is_set():
            await self.resync()
            self.resynced.set()
            if self.endpoint:
                self.endpoint.ready.set()
            await asyncio.sleep(self.config.resync_seconds)

    async def resync(self) -> None:
        for kind, controller in self.controllers.items():
            try:
                objects = await asyncio.to_thread(controller.list)
            except Exception as e:  # the API is away: try again next round
                log.warning("resync list failed", extra={"fields": {"kind": kind, "error": str(e)}})
                controller.metrics.errors.labels(kind, "ListFailed").inc()
                continue
            phases: dict[str, int] = {}
            for obj in objects:
                meta = obj.get("metadata", {})
                try:
                    phase = await asyncio.to_thread(self.reconcile, controller, meta.get("namespace"), meta.get("name"))
                except Exception as e:
                    log.warning("reconcile failed", extra={"fields": {
                        "kind": kind, "name": f"{meta.get('namespace')}/{meta.get('name')}", "error": str(e)}})
                    phase = "Error"
                if phase:
                    phases[phase] = phases.get(phase, 0) + 1
            for phase in self._phases_exported.get(kind, set()) - phases.keys():
                self.metrics.resources.labels(kind, phase).set(0)  # none of this kind is in it any more
            self._phases_exported[kind] = self._phases_exported.get(kind, set()) | phases.keys()
            for phase, count in phases.items():
                self.metrics.resources.labels(kind, phase).set(count)
        self.last_resync = time.time()

    async def _heartbeat(self) -> None:
        while not self.stop_flag.is_set():
            OperatorEndpoint.beat = time.monotonic()
            await asyncio.sleep(5)

    # -- running -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"kinds": list(self.controllers), "namespaces": list(self.config.namespaces) or "all",
                "kopfReady": self.ready_flag.is_set(), "lastResync": self.last_resync,
                "leading": self.leadership.leading,
                **({"identity": self.elector.identity, "leader": self.elector.holder} if self.elector else {})}

    def _stop_on_signals(self) -> None:
        """SIGTERM and SIGINT set the stop flag. kopf installs handlers of its own as it starts
        (in the main thread): they stop kopf too, but leave its waiter on our stop flag hanging,
        and kopf gives hanging tasks 5 s before it cancels them."""
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop_flag.set)

    async def main(self) -> None:
        """Until the stop flag is set (`stop()`, SIGTERM, SIGINT) or the Lease is lost."""
        self._stop_on_signals()  # while importing, before kopf starts
        if self.config.metrics_port is not None:
            self.endpoint = OperatorEndpoint(self.metrics.registry, self.config.metrics_host,
                                             self.config.metrics_port, status=self.status).start()
        # Created before kopf starts: kopf would take later tasks for its own hung ones, and
        # keep the shutdown waiting 5 s for them.
        tasks = [asyncio.create_task(self._heartbeat())]
        leading: asyncio.Task | None = None
        try:
            if self.elector is not None:
                if self.endpoint:
                    self.endpoint.ready.set()  # a standby is ready: a rollout goes on while another leads
                if not await self.elector.acquire(self.stop_flag):
                    return
                leading = asyncio.create_task(self._lead())
            self.leadership.begin()
            tasks.append(asyncio.create_task(self._resync_loop()))
            await kopf.operator(registry=self.registry, settings=self.kopf_settings(),
                                clusterwide=not self.config.namespaces, namespaces=list(self.config.namespaces),
                                standalone=True,  # leader election is the Lease's, not kopf's peering
                                stop_flag=self.stop_flag, ready_flag=self.ready_flag)
        finally:
            # However kopf ended (an error; a signal its own handlers caught before ours were back),
            # release its executor thread that waits on the stop flag: asyncio.run joins it.
            self.stop_flag.set()
            if leading is not None:
                await leading  # the Lease released, or lost
            self.leadership.end()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.endpoint:
                self.endpoint.stop()

    def run(self) -> None:
        asyncio.run(self.main())

    def start(self) -> "Operator":
        """Run in a background thread (tests, embedding); `stop()` ends it."""

        def target() -> None:
            try:
                self.run()
            except BaseException as e:  # noqa: BLE001 (reported by stop())
                self._error = e

        self._thread = threading.Thread(target=target, name="hivekeeper-operator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Sets the stop flag and waits for the thread `start()` began; raises what ended it.
        kopf stops in about a second on an idle machine, ten times that on a loaded one."""
        self.stop_flag.set()
        if self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError("the operator did not stop in time")
        if self._error:
            raise self._error
