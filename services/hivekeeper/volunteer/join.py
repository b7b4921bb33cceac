"""`hivekeeper join`: a volunteer's one command. Trade the invite for access at the swarm's
token service, find out how this machine can take part (volunteer.connectivity), then run the
role the resource's kind needs (a trainer, a block server, an expert server) under the local
supervisor with `hivekeeper up`'s progress display, until the swarm's run ends or Ctrl-C.

RUN_DIR/join.json says what was decided and when each milestone came (seconds since the
command started), and is rewritten as they come; RUN_DIR/summary.json is written at the end."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console

from hivekeeper.errors import UserError
from hivekeeper.kinds import KIND_MODULES, runtime
from hivekeeper.local.identity import ensure_identity
from hivekeeper.local.network import free_port
from hivekeeper.local.progress import ProgressView, fetch_status
from hivekeeper.local.supervisor import Supervisor
from hivekeeper.topology import METRICS, VOLUNTEER_INDEX, Role
from hivekeeper.volunteer.connectivity import CLIENT, RELAY, Connectivity, Unreachable, detect

SERVES_OTHERS = ("block-server", "expert-server")  # useless unless others can dial them
REFUSED = 2  # a role's exit code for input it cannot work with (an ExpertPool with no free cell): no restart
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class JoinOptions:
    gateway: str
    token: str  # the invite, or a file holding it
    run_dir: Path
    host: str = "0.0.0.0"
    p2p_port: int = 0
    mode: str = "auto"
    dry_run: bool = False
    role_args: tuple[str, ...] = ()  # passed on to the role (--batch-size, --step-delay)


class Timeline:
    """Milestones in seconds since the command started, kept in RUN_DIR/join.json."""

    def __init__(self, path: Path, started: float):
        self.path, self.started = path, started
        self.record: dict[str, Any] = {"startedAt": started, "seconds": {}}

    def mark(self, milestone: str) -> float:
        seconds = round(time.time() - self.started, 2)
        self.record["seconds"].setdefault(milestone, seconds)
        self.save()
        return seconds

    def update(self, **fields: Any) -> None:
        self.record.update(fields)
        self.save()

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2))
        tmp.replace(self.path)


def process_started_at() -> float:
    """When this process started (Linux), so that the interpreter's start-up counts too."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def join(options: JoinOptions, console: Console | None = None) -> int:
    console = console or Console(stderr=True)
    run_dir = options.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    timeline = Timeline(run_dir / "join.json", process_started_at())
    invite = _read_invite(options.token)
    p2pd_dies_with_this_process()
    swarm = _grant(options.gateway, invite)
    timeline.mark("granted")
    kind, name = swarm.get("kind", "Swarm"), swarm.get("name", "swarm")
    role_name = runtime(kind).volunteer_role if kind in KIND_MODULES else None
    if role_name is None:
        raise UserError(f"the gateway offers a {kind}, which volunteers cannot join")
    manifest_path = _write_manifest(run_dir, swarm)
    port = options.p2p_port or free_port(_local(options.host))
    relays, initial_peers = list(swarm.get("relays") or []), list(swarm.get("initialPeers") or [])
    try:
        connectivity = asyncio.run(detect(initial_peers, relays, options.host, port, wanted=options.mode))
    except Unreachable as e:
        timeline.update(state="unreachable", reason=str(e))
        raise UserError(f"cannot reach the swarm {name!r}: {e}") from None
    timeline.mark("connectivity")
    if options.mode not in ("auto", connectivity.mode):
        timeline.update(state="refused", connectivity=connectivity.as_dict())
        raise UserError(f"cannot run in {options.mode} mode: {connectivity.reason}")
    if role_name in SERVES_OTHERS and connectivity.mode == CLIENT:
        raise UserError(f"a {role_name} must be reachable, directly or through a relay: {connectivity.reason}")
    timeline.update(kind=kind, name=name, role=role_name, mode=connectivity.mode, reason=connectivity.reason,
                    connectivity=connectivity.as_dict())
    console.print(f"[bold]{name}[/] ({kind}): would join as a {role_name} in [bold]{connectivity.mode}[/] mode: "
                  f"{connectivity.reason}", highlight=False)
    if options.dry_run:
        timeline.update(state="dry-run")
        return 0
    _write_private(run_dir / "invite", invite)
    peer_id = ensure_identity(run_dir / "keys" / "volunteer.key")
    role = volunteer_role(role_name, options, manifest_path, port, peer_id, initial_peers, connectivity,
                          plan_signer=swarm.get("planSigner"))
    timeline.update(peerId=peer_id, peerName=role.name, status=f"http://{_local(options.host)}:{role.ports[METRICS]}/status")
    return _run(options, role, peer_id, connectivity, timeline, console, name)


def volunteer_role(component: str, options: JoinOptions, manifest_path: Path, port: int, peer_id: str,
                   initial_peers: list[str], connectivity: Connectivity, plan_signer: Optional[str] = None) -> Role:
    """`hivekeeper run COMPONENT` as a volunteer: its own index (a name apart from the swarm's
    own replicas, a data order of its own), the mode's flags, the gateway's token and, when the
    swarm tells it, whose averaging plan to follow."""
    index = VOLUNTEER_INDEX + zlib.crc32(peer_id.encode()) % 9000
    ports = {METRICS: free_port(_local(options.host)), "p2p": port}
    args = [component, "--manifest", str(manifest_path), "--index", str(index), "--host", options.host,
            "--p2p-port", str(port), "--metrics-port", str(ports[METRICS]), "--run-dir", str(options.run_dir),
            "--identity", str(options.run_dir / "keys" / "volunteer.key"),
            "--gateway", options.gateway, "--invite", str(options.run_dir / "invite")]
    if connectivity.mode == RELAY:
        args += ["--relay", *connectivity.relays]
    elif connectivity.mode == CLIENT:
        args += ["--client-mode"]
    if plan_signer:
        args += ["--plan-signer", plan_signer]
    args += list(options.role_args)
    args += ["--initial-peers", *(connectivity.entry_points or initial_peers)]
    return Role(name=f"{component}-{index}", component=component, index=index, args=tuple(args), ports=ports,
                completes_run=True)


def _run(options: JoinOptions, role: Role, peer_id: str, connectivity: Connectivity, timeline: Timeline,
         console: Console, name: str) -> int:
    from hivekeeper.volunteer.watchdog import RelayWatchdog

    supervisor = Supervisor([role], options.run_dir / "logs", host=_local(options.host))
    watchdog = RelayWatchdog(connectivity.relays, peer_id).start() if connectivity.mode == RELAY else None
    interrupted = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: interrupted.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    state, status, watchdog_restarts = "interrupted", None, 0
    try:
        supervisor.start()
        timeline.mark("roleStarted")
        view_name = f"{name}: {role.name} ({connectivity.mode} mode)"
        with ProgressView(view_name, supervisor, None, console) as view:
            while not interrupted.is_set():
                if supervisor.poll():
                    state = "completed"
                    break
                if supervisor.children[0].exit_codes[-1:] == [REFUSED]:
                    state = "refused"
                    break
                status = fetch_status(role.ports[METRICS], host=_local(options.host)) or status
                _observe(status, timeline, watchdog)
                if "ready" not in timeline.record["seconds"] and _ready(_local(options.host), role.ports[METRICS]):
                    timeline.mark("ready")  # a server serves from here on
                if watchdog is not None and watchdog.restart_due():
                    watchdog_restarts += 1
                    timeline.update(watchdogRestarts=watchdog_restarts)
                    _kill(supervisor)  # the supervisor starts it again
                    watchdog.role_restarted()
                view.update(_as_progress(status))
                interrupted.wait(POLL_SECONDS)
    finally:
        if watchdog is not None:
            watchdog.stop()
        if state == "interrupted":  # the summary tells what the role did up to its stop, not a poll ago
            status = fetch_status(role.ports[METRICS], timeout=5.0, host=_local(options.host)) or status
        supervisor.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    child = supervisor.children[0]
    summary = {**timeline.record, "state": state, "restarts": supervisor.restarts,
               "watchdogRestarts": watchdog_restarts, "samples": (status or {}).get("samples"),
               "lastRound": (status or {}).get("lastRound"), "served": (status or {}).get("served"),
               "exitCodes": child.exit_codes,
               "log": str(child.log_path), "wallSeconds": round(time.time() - timeline.started, 2)}
    (options.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    seconds = timeline.record["seconds"]
    if role.component in SERVES_OTHERS:
        done = f"{summary['served'] or 0} requests served, serving after {seconds.get('ready', '-')} s"
    else:
        done = (f"{summary['samples'] or 0} samples contributed, first gradient after "
                f"{seconds.get('firstGradient', '-')} s")
    if state == "refused":
        done = f"the {role.component} refused to run; see {child.log_path}"
    console.print(f"{state}: {done} -> {options.run_dir / 'summary.json'}")
    return {"completed": 0, "interrupted": 130, "refused": REFUSED}.get(state, 1)


def _observe(status: Optional[dict[str, Any]], timeline: Timeline, watchdog) -> None:
    """Milestones: the role's first report (it joined the DHT and loaded the swarm's state), its
    first batch accumulated and published in its report (a trainer reports every second: the
    mark trails the batch by at most that and a poll), its first successful averaging round; a
    server's first request answered (`served` in its status, refreshed every few seconds). The
    role's readiness (`ready`: a server serves from then on) is marked by the caller."""
    if status is None:
        return
    timeline.mark("firstReport")
    if status.get("samples"):
        timeline.mark("firstGradient")
    if status.get("served"):  # a server's first request answered
        timeline.mark("firstServed")
    if status.get("lastRound", {}) and status["lastRound"].get("outcome") == "success":
        timeline.mark("firstRound")
    if watchdog is not None and watchdog.reachable_since is not None:
        since = round(watchdog.reachable_since - timeline.started, 2)
        if timeline.record.get("relayedReachableSince") != since:  # (re)gained: the relay dialed us back
            timeline.mark("relayedReachable")
            timeline.update(relayedReachableSince=since)


def _ready(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def _as_progress(status: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The role's own status in the shape ProgressView shows (the monitor's)."""
    if not status or "epoch" not in status:
        return None
    return {"globalStep": status.get("globalEpoch", status.get("epoch")), "loss": status.get("loss"),
            "samplesPerSecond": status.get("collaborationSamplesPerSecond", status.get("samplesPerSecond", 0.0)),
            "peersAlive": status.get("peersAlive", {}), "lastRound": status.get("lastRound"),
            "evalStep": None, "evalMetrics": None, "plan": None}


def _kill(supervisor: Supervisor) -> None:
    for child in supervisor.children:
        if child.process is not None and child.process.poll() is None:
            try:
                os.killpg(child.process.pid, signal.SIGKILL)  # a crash to the supervisor: restarted
            except ProcessLookupError:
                pass


def _read_invite(token: str) -> str:
    path = Path(token)
    try:
        if len(token) < 256 and path.is_file():
            return path.read_text().strip()
    except OSError:
        pass
    return token.strip()


def p2pd_dies_with_this_process() -> None:
    """`join` runs p2pd daemons of its own (the connectivity check's, the relay watchdog's):
    each starts with its parent-death signal set, so that `join` killed with SIGKILL leaves none
    running (its role, the fork server's child, stops by itself: lifeline)."""
    if sys.platform.startswith("linux"):
        from hivekeeper.hivemind_ext.p2pd import die_with_parent
        from hivekeeper.runtime.lifeline import exec_prefix

        die_with_parent(exec_prefix())


def _grant(gateway: str, invite: str) -> dict[str, Any]:
    from hivemind.utils.crypto import RSAPrivateKey

    from hivekeeper.auth.client import GatewayUnavailable, describe_swarm

    try:  # a probe, with a throwaway key: the role asks for its own token with the invite
        swarm = describe_swarm(gateway, invite, RSAPrivateKey())
    except GatewayUnavailable as e:
        raise UserError(f"the token service does not answer: {e}") from None
    if not swarm.get("manifest"):
        raise UserError(f"the token service at {gateway} sent no manifest")
    return swarm


def _write_manifest(run_dir: Path, swarm: dict[str, Any]) -> Path:
    from hivekeeper.spec.manifest import parse_manifest

    parse_manifest(swarm["manifest"], source="the gateway's manifest")  # fail here, not in the role
    path = run_dir / "manifest.json"
    path.write_text(json.dumps(swarm["manifest"], indent=2))
    return path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host

