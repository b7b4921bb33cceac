"""A role's context, the same for every kind: its spec (typed by the kind), arguments, metrics,
HTTP endpoint, its DHT peer, and the reports it publishes about itself."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from hivekeeper.runtime import reports
from hivekeeper.service import ServiceEndpoint
from hivekeeper.spec import Manifest
from hivekeeper.topology import host_protocol

log = logging.getLogger("hivekeeper")
# A DHT process normally answers in seconds, even on a loaded 2-core host; one that has not
# after this long is stuck (a bootstrap that never returns) and is replaced, as a failed one is.
# Seen twice in CI, each time in a restarted role, its DHT process never ready: 60 s keeps the
# restart and one retry within the two minutes tests give a restarted role.
DHT_START_SECONDS = 60.0
SpecT = TypeVar("SpecT")


@dataclass
class RoleContext(Generic[SpecT]):
    role: str
    args: argparse.Namespace
    manifest: Manifest
    metrics: Any  # the kind's metrics: `registry` to serve, `peer_info`, and the role's own
    stop: threading.Event = field(default_factory=threading.Event)
    endpoint: ServiceEndpoint | None = None
    status: dict[str, Any] = field(default_factory=dict)
    client_mode: bool = False  # set by make_dht: whether this peer accepts connections
    maddrs: list[str] = field(default_factory=list)  # set by make_dht: where others dial this peer
    # set by make_dht: the lab (or volunteer) whose invite admitted this peer; None for the
    # swarm's own peers. Its reports and peer_info say so, for the breakdowns by lab
    lab: str | None = None
    # how long a report outlives its peer's silence: a kind whose steps block (a Swarm's averaging
    # round) adds that time
    report_ttl: float = reports.REPORT_EXPIRATION

    @property
    def spec(self) -> SpecT:
        return self.manifest.spec  # type: ignore[return-value]  # checked by load_context

    @property
    def run_id(self) -> str:
        return self.manifest.metadata.name

    @property
    def peer_name(self) -> str:
        return f"{self.role}-{self.args.index}"

    def option(self, name: str, default: Any = None) -> Any:
        """An argument of a set this role may not take (`arguments.peer_access`, `.relay`)."""
        return getattr(self.args, name, default)

    def start_endpoint(self) -> ServiceEndpoint:
        # identity before the DHT is up (a peer stuck bootstrapping still belongs to its resource);
        # make_dht adds the peer ID and mode
        self.metrics.peer_info.info({"swarm": self.run_id, "role": self.role, "peer": self.peer_name})
        self.endpoint = ServiceEndpoint(
            self.metrics.registry, self.args.host, self.args.metrics_port, status=lambda: dict(self.status)
        ).start()
        return self.endpoint

    @property
    def metrics_address(self) -> str | None:
        """host:port where others scrape this role's /metrics."""
        if self.endpoint is None:
            return None
        return f"{self.args.announce_host or self.args.host}:{self.endpoint.port}"

    def make_dht(self, client_mode: bool = False, attempts: int = 5, **p2p_options: Any):
        """Join the DHT, retrying while the bootstrap peers are unreachable (a backbone that is
        still starting, a loaded machine): the role fails only if they stay unreachable."""
        from hivemind.p2p import P2PDaemonError

        for attempt in range(1, attempts + 1):
            try:
                return self._make_dht(client_mode, **p2p_options)
            # p2pd's own bootstrap error, or hivemind's "DHTNode bootstrap failed" when the
            # backbone is up but does not answer yet
            except (P2PDaemonError, RuntimeError) as e:
                if attempt == attempts or "bootstrap" not in str(e):
                    raise
                log.warning("bootstrap peers unreachable, retrying",
                            extra={"fields": {"attempt": attempt, "error": str(e)}})
                time.sleep(min(2.0 * attempt, 10.0))
        raise AssertionError("unreachable")

    def authorizer(self):
        """Signs and checks every DHT request when the resource admits peers by token (and, once
        installed, admits every other RPC: hivemind_ext.admission)."""
        if not self.option("gateway"):
            return None
        if not self.option("invite"):
            raise SystemExit(f"{self.peer_name}: --gateway needs --invite (this peer's invite file)")
        from hivekeeper.auth.authorizer import make_authorizer

        # a lab's peer names its role and itself: the token service checks both against the lab's entry
        return make_authorizer(self.args.gateway, self.args.invite, role=self.option("lab_role"), peer=self.peer_name)

    def _make_dht(self, client_mode: bool, **p2p_options: Any):
        import hivemind

        args = self.args
        host_maddrs = [f"/ip4/{args.host}/tcp/{args.p2p_port}"]
        announce = args.announce_host
        announce_maddrs = [f"{host_protocol(announce)}/tcp/{args.p2p_port}"] if announce and args.p2p_port else None
        public = self.option("public_address")
        if public:  # dialed from outside the cluster at its public address too (a relay's, an exposed peer's)
            host, port = public.rsplit(":", 1)
            announce_maddrs = (announce_maddrs or [f"{host_protocol(args.host)}/tcp/{args.p2p_port}"]) + [
                f"{host_protocol(host)}/tcp/{port}"]
        client_mode = client_mode or bool(self.option("client_mode"))
        self.client_mode = client_mode
        relays = list(self.option("relay") or ())
        authorizer = self.authorizer()
        self.lab = authorizer.admitted_as if authorizer is not None else None
        if authorizer is not None:  # before the DHT forks its process: it serves RPCs too
            from hivekeeper.hivemind_ext.admission import install

            install(authorizer, self.metrics.registry)
        if relays:
            from hivekeeper.hivemind_ext.p2pd import use_static_relays

            use_static_relays()  # reserve at these relays, at once
        dht = hivemind.DHT(
            initial_peers=list(args.initial_peers),
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            identity_path=args.identity,
            client_mode=client_mode,
            use_auto_relay=bool(relays),
            trusted_relays=relays or None,
            authorizer=authorizer,
            start=False,
            # Ctrl-C reaches every process in the terminal's group; we shut the DHT down ourselves.
            daemon=True,
            # autorelay reserves a slot only once AutoNAT finds us private, which it never does
            # where every address is private (AutoNAT dials back public ones only): say so
            **{"force_reachability": "private" if relays else None, **p2p_options},
        )
        _start_dht(dht, DHT_START_SECONDS)
        if args.initial_peers:  # a bootstrap peer that restarts learns of this one again
            from hivekeeper.hivemind_ext.dht_rejoin import keep_bootstrap_peers
            from hivekeeper.runtime.bandwidth import peer_ids_of

            dht.run_coroutine(keep_bootstrap_peers(peer_ids_of(args.initial_peers)))
        if relays and not client_mode:  # others reach us through a circuit: dial them back directly
            from hivekeeper.hivemind_ext.p2pd import keep_direct_connections

            dht.run_coroutine(keep_direct_connections)
        self.maddrs = [] if client_mode else [str(a) for a in dht.get_visible_maddrs()]
        self.metrics.peer_info.info(
            {"swarm": self.run_id, "role": self.role, "peer": self.peer_name, "peer_id": str(dht.peer_id),
             "client_mode": str(bool(client_mode)).lower(), "lab": self.lab or ""}
        )
        return dht

    def publish_report(self, dht, report: dict[str, Any]) -> None:
        """Tell the other peers (and whoever sums the resource up) what this peer is doing."""
        from hivemind.utils import get_dht_time

        record = {"role": self.role, "name": self.peer_name, "time": time.time(), "peerId": str(dht.peer_id),
                  "metrics": self.metrics_address, "clientMode": self.client_mode, "maddrs": self.maddrs,
                  **({"lab": self.lab} if self.lab else {}), **report}
        dht.store(self.run_id + reports.PEERS_KEY, subkey=str(dht.peer_id), value=record,
                  expiration_time=get_dht_time() + self.report_ttl, return_future=True)

    def stop_requested(self, dht) -> dict[str, Any] | None:
        return reports.read_stop(dht, self.run_id)


def _start_dht(dht: Any, timeout: float) -> None:
    """Start the DHT's process and wait until it is ready, at most `timeout` seconds. A process
    that is not is killed (its p2pd goes with it: lifeline) and the start fails as a failed
    bootstrap does, which make_dht retries; its state is logged first, for whoever reads why."""
    try:
        dht.run_in_background(await_ready=True, timeout=timeout)
    except TimeoutError:
        state = _process_state(dht.pid)
        _dump_stacks(dht.pid)
        dht.kill()
        dht.join(5)
        raise RuntimeError(f"the DHT process did not finish its bootstrap in {timeout:.0f}s ({state}); "
                           "it was killed") from None


def _dump_stacks(pid: int | None) -> None:
    """Asks a forked process of a role for its threads' stacks (commands.run registers the
    handler, which the fork inherits: they go to the role's log) and gives it a moment."""
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)
    except (OSError, TypeError):
        pass


def _process_state(pid: int | None) -> str:
    """A process's state and where it waits in the kernel, as /proc tells them."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
        wchan = open(f"/proc/{pid}/wchan").read() or "-"
        return f"pid {pid}, state {stat[stat.rindex(')') + 2]}, waiting in {wchan}"
    except (OSError, ValueError):
        return f"pid {pid}"
