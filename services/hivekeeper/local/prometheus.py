"""`hivekeeper up --prometheus`: a real Prometheus (the `prometheus` binary, e.g. Debian's
package) scraping every process of a local run, so the chart's dashboards and alerts work on
one machine. Jobs are named as the Prometheus Operator names them in a cluster (NAME-COMPONENT,
after the per-component Services), which the alerts and dashboards rely on."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional

import yaml

from hivekeeper.errors import UserError
from hivekeeper.local.network import free_port
from hivekeeper.runtime.lifeline import exec_prefix
from hivekeeper.topology import METRICS, Role

SCRAPE_INTERVAL = "2s"  # local runs are short: see rounds as they happen


def scrape_config(name: str, roles: list[Role], host: str = "127.0.0.1") -> dict:
    jobs: dict[str, list[str]] = {}
    for role in roles:
        jobs.setdefault(f"{name}-{role.component}", []).append(f"{host}:{role.ports[METRICS]}")
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                           for job, targets in sorted(jobs.items())],
    }


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        raise UserError("--prometheus: no `prometheus` binary on PATH (Debian: apt install prometheus)")
    return found


class LocalPrometheus:
    """A Prometheus server for one run: config and data under RUN_DIR/prometheus, its log in
    RUN_DIR/logs/prometheus.log, listening on 127.0.0.1."""

    def __init__(self, run_dir: Path, name: str, roles: list[Role], binary: Optional[str] = None,
                 host: str = "127.0.0.1"):
        self.binary = binary or prometheus_binary()
        self.dir = run_dir / "prometheus"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = scrape_config(name, roles, host)
        self.process: Optional[subprocess.Popen] = None
        self.log_path = run_dir / "logs" / "prometheus.log"

    @classmethod
    def reopen(cls, run_dir: Path) -> "LocalPrometheus":
        """A Prometheus over a finished run's recorded data (query it at past times)."""
        prometheus = cls(run_dir, "", [])
        prometheus.config = yaml.safe_load((prometheus.dir / "prometheus.yml").read_text())
        return prometheus

    def __enter__(self) -> "LocalPrometheus":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        config = self.dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config, sort_keys=False))
        with open(self.log_path, "ab") as log:
            # its own session (Ctrl-C reaches only the runner), and it dies with the runner's
            # thread that starts it, however the runner ends (`runtime.lifeline`)
            self.process = subprocess.Popen(
                [*exec_prefix(), self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=7d"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited at start; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s; see {self.log_path}")

    def terminate(self) -> None:
        """Asks Prometheus to shut down (it closes its database cleanly) and returns at once: a
        run that stops its roles meanwhile ends both in the time of the longer."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def stop(self, timeout: float = 10.0) -> None:
        """Shuts Prometheus down: `timeout` seconds to close its database, then a kill."""
        self.terminate()
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
