"""`hivekeeper status [RUN_DIR]`: the live state of a local run, read from its monitor."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hivekeeper.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show the live state of a local run, or of any swarm's peers")
    parser.add_argument("run_dir", nargs="?", default=None, help="the run directory (default: the newest under runs/)")
    parser.add_argument("--json", action="store_true", help="print the monitor's status as JSON once")
    parser.add_argument("--watch", action="store_true", help="refresh every second until interrupted")
    parser.add_argument("--swarm", default=None, metavar="NAME",
                        help="read every peer's report from the swarm's DHT instead (local or in a cluster)")
    parser.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                        help="with --swarm: backbone multiaddrs (a resource's .status.initialPeers; default: "
                             "the run directory's)")
    parser.add_argument("--gateway", default=None, metavar="HOST:PORT",
                        help="with --swarm, for a swarm that admits peers by token: its token service "
                             "(default: the run directory's)")
    parser.add_argument("--invite", default=None, metavar="PATH", help="with --gateway: your invite file")
    parser.set_defaults(handler=run)


def _newest_run() -> Path:
    runs = sorted(Path("runs").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError("no run directory given and none found under runs/")
    return runs[-1].parent


def run(args: argparse.Namespace) -> int:
    from hivekeeper.local.progress import describe_plan, describe_round, fetch_status

    if args.swarm or args.initial_peers:
        return _from_dht(args)
    run_dir = Path(args.run_dir) if args.run_dir else _newest_run()
    summary_path = run_dir / "summary.json"
    port = _monitor_port(run_dir)
    host = _run_record(run_dir).get("host", "127.0.0.1")
    while True:
        status = fetch_status(port, host=host) if port else None
        if status is None:
            if summary_path.exists():
                summary = json.loads(summary_path.read_text())
                print(json.dumps(summary, indent=2) if args.json else
                      f"{run_dir}: {summary['state']} at step {summary['globalStep']}, metrics {summary['metrics']}")
                return 0
            raise UserError(f"{run_dir}: no monitor answers and no summary.json: is the run up?")
        if args.json:
            print(json.dumps(status, indent=2))
            return 0
        evals = ", ".join(f"{k} {v:.4f}" for k, v in (status.get("evalMetrics") or {}).items())
        print(f"step {status['globalStep']}  loss {status.get('loss')}  {status.get('samplesPerSecond', 0):.0f} "
              f"samples/s  peers {status.get('peersAlive')}  last round: {describe_round(status.get('lastRound'))}  "
              f"held-out: {evals or '-'}  plan: {describe_plan(status.get('plan'), status.get('stepsPerSecond'))}")
        if not args.watch:
            return 0
        time.sleep(1.0)


def _run_record(run_dir: Path) -> dict:
    path = run_dir / "run.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _monitor_port(run_dir: Path) -> int | None:
    """The port of the role whose /status shows the run's progress (a Swarm's monitor, ...)."""
    ports = run_dir / "ports.json"
    if ports.exists():
        role = _run_record(run_dir).get("progressRole") or "monitor-0"
        return json.loads(ports.read_text()).get(role)
    return None


def _from_dht(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from hivekeeper.peer_table import peer_table, read_reports

    peers = args.initial_peers
    if peers is None or not args.swarm:
        run = _run_record(Path(args.run_dir) if args.run_dir else _newest_run())
        peers = peers or run.get("initialPeers")
        args.swarm = args.swarm or run.get("name")
        if not args.gateway and run.get("gateway"):
            args.gateway, args.invite = run["gateway"], args.invite or run.get("invite")
        if not peers or not args.swarm:
            raise UserError("--swarm NAME --initial-peers MADDR...: give both, or a local run directory")
    if args.gateway and not args.invite:
        raise UserError("--gateway needs --invite: the token service admits only invited peers")
    authorizer = None
    if args.gateway:
        from hivekeeper.auth.authorizer import make_authorizer

        authorizer = make_authorizer(args.gateway, args.invite, patience=10)
    try:
        reports = read_reports(peers, args.swarm, authorizer)
    except Exception as e:  # hivemind raises what the bootstrap met: unreachable, a bad multiaddr...
        raise UserError(f"cannot reach the swarm through {' '.join(peers)}: {e}") from None
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    console = Console()
    if not args.watch:
        console.print(peer_table(args.swarm, reports))
        return 0
    with Live(peer_table(args.swarm, reports), console=console, refresh_per_second=1) as live:
        while True:
            time.sleep(1.0)
            live.update(peer_table(args.swarm, read_reports(peers, args.swarm)))
