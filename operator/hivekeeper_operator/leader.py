"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it
(kube-controller-manager, every controller-runtime operator): one replica holds the Lease and
reconciles; the others stand by and try every `retry_period`. The leader renews the Lease every
`retry_period`; one that could not renew for `renew_deadline` has lost it, and stops acting at
once. A standby takes a Lease nobody renewed for `lease_duration`, measured on its own clock
from the moment it last saw the Lease change (no trust in the other replica's clock). A leader
that stops cleanly releases the Lease, so a standby takes it at its next try.

kopf's own peering does not do this: operators of equal priority all pause."""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from hivekeeper_operator.kube import Kube, KubeError

log = logging.getLogger("hivekeeper.operator")

LEASE_API = "coordination.k8s.io/v1"


class LeadershipLost(RuntimeError):
    """The Lease could not be renewed in time, or another replica holds it now."""


def default_identity() -> str:
    """client-go's: the host name (a pod's name) and a unique part, so a restarted process is
    not taken for the one before it."""
    return f"{socket.gethostname()}_{uuid.uuid4()}"


@dataclass(frozen=True)
class LeaderElection:
    """Where the Lease is, who this replica is, and controller-runtime's default timing."""

    namespace: str
    lease_name: str = "hivekeeper-operator"
    identity: str = field(default_factory=default_identity)
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.lease_duration > self.renew_deadline > self.retry_period > 0:
            raise ValueError("leader election needs lease duration > renew deadline > retry period > 0")


def _micro_time(moment: datetime.datetime) -> str:
    """A Lease's MicroTime."""
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquires, renews and releases one Lease. `try_acquire_or_renew` and `release` block (the
    official client); `acquire` and `keep` are for the operator's event loop."""

    def __init__(self, kube: Kube, election: LeaderElection):
        self.kube, self.election = kube, election
        self._observed: dict[str, Any] | None = None  # the Lease's spec when it last changed
        self._observed_at = 0.0  # time.monotonic() then
        self._resource_version: str | None = None
        self._lock = threading.Lock()

    @property
    def identity(self) -> str:
        return self.election.identity

    @property
    def holder(self) -> str | None:
        """Who held the Lease when this replica last looked."""
        return (self._observed or {}).get("holderIdentity") or None

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        if spec != self._observed:
            self._observed, self._observed_at = spec, time.monotonic()
        self._resource_version = lease["metadata"].get("resourceVersion")

    def try_acquire_or_renew(self) -> bool:
        """One attempt: True if this replica holds the Lease now."""
        with self._lock:
            election = self.election
            now = datetime.datetime.now(datetime.timezone.utc)
            lease = self.kube.get(LEASE_API, "Lease", election.namespace, election.lease_name)
            mine = {"holderIdentity": election.identity, "leaseDurationSeconds": math.ceil(election.lease_duration),
                    "acquireTime": _micro_time(now), "renewTime": _micro_time(now), "leaseTransitions": 0}
            if lease is None:
                try:
                    self._observe(self.kube.create({"apiVersion": LEASE_API, "kind": "Lease", "metadata": {
                        "name": election.lease_name, "namespace": election.namespace}, "spec": mine}))
                except KubeError as e:
                    if e.status == 409:  # another replica created it first
                        return False
                    raise
                return True
            self._observe(lease)
            spec = self._observed or {}
            holder = spec.get("holderIdentity")
            if holder and holder != election.identity and \
                    time.monotonic() < self._observed_at + float(spec.get("leaseDurationSeconds") or 0):
                return False  # held, and renewed within its duration as far as this replica has seen
            if holder == election.identity:
                mine["acquireTime"] = spec.get("acquireTime") or mine["acquireTime"]
                mine["leaseTransitions"] = spec.get("leaseTransitions") or 0
            else:
                mine["leaseTransitions"] = (spec.get("leaseTransitions") or 0) + 1
            try:
                self._observe(self.kube.replace({**lease, "spec": mine}))
            except KubeError as e:
                if e.status == 409:  # someone wrote it since it was read
                    return False
                raise
            return True

    def release(self) -> None:
        """Give the Lease up (a clean stop), so that a standby takes it at its next try."""
        with self._lock:
            election = self.election
            lease = self.kube.get(LEASE_API, "Lease", election.namespace, election.lease_name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != election.identity:
                return
            now = _micro_time(datetime.datetime.now(datetime.timezone.utc))
            spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": now,
                    "renewTime": now}
            try:
                self.kube.replace({**lease, "spec": spec})
            except KubeError as e:
                if e.status != 409:  # 409: it changed hands meanwhile
                    raise
            log.info("leader lease released", extra={"fields": {"lease": self._where()}})

    def _where(self) -> str:
        return f"{self.election.namespace}/{self.election.lease_name}"

    async def _attempt(self, timeout: float) -> bool:
        """One attempt, given up after `timeout` (a request hanging on a lost connection)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.try_acquire_or_renew), timeout)
        except Exception as e:  # the API is away, or too slow: a failed attempt
            log.warning("leader lease attempt failed", extra={"fields": {"lease": self._where(), "error": str(e)}})
            return False

    async def acquire(self, stop: threading.Event) -> bool:
        """Stand by until this replica holds the Lease (True), or `stop` is set (False)."""
        standing_by = False
        while not stop.is_set():
            if await self._attempt(self.election.renew_deadline):
                log.info("leading", extra={"fields": {"lease": self._where(), "identity": self.identity}})
                return True
            if not standing_by:
                log.info("standing by", extra={"fields": {"lease": self._where(), "identity": self.identity,
                                                          "leader": self.holder}})
                standing_by = True
            await _pause(stop, self.election.retry_period * random.uniform(1.0, 1.2))
        return False

    async def keep(self, stop: threading.Event) -> None:
        """Renew the Lease every retry period until `stop` is set; raise LeadershipLost if it
        changed hands or could not be renewed for the renew deadline."""
        election = self.election
        renewed = time.monotonic()
        while not stop.is_set():
            await _pause(stop, election.retry_period)
            if stop.is_set():
                return
            left = renewed + election.renew_deadline - time.monotonic()
            if left > 0 and await self._attempt(left):
                renewed = time.monotonic()
                continue
            if self.holder not in (None, self.identity):
                raise LeadershipLost(f"lease {self._where()} is held by {self.holder}")
            if time.monotonic() - renewed >= election.renew_deadline:
                raise LeadershipLost(f"lease {self._where()} not renewed for {election.renew_deadline:g} s")


async def _pause(stop: threading.Event, seconds: float) -> None:
    """Sleep, but wake at once when `stop` is set (a signal handler sets it)."""
    deadline = time.monotonic() + seconds
    while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(left, 0.1))


class Leadership:
    """The gate every reconcile passes: open while this replica leads, and a count of the
    reconciles under way, so that a leader that stops can wait for them before it lets go."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._leading = False
        self._busy = 0

    @property
    def leading(self) -> bool:
        return self._leading

    def begin(self) -> None:
        with self._condition:
            self._leading = True

    def end(self) -> None:
        """No reconcile starts from now on."""
        with self._condition:
            self._leading = False

    def enter(self) -> bool:
        """Whether a reconcile may run now; if so, `leave()` when it is done."""
        with self._condition:
            if self._leading:
                self._busy += 1
            return self._leading

    def leave(self) -> None:
        with self._condition:
            self._busy -= 1
            self._condition.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Whether every reconcile under way has finished within `timeout`."""
        with self._condition:
            return self._condition.wait_for(lambda: self._busy == 0, timeout)
