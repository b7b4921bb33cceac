"""Reading a swarm's live figures. The operator asks the monitor's /status (the same JSON
`hivekeeper status` shows locally) through the monitor's headless Service; tests pass their
own reader instead."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

from hivekeeper_operator.network import METRICS_PORT

log = logging.getLogger("hivekeeper.operator")

# (namespace, swarm name, monitor URL) -> the monitor's /status JSON, or None if it does not answer
StatusReader = Callable[[str, str, str], Optional[dict[str, Any]]]


def monitor_url(swarm: str, namespace: str, cluster_domain: str) -> str:
    return f"http://{swarm}-monitor.{namespace}.svc.{cluster_domain}:{METRICS_PORT}/status"


def http_status_reader(timeout: float = 2.0) -> StatusReader:
    def read(namespace: str, name: str, url: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (cluster-internal URL)
                value = json.loads(response.read())
                return value if isinstance(value, dict) else None
        except (OSError, urllib.error.URLError, ValueError) as e:
            log.debug("monitor status unavailable", extra={"fields": {"url": url, "error": str(e)}})
            return None

    return read


def no_status_reader(namespace: str, name: str, url: str) -> dict[str, Any] | None:
    return None
