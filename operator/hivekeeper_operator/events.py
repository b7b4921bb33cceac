"""Kubernetes Events on hivekeeper resources, which `kubectl describe` lists: phase changes,
scaling of a component, reconcile errors and invalid specs.

As client-go's recorder does, an Event that repeats (the same error at every resync) is one
Event whose count and lastTimestamp grow, not a new Event each time. What was recorded is
remembered in this process only: a new operator (a restart, another leader) starts new Events."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hivekeeper_operator.conditions import now_rfc3339
from hivekeeper_operator.kube import MANAGED_BY, Kube, KubeError

log = logging.getLogger("hivekeeper.operator")

NORMAL, WARNING = "Normal", "Warning"
MESSAGE_LIMIT = 1024  # what events.k8s.io allows a note; core/v1 messages are kept as short


@dataclass
class _Recorded:
    name: str
    count: int


class EventRecorder:
    """Writes core/v1 Events about an object; thread-safe (the reconcilers run in threads)."""

    def __init__(self, kube: Kube, component: str = MANAGED_BY, instance: str | None = None,
                 remembered: int = 4096):
        self.kube, self.component = kube, component
        self.instance = instance or socket.gethostname()
        self.remembered = remembered
        self._recorded: OrderedDict[tuple[str, str, str, str], _Recorded] = OrderedDict()  # least recent first
        self._lock = threading.Lock()

    def normal(self, obj: dict[str, Any], reason: str, message: str) -> None:
        self.record(obj, NORMAL, reason, message)

    def warning(self, obj: dict[str, Any], reason: str, message: str) -> None:
        self.record(obj, WARNING, reason, message)

    def record(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """An Event, or one more count of the same Event; a failure to write it is logged, never raised."""
        meta = obj["metadata"]
        message = message if len(message) <= MESSAGE_LIMIT else message[:MESSAGE_LIMIT - 3] + "..."
        key = (meta.get("uid") or "", type_, reason, message)
        try:
            with self._lock:  # one writer per Event: two threads must not both count it as new
                seen = self._recorded.get(key)
                if seen is not None and self._count_again(meta["namespace"], seen):
                    self._recorded.move_to_end(key)
                    return
                self._recorded[key] = _Recorded(self._create(obj, type_, reason, message), 1)
                while len(self._recorded) > self.remembered:
                    self._recorded.popitem(last=False)
        except (KubeError, OSError) as e:  # an Event is worth less than the reconcile that reports it
            log.warning("cannot record an event", extra={"fields": {
                "resource": f"{obj.get('kind')} {meta.get('namespace')}/{meta.get('name')}", "reason": reason,
                "error": str(e)}})

    def _count_again(self, namespace: str, seen: _Recorded) -> bool:
        """One more occurrence on the Event already written; False if it is gone (Events expire)."""
        try:
            self.kube.merge_patch(self.kube.path("v1", "Event", namespace, seen.name),
                                  {"count": seen.count + 1, "lastTimestamp": now_rfc3339()})
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        seen.count += 1
        return True

    def _create(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> str:
        meta = obj["metadata"]
        now = now_rfc3339()
        name = f"{meta['name']}.{time.time_ns():x}"  # client-go's naming: unique, sorts by time
        self.kube.create({
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_, "reason": reason, "message": message,
            "source": {"component": self.component},
            "reportingComponent": self.component, "reportingInstance": self.instance,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        })
        return name
