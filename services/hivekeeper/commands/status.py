"""`hivekeeper status [RUN_DIR]`: the live state of a local run, read from its monitor, or of any
swarm's peers, read from its DHT. On a terminal it shows a table, which `--watch` redraws in place;
to a pipe or a log it prints plain text, one line (the DHT view: one table) per refresh."""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table

from hivekeeper.errors import UserError

Frame = TypeVar("Frame")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="show the live state of a local run, or of any swarm's peers")
    parser.add_argument("run_dir", nargs="?", default=None, help="the run directory (default: the newest under runs/)")
    parser.add_argument("--json", action="store_true", help="print the monitor's status as JSON once")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted (or until the run ends)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="with --watch: between refreshes")
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


def run(args: argparse.Namespace) -> int:
    if args.swarm or args.initial_peers:
        return _from_dht(args)
    return _from_monitor(args)


def show(console: Console, frames: Iterable[Frame], table: Callable[[Frame], RenderableType],
         plain: Callable[[Frame], RenderableType]) -> None:
    """Each frame as a table redrawn in place on a terminal; appended as plain text otherwise
    (pipes, CI logs), where cursor movements would garble the output."""
    if not console.is_terminal:
        for frame in frames:
            console.print(plain(frame), highlight=False, soft_wrap=True)
        return
    with Live(console=console, auto_refresh=False) as live:
        for frame in frames:
            live.update(table(frame), refresh=True)


def _polled(first: Frame, read: Callable[[], Optional[Frame]], watch: bool, interval: float) -> Iterator[Frame]:
    """`first`, then (with `watch`) a fresh read every `interval` seconds until one reads None."""
    frame: Optional[Frame] = first
    while frame is not None:
        yield frame
        if not watch:
            return
        time.sleep(interval)
        frame = read()


def _newest_run() -> Path:
    runs = sorted(Path("runs").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise UserError("no run directory given and none found under runs/")
    return runs[-1].parent


def _from_monitor(args: argparse.Namespace) -> int:
    from hivekeeper.local.progress import fetch_status

    run_dir = Path(args.run_dir) if args.run_dir else _newest_run()
    port = _monitor_port(run_dir)
    host = _run_record(run_dir).get("host", "127.0.0.1")

    def read() -> Optional[dict[str, Any]]:
        return fetch_status(port, host=host) if port else None

    status = read()
    if status is not None and args.json:
        print(json.dumps(status, indent=2))
        return 0
    if status is not None:
        show(Console(), _polled(status, read, args.watch, args.interval),
             lambda s: status_table(run_dir.name, s), status_line)
        if not args.watch:
            return 0
    # the monitor does not answer (any more): a finished run left its summary
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise UserError(f"{run_dir}: no monitor answers and no summary.json: is the run up?")
    summary = json.loads(summary_path.read_text())
    print(json.dumps(summary, indent=2) if args.json else
          f"{run_dir}: {summary['state']} at step {summary['globalStep']}, metrics {summary['metrics']}"
          + (f", {summary['achievedStepsPerSecond']} steps/s against {summary['predictedStepsPerSecond']} predicted "
             f"(efficiency {summary['efficiency']})" if summary.get("efficiency") is not None else ""))
    return 0


def _peers(status: dict[str, Any]) -> str:
    alive = status.get("peersAlive") or {}
    return ", ".join(f"{n} {role}" for role, n in sorted(alive.items())) or "-"


def _held_out(status: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in (status.get("evalMetrics") or {}).items()) or "-"


def _number(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def status_line(status: dict[str, Any]) -> str:
    """One line of a progress role's /status, for logs."""
    from hivekeeper.local.progress import describe_plan, describe_round

    return (f"{time.strftime('%H:%M:%S')} step {status.get('globalStep')}  loss {_number(status.get('loss'), '.4f')}  "
            f"{_number(status.get('samplesPerSecond'), '.0f')} samples/s  peers {_peers(status)}  "
            f"last round: {describe_round(status.get('lastRound'))}  held-out: {_held_out(status)}  "
            f"plan: {describe_plan(status.get('plan'), status.get('stepsPerSecond'))}")


def status_table(name: str, status: dict[str, Any]) -> Table:
    """A progress role's /status as a two-column table: the rows every kind has, then those
    of the kind (averaging for a Swarm, experts for an ExpertPool, the chain for a BlockServer)."""
    from hivekeeper.local.progress import describe_plan, describe_round

    table = Table(title=f"{name}  ({_number(status.get('elapsedSeconds'), '.0f')}s)", title_justify="left",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [("global step", str(status.get("globalStep", "-"))),
            ("loss", _number(status.get("loss"), ".4f")),
            ("samples/s", _number(status.get("samplesPerSecond"), ".1f")),
            ("peers alive", _peers(status)),
            ("held-out", f"{_held_out(status)} (step {status.get('evalStep')})")]
    if "lastRound" in status:
        rows.append(("last averaging", describe_round(status["lastRound"])))
    if "plan" in status:
        rows.append(("averaging plan", describe_plan(status["plan"], status.get("stepsPerSecond"))))
    if status.get("efficiency") is not None:
        rows.append(("efficiency", f"{status['efficiency']:.2f} (achieved {status['achievedStepsPerSecond']:.3f} "
                                   f"/ predicted {status['predictedStepsPerSecond']:.3f} steps/s)"))
    if "expertRequests" in status:
        requests = status["expertRequests"]
        rows += [("experts alive", str(status.get("expertsAlive", "-"))),
                 ("expert requests", f"{requests.get('ok', 0)} ok, {requests.get('failed', 0)} failed"),
                 ("batches dropped", str(status.get("failedBatches", "-"))),
                 ("beam search", f"{_number(status.get('beamSearchSeconds'), '.4f')} s (median)")]
    if "chain" in status:
        rows += [("chain", " ".join(status["chain"]) or "-"), ("failovers", str(status.get("failovers", 0)))]
    for row in rows:
        table.add_row(*row)
    return table


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
    from hivekeeper.peer_table import read_reports, status_view

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

    def read() -> list[dict[str, Any]]:
        """Every read, the first and each refresh, signs with the token where the swarm needs one."""
        try:
            return read_reports(peers, args.swarm, authorizer)
        except Exception as e:  # hivemind raises what the bootstrap met: unreachable, a bad multiaddr...
            raise UserError(f"cannot reach the swarm through {' '.join(peers)}: {e}") from None

    reports = read()
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    table = partial(status_view, args.swarm)
    show(Console(), _polled(reports, read, args.watch, args.interval), table, table)
    return 0
