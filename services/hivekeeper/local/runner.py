"""`hivekeeper up`: run a manifest's roles as supervised processes on loopback until the
monitor says the run is done, then write DIR/summary.json."""

from __future__ import annotations

import json
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from hivekeeper.local.access import ADMIN_INVITE, provision_access
from hivekeeper.local.identity import ensure_identity
from hivekeeper.local.network import LocalNetwork
from hivekeeper.local.progress import ProgressView, fetch_status
from hivekeeper.local.prometheus import LocalPrometheus
from hivekeeper.local.supervisor import KILLED_SECONDS, Supervisor
from hivekeeper.kinds import runtime
from hivekeeper.spec import Manifest
from hivekeeper.topology import METRICS, P2P

POLL_SECONDS = 0.5


def prepare_run(manifest: Manifest, run_dir: Path, host: str = "127.0.0.1") -> tuple[Path, list]:
    """Write the rendered manifest and the keys of the roles others must know in advance (the
    backbone's, the balancer's, the relays'), and lay out every role."""
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = run_dir / "manifest.json"
    manifest_path.write_text(json.dumps(manifest.model_dump(by_alias=True, mode="json", exclude_none=True), indent=2))
    network = LocalNetwork(run_dir, host, manifest.spec.volunteers)
    kind = runtime(manifest.kind)
    peer_ids = {name: ensure_identity(Path(network.identity_path(name))) for name in kind.identity_roles(manifest)}
    roles = kind.roles(manifest, network, peer_ids, str(manifest_path.resolve()), str(run_dir.resolve()))
    admits_by_token = any(role.component == "auth" for role in roles)
    if admits_by_token:
        provision_access(manifest, network, roles, peer_ids)
    (run_dir / "ports.json").write_text(json.dumps({role.name: role.ports[METRICS] for role in roles}, indent=2))
    backbone = [r for r in roles if r.backbone]
    progress = next((r.name for r in roles if r.completes_run), None)
    (run_dir / "run.json").write_text(json.dumps({
        "kind": manifest.kind, "name": manifest.metadata.name, "host": host,
        "progressRole": progress,  # whose /status shows the run's progress (`hivekeeper status`)
        "initialPeers": [network.backbone_maddr(r.index, r.ports[P2P], peer_ids[r.name], r.component)
                         for r in backbone if r.name in peer_ids],
        **({"gateway": network.gateway_address(), "invite": network.access_path(ADMIN_INVITE)}
           if admits_by_token else {}),
    }, indent=2))
    return manifest_path, roles


def run_locally(manifest: Manifest, run_dir: Path, console: Console | None = None,
                prometheus: bool = False, host: str = "127.0.0.1") -> dict[str, Any]:
    console = console or Console(stderr=True)
    started = time.time()
    _, roles = prepare_run(manifest, run_dir, host)
    (run_dir / "result.json").unlink(missing_ok=True)
    supervisor = Supervisor(roles, run_dir / "logs", host=host)
    monitor = next((r for r in roles if r.completes_run), None)
    scraper = LocalPrometheus(run_dir, manifest.metadata.name, roles, host=host) if prometheus else None

    console.print(f"[bold]{manifest.metadata.name}[/]: {len(roles)} processes, run directory {run_dir}")
    for role in roles:
        console.print(f"  {role.name:<12} metrics http://{host}:{role.ports[METRICS]}/metrics", highlight=False)
    if any(role.component == "auth" for role in roles):
        console.print(f"  volunteers   hivekeeper join {_gateway(run_dir)} --token "
                      f"$(hivekeeper invite {run_dir} --identity NAME)", highlight=False)
    if scraper:
        scraper.start()
        (run_dir / "prometheus.url").write_text(scraper.url)
        console.print(f"  prometheus   {scraper.url} (scraping every process; dashboards: charts/hivekeeper/dashboards)",
                      highlight=False)

    interrupted = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: interrupted.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    completed = False
    try:
        supervisor.start(ready_first=lambda role: role.backbone or role.component == "auth")
        with ProgressView(manifest.metadata.name, supervisor, runtime(manifest.kind).target_steps(manifest), console) as view:
            while not interrupted.is_set():
                if supervisor.poll():
                    completed = True
                    break
                view.update(fetch_status(monitor.ports[METRICS], host=host) if monitor else None)
                interrupted.wait(POLL_SECONDS)
    finally:
        console.print("stopping all processes..." if not completed else "run complete; stopping peers...")
        if scraper:  # shuts down beside the roles: all of it within the 10 s a user waits after Ctrl-C
            scraper.terminate()
        supervisor.stop()
        if scraper:
            scraper.stop(KILLED_SECONDS)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    summary = build_summary(manifest, run_dir, supervisor, started, completed, interrupted.is_set())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _gateway(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["gateway"]


def build_summary(manifest: Manifest, run_dir: Path, supervisor: Supervisor, started: float, completed: bool,
                  interrupted: bool) -> dict[str, Any]:
    result_path = run_dir / "result.json"
    result = json.loads(result_path.read_text()) if completed and result_path.exists() else {}
    history = read_history(run_dir)
    rates = [entry["samplesPerSecond"] for entry in history if entry.get("samplesPerSecond")]
    plan = next((entry["plan"] for entry in reversed(history) if entry.get("plan")), None)
    achieved, predicted = step_rates(history)
    last = history[-1] if history else {}  # where a run that did not finish got to
    return {
        "name": manifest.metadata.name,
        "kind": manifest.kind,
        "state": "completed" if result else ("interrupted" if interrupted else "failed"),
        "reason": result.get("reason"),
        "globalStep": result.get("globalStep", last.get("globalStep")),
        "wallSeconds": round(time.time() - started, 2),
        "restarts": supervisor.restarts,
        "metrics": result.get("metrics") or last.get("evalMetrics") or {},
        "samplesPerSecond": round(statistics.median(rates), 1) if rates else None,
        "checkpoint": result.get("checkpoint"),
        "plan": plan,  # the balancer's last averaging plan, as the monitor saw it
        # global steps/s over the training (first step to last), against the plans' median prediction
        "achievedStepsPerSecond": achieved,
        "predictedStepsPerSecond": predicted,
        "efficiency": round(achieved / predicted, 3) if achieved is not None and predicted else None,
        "losses": result.get("losses", {}),
        "processes": {
            child.role.name: {
                "restarts": child.restarts,
                "exitCodes": child.exit_codes,
                "metrics": f"http://{supervisor.host}:{child.role.ports[METRICS]}/metrics",
                "log": str(child.log_path),
            }
            for child in supervisor.children
        },
    }


def step_rates(history: list[dict[str, Any]]) -> tuple[Optional[float], Optional[float]]:
    """A run's achieved global steps/s, from its first step to its last (the monitor's history),
    and the median of what the plans predicted meanwhile; None where there is too little."""
    steps = [(e["elapsedSeconds"], e["globalStep"]) for e in history if (e.get("globalStep") or 0) > 0]
    last = next((i for i in range(len(steps) - 1, 0, -1) if steps[i][1] > steps[i - 1][1]), None)
    if last is None or steps[last][0] - steps[0][0] < 5.0:
        return None, None
    (t0, s0), (t1, s1) = steps[0], steps[last]
    predictions = [e["plan"]["stepsPerSecond"] for e in history
                   if t0 <= e.get("elapsedSeconds", -1) <= t1 and (e.get("plan") or {}).get("stepsPerSecond")]
    return round((s1 - s0) / (t1 - t0), 4), round(statistics.median(predictions), 4) if predictions else None


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The monitor's records in RUN_DIR/history.jsonl, oldest first; none before it starts."""
    path = run_dir / "history.jsonl"
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return entries
