"""The averaging planner's inputs, read from real service endpoints: directly (ScrapeSource)
and through a real Prometheus server (PrometheusSource). Both must agree."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from prometheus_client import CollectorRegistry, Info

from hivekeeper.local.network import free_port
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.service import ServiceEndpoint
from hivekeeper.swarm.metrics_source import (
    MetricsSourceError,
    PeerMeasurement,
    PrometheusSource,
    ScrapeSource,
)

pytestmark = pytest.mark.timeout(120)

SWARM = "digits"
PEERS: list[dict[str, Any]] = [
    # info labels, then gauges (None: left at prometheus_client's default of 0)
    dict(swarm=SWARM, role="trainer", peer="trainer-0", peer_id="12D3KooWTrainer0", client_mode="false",
         sps=120.5, up=12_500_000.0, down=25_000_000.0),
    dict(swarm=SWARM, role="trainer", peer="trainer-1", peer_id="12D3KooWAlpha1", client_mode="true",
         sps=80.25, up=2_000_000.0, down=None),
    dict(swarm=SWARM, role="auxiliary", peer="auxiliary-0", peer_id="12D3KooWAux0", client_mode="false",
         sps=None, up=50_000_000.0, down=75_000_000.5),
    dict(swarm="other-swarm", role="trainer", peer="trainer-0", peer_id="12D3KooWOther0", client_mode="false",
         sps=999.0, up=1.0, down=1.0),
]
EXPECTED = sorted(
    [
        PeerMeasurement("12D3KooWTrainer0", "trainer-0", "trainer", False, 120.5, 12_500_000.0, 25_000_000.0),
        PeerMeasurement("12D3KooWAlpha1", "trainer-1", "trainer", True, 80.25, 2_000_000.0, None),
        PeerMeasurement("12D3KooWAux0", "auxiliary-0", "auxiliary", False, 0.0, 50_000_000.0, 75_000_000.5),
        # exports only its identity: every gauge absent
        PeerMeasurement("12D3KooWMonitor", "monitor", "monitor", True, 0.0, None, None),
    ],
    key=lambda m: m.peer_id,
)


class Garbage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"<html><body>this is not Prometheus text</body></html>\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def targets() -> Iterator[dict[str, list[str]]]:
    """Real service endpoints of two swarms, a garbage server and a closed port."""
    endpoints = []
    for peer in PEERS:
        metrics = SwarmMetrics()
        metrics.peer_info.info({key: peer[key] for key in ("swarm", "role", "peer", "peer_id", "client_mode")})
        for gauge, value in ((metrics.samples_per_second, peer["sps"]), (metrics.upload_bytes_per_second, peer["up"]),
                             (metrics.download_bytes_per_second, peer["down"])):
            if value is not None:
                gauge.set(value)
        endpoints.append(ServiceEndpoint(metrics.registry, "127.0.0.1", 0).start())
    bare = CollectorRegistry()  # a process that exports its identity and nothing else
    Info("hivekeeper_peer", "identity", registry=bare).info(
        {"swarm": SWARM, "role": "monitor", "peer": "monitor", "peer_id": "12D3KooWMonitor", "client_mode": "true"}
    )
    endpoints.append(ServiceEndpoint(bare, "127.0.0.1", 0).start())
    garbage = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    try:
        yield {
            "services": [f"127.0.0.1:{e.port}" for e in endpoints],
            "bad": [f"127.0.0.1:{garbage.server_address[1]}", f"127.0.0.1:{free_port()}"],
        }
    finally:
        for endpoint in endpoints:
            endpoint.stop()
        garbage.shutdown()
        garbage.server_close()


def test_scrape_source_measures_this_swarm_and_skips_bad_targets(targets, caplog):
    garbage, closed = targets["bad"]
    source = ScrapeSource(SWARM, targets["bad"] + targets["services"])
    with caplog.at_level(logging.WARNING, logger="hivekeeper.metrics_source"):
        assert source.measure() == EXPECTED
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert garbage in warned and closed in warned
    # targets may be a callable, asked again on every measure()
    current: list[str] = []
    dynamic = ScrapeSource(SWARM, lambda: current)
    assert dynamic.measure() == []
    current.extend(targets["services"])
    assert dynamic.measure() == EXPECTED


def wait_for(condition, deadline: float, what: str, log: Path):
    while time.monotonic() < deadline:
        try:
            result = condition()
            if result:
                return result
        except (OSError, MetricsSourceError):
            pass
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}; prometheus log:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def prometheus(targets, tmp_path_factory) -> Iterator[str]:
    """The URL of a real Prometheus server that has scraped every service target."""
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus binary is not installed")
    directory = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": "swarm", "static_configs": [{"targets": targets["services"] + targets["bad"]}]}
        ],
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    log = directory / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["prometheus", f"--config.file={directory / 'prometheus.yml'}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address={url.removeprefix('http://')}"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30

        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited: {log.read_text()[-3000:]}"
            with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as response:
                return response.status == 200

        wait_for(ready, deadline, "/-/ready", log)
        source = PrometheusSource(url, SWARM)
        wait_for(lambda: len(source.measure()) == len(EXPECTED), deadline, "every target scraped", log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_prometheus_source_agrees_with_scraping(targets, prometheus):
    source = PrometheusSource(prometheus, SWARM)
    assert source.measure() == ScrapeSource(SWARM, targets["services"] + targets["bad"]).measure() == EXPECTED
    assert PrometheusSource(prometheus, SWARM, namespace="elsewhere").measure() == []


def test_the_balancer_plans_alike_from_prometheus_and_from_scraping(targets, prometheus, tmp_path, monkeypatch):
    """A balancer pass through either source publishes the same signed plan."""
    from test_balancer_step import make_swarm

    plans = {}
    for name, source in {"prometheus": PrometheusSource(prometheus, SWARM),
                         "scrape": ScrapeSource(SWARM, targets["services"] + targets["bad"])}.items():
        (tmp_path / name).mkdir()
        swarm = make_swarm(tmp_path / name, monkeypatch, source)
        for m in EXPECTED:  # alive: their DHT records are there
            swarm.dht.reports[m.peer_id] = {"peerId": m.peer_id, "role": m.role, "name": m.name}
        swarm.passes(10.0)  # trainer-1 never measures: the plan waits replanSeconds for it...
        plan = swarm.step()  # ...and then goes without it
        plans[name] = (plan.digest, plan.peers, plan.steps_per_second, plan.averaging_seconds)
    assert plans["prometheus"] == plans["scrape"]
    # trainer-1 waits (its download is not measured yet); the monitor does not average
    assert {peer.name for peer in plans["scrape"][1]} == {"trainer-0", "auxiliary-0"}


def test_prometheus_source_raises_when_prometheus_cannot_answer(targets):
    unreachable = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MetricsSourceError, match=unreachable):
        PrometheusSource(unreachable, SWARM, timeout=1).measure()
    for not_prometheus in (targets["bad"][0], targets["services"][0]):  # garbage text; a 404
        with pytest.raises(MetricsSourceError, match=not_prometheus):
            PrometheusSource(f"http://{not_prometheus}", SWARM, timeout=1).measure()
