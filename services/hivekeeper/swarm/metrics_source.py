"""What the averaging planner measures about each peer (the DeDLOC LP inputs): throughput,
bandwidth and whether it can accept connections, read from the services' Prometheus metrics.

Two sources give the same answer. `PrometheusSource` asks a Prometheus server, which is what a
cluster has: it already scrapes every pod, and its staleness handling drops dead targets.
`ScrapeSource` reads each service's /metrics itself, for swarms run without a Prometheus
(`hivekeeper` on a laptop, a bare-metal run). A peer is identified by `hivekeeper_peer_info`;
the gauges carry no identity labels, so they are matched to it per scrape target.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("hivekeeper.metrics_source")

PEER_INFO = "hivekeeper_peer_info"
SAMPLES_PER_SECOND = "hivekeeper_samples_per_second"
UPLOAD = "hivekeeper_upload_bytes_per_second"
DOWNLOAD = "hivekeeper_download_bytes_per_second"
GAUGES = (SAMPLES_PER_SECOND, UPLOAD, DOWNLOAD)


class MetricsSourceError(RuntimeError):
    """The source itself cannot be read, so the planner has no inputs at all."""


@dataclass(frozen=True)
class PeerMeasurement:
    peer_id: str
    name: str  # the `peer` label, e.g. "trainer-1"
    role: str
    client_mode: bool
    samples_per_second: float  # 0.0 when the series is absent
    upload_bytes_per_second: float | None  # None when absent or <= 0 (not measured yet)
    download_bytes_per_second: float | None


class MetricsSource(Protocol):
    def measure(self) -> list[PeerMeasurement]:
        """This swarm's peers, sorted by peer_id."""
        ...


def _rate(value: float | None) -> float | None:
    return value if value is not None and value > 0 else None


def _measurement(info: Mapping[str, str], gauges: Mapping[str, float]) -> PeerMeasurement:
    return PeerMeasurement(
        peer_id=info.get("peer_id", ""),
        name=info.get("peer", ""),
        role=info.get("role", ""),
        client_mode=info.get("client_mode") == "true",
        samples_per_second=gauges.get(SAMPLES_PER_SECOND, 0.0),
        upload_bytes_per_second=_rate(gauges.get(UPLOAD)),
        download_bytes_per_second=_rate(gauges.get(DOWNLOAD)),
    )


def from_report(report: Mapping[str, Any]) -> PeerMeasurement | None:
    """A peer's measurement as its own DHT report states it (trainers and auxiliaries put their
    samples/s and measured rates there), or None if the report lacks an identity. It stands in
    for a peer no source can read: a volunteer behind a NAT serves /metrics where no one in the
    cluster can scrape it."""
    peer_id, role = report.get("peerId"), report.get("role")
    if not isinstance(peer_id, str) or not isinstance(role, str):
        return None

    def number(key: str) -> float | None:
        value = report.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value) else None

    return PeerMeasurement(
        peer_id=peer_id,
        name=str(report.get("name", "")),
        role=role,
        client_mode=report.get("clientMode") is True,
        samples_per_second=max(number("samplesPerSecond") or 0.0, 0.0),
        upload_bytes_per_second=_rate(number("uploadBytesPerSecond")),
        download_bytes_per_second=_rate(number("downloadBytesPerSecond")),
    )


class ScrapeSource:
    """Scrapes http://TARGET/metrics of every target ("host:port") concurrently. A target that
    cannot be read is skipped with a warning: one bad peer must not hide the others."""

    def __init__(self, swarm: str, targets: Callable[[], Iterable[str]] | Iterable[str], timeout: float = 2.0):
        self.swarm = swarm
        self.timeout = timeout
        self._targets: Callable[[], Iterable[str]]
        if callable(targets):
            self._targets = targets
        else:
            fixed = tuple(targets)
            self._targets = lambda: fixed

    def measure(self) -> list[PeerMeasurement]:
        targets = list(self._targets())
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(targets)), thread_name_prefix="scrape") as pool:
            found = [m for m in pool.map(self._scrape, targets) if m is not None]
        return sorted(found, key=lambda m: m.peer_id)

    def _scrape(self, target: str) -> PeerMeasurement | None:
        url = f"http://{target}/metrics"
        info: dict[str, str] | None = None
        gauges: dict[str, float] = {}
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                text = response.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == PEER_INFO:
                        info = sample.labels
                    elif sample.name in GAUGES:
                        gauges[sample.name] = sample.value
        except (OSError, ValueError, http.client.HTTPException) as e:
            log.warning("skipping %s: %s", url, e)
            return None
        if info is None:
            log.warning("skipping %s: it exports no %s", url, PEER_INFO)
            return None
        if info.get("swarm") != self.swarm:
            return None
        return _measurement(info, gauges)


def _target(labels: Mapping[str, str]) -> tuple[str, str]:
    return labels.get("instance", ""), labels.get("job", "")


class PrometheusSource:
    """Instant queries against the Prometheus HTTP API; gauges are joined to
    `hivekeeper_peer_info` by the target labels `instance` and `job`."""

    def __init__(self, url: str, swarm: str, timeout: float = 5.0, namespace: str | None = None):
        self.url = url.rstrip("/")
        self.swarm = swarm
        self.timeout = timeout
        self.namespace = namespace

    def measure(self) -> list[PeerMeasurement]:
        scope = {} if self.namespace is None else {"namespace": self.namespace}
        infos = self._query(PEER_INFO, {**scope, "swarm": self.swarm})
        gauges: dict[tuple[str, str], dict[str, float]] = {}
        for name in GAUGES:
            for labels, value in self._query(name, scope):
                gauges.setdefault(_target(labels), {})[name] = value
        found = [_measurement(labels, gauges.get(_target(labels), {})) for labels, _ in infos]
        return sorted(found, key=lambda m: m.peer_id)

    def _query(self, metric: str, matchers: Mapping[str, str]) -> list[tuple[dict[str, str], float]]:
        selector = ",".join(f"{key}={json.dumps(value)}" for key, value in matchers.items())
        query = f"{metric}{{{selector}}}" if selector else metric
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                body = json.load(response)
        except urllib.error.HTTPError as e:
            raise MetricsSourceError(f"Prometheus at {self.url} rejected {query!r}: HTTP {e.code} {e.reason}") from e
        except (OSError, http.client.HTTPException) as e:
            raise MetricsSourceError(f"Prometheus at {self.url} is unreachable: {e}") from e
        except ValueError as e:
            raise MetricsSourceError(f"Prometheus at {self.url} did not answer with JSON: {e}") from e
        try:
            if body["status"] != "success" or body["data"]["resultType"] != "vector":
                raise ValueError(body.get("error", "not an instant vector"))
            return [(item["metric"], float(item["value"][1])) for item in body["data"]["result"]]
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
            raise MetricsSourceError(f"Prometheus at {self.url} answered {query!r} with garbage: {e!r}") from e
