"""What every Swarm role shares: its arguments, its DHT, its HTTP endpoint, clean shutdown,
and the records roles publish about themselves in the DHT."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hivekeeper.metrics import SwarmMetrics
from hivekeeper.service import ServiceEndpoint
from hivekeeper.spec import Manifest, load_manifest
from hivekeeper.spec.swarm import SwarmSpec
from hivekeeper.topology import host_protocol

PEERS_KEY = "_peers"  # subkey per peer: the role's latest report (roles, losses, throughput)
STOP_KEY = "_stop"  # set by the monitor when the stopping condition is met
REPORT_EXPIRATION = 15.0  # seconds a peer's report stays in the DHT without a refresh, beyond a round


def add_role_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, help="the Swarm manifest (YAML or JSON)")
    parser.add_argument("--index", type=int, default=0, help="this replica's index within its role")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--announce-host", default=None, help="address other peers dial (default: --host)")
    parser.add_argument("--p2p-port", type=int, default=0, help="libp2p port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=0, help="HTTP port for /metrics, /healthz, /readyz")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of backbone peers")
    parser.add_argument("--identity", default=None, help="libp2p private key file (stable peer ID)")
    parser.add_argument("--run-dir", default=".", help="where logs, traces and checkpoints go")
    parser.add_argument("--plan-signer", default=None,
                        help="peer ID of the balancer whose signed averaging plan this peer follows")
    # Volunteers (issue 7): how a peer outside the cluster gets in, and who may.
    parser.add_argument("--client-mode", action="store_true",
                        help="accept no inbound connections (a peer nobody can dial, not even through a relay)")
    parser.add_argument("--relay", nargs="*", default=[], metavar="MADDR",
                        help="circuit relays to be reachable through (a peer behind NAT)")
    parser.add_argument("--gateway", default=None, metavar="HOST:PORT",
                        help="the swarm's token service: sign every DHT request with a token from it")
    parser.add_argument("--invite", default=None, metavar="PATH", help="file with this peer's invite (with --gateway)")
    parser.add_argument("--public-address", default=None, metavar="HOST:PORT",
                        help="relay: where volunteers outside dial it (announced along with --announce-host)")
    # The auth role's own inputs.
    parser.add_argument("--swarm-key", default=None, metavar="PATH", help="auth: the swarm's token-signing key")
    parser.add_argument("--allowlist-file", default=None, metavar="PATH",
                        help="auth: more allowed identities, one a line (re-read when it changes)")
    parser.add_argument("--grpc-port", type=int, default=0, help="auth: the token service's gRPC port")
    parser.add_argument("--swarm-info", default=None, metavar="PATH",
                        help="auth: JSON the token service hands to joining peers (manifest, peers, relays)")


@dataclass
class RoleContext:
    role: str
    args: argparse.Namespace
    manifest: Manifest
    metrics: SwarmMetrics = field(default_factory=SwarmMetrics)
    stop: threading.Event = field(default_factory=threading.Event)
    endpoint: ServiceEndpoint | None = None
    status: dict[str, Any] = field(default_factory=dict)
    client_mode: bool = False  # set by make_dht: whether this peer accepts connections

    @property
    def spec(self) -> SwarmSpec:
        return self.manifest.spec

    @property
    def run_id(self) -> str:
        return self.manifest.metadata.name

    @property
    def peer_name(self) -> str:
        return f"{self.role}-{self.args.index}"

    def start_endpoint(self) -> ServiceEndpoint:
        # identity before the DHT is up (a peer stuck bootstrapping still belongs to its swarm);
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
            # backbone is up but does not answer yet (the local runner starts it first, but a
            # loaded machine may still be slow)
            except (P2PDaemonError, RuntimeError) as e:
                if attempt == attempts or "bootstrap" not in str(e):
                    raise
                logging.getLogger("hivekeeper").warning(
                    "bootstrap peers unreachable, retrying", extra={"fields": {"attempt": attempt}}
                )
                time.sleep(min(2.0 * attempt, 10.0))
        raise AssertionError("unreachable")

    def authorizer(self):
        """Signs and checks every DHT request when the swarm admits peers by token."""
        if not self.args.gateway:
            return None
        if not self.args.invite:
            raise SystemExit(f"{self.peer_name}: --gateway needs --invite (this peer's invite file)")
        from hivekeeper.auth.authorizer import make_authorizer

        return make_authorizer(self.args.gateway, self.args.invite)

    def _make_dht(self, client_mode: bool, **p2p_options: Any):
        import hivemind

        host_maddrs = [f"/ip4/{self.args.host}/tcp/{self.args.p2p_port}"]
        announce = self.args.announce_host
        announce_maddrs = [f"{host_protocol(announce)}/tcp/{self.args.p2p_port}"] if announce and self.args.p2p_port else None
        if self.args.public_address:  # a relay: dialed from outside at the Service's address too
            host, port = self.args.public_address.rsplit(":", 1)
            announce_maddrs = (announce_maddrs or [f"{host_protocol(self.args.host)}/tcp/{self.args.p2p_port}"]) + [
                f"{host_protocol(host)}/tcp/{port}"]
        client_mode = client_mode or self.args.client_mode
        self.client_mode = client_mode
        relays = list(self.args.relay)
        if relays:
            from hivekeeper.volunteer.p2pd_flags import use_static_relays

            use_static_relays()  # reserve at these relays, at once
        dht = hivemind.DHT(
            initial_peers=list(self.args.initial_peers),
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs,
            identity_path=self.args.identity,
            client_mode=client_mode,
            use_auto_relay=bool(relays),
            trusted_relays=relays or None,
            authorizer=self.authorizer(),
            start=True,
            # Ctrl-C reaches every process in the terminal's group; we shut the DHT down ourselves.
            daemon=True,
            # autorelay reserves a slot only once AutoNAT finds us private, which it never does
            # where every address is private (AutoNAT dials back public ones only): say so
            **{"force_reachability": "private" if relays else None, **p2p_options},
        )
        self.metrics.peer_info.info(
            {"swarm": self.run_id, "role": self.role, "peer": self.peer_name, "peer_id": str(dht.peer_id),
             "client_mode": str(bool(client_mode)).lower()}
        )
        return dht

    @property
    def report_ttl(self) -> float:
        """How long a report outlives its peer's silence: a healthy peer reports between steps,
        and a step can block for a whole averaging round (matchmaking, then up to its timeout)."""
        averaging = getattr(self.spec, "averaging", None)
        round_seconds = averaging.matchmaking_seconds + averaging.timeout_seconds if averaging is not None else 0.0
        return REPORT_EXPIRATION + round_seconds

    def publish_report(self, dht, report: dict[str, Any]) -> None:
        """Tell the collaboration (and the monitor) what this peer is doing."""
        from hivemind.utils import get_dht_time

        record = {"role": self.role, "name": self.peer_name, "time": time.time(), "peerId": str(dht.peer_id),
                  "metrics": self.metrics_address, "clientMode": self.client_mode, **report}
        dht.store(
            self.run_id + PEERS_KEY,
            subkey=str(dht.peer_id),
            value=record,
            expiration_time=get_dht_time() + self.report_ttl,
            return_future=True,
        )

    def stop_requested(self, dht) -> dict[str, Any] | None:
        found = dht.get(self.run_id + STOP_KEY, latest=True)
        return found.value if found is not None else None


def read_peer_reports(dht, run_id: str) -> list[dict[str, Any]]:
    """Reports of the peers that are alive (their records have not expired)."""
    found = dht.get(run_id + PEERS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    reports = []
    for entry in found.value.values():
        value = getattr(entry, "value", None)
        if isinstance(value, dict) and "role" in value:
            reports.append(value)
    return reports


def setup_logging(role: str, index: int) -> logging.Logger:
    """Structured logs: one JSON object a line on stderr."""

    class JsonFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            entry = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "role": role,
                "index": index,
                "msg": record.getMessage(),
            }
            extra = getattr(record, "fields", None)
            if extra:
                entry.update(extra)
            if record.exc_info:
                entry["exc"] = self.formatException(record.exc_info)
            return json.dumps(entry, default=str)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("hivekeeper")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # hivemind logs every matchmaking retry at INFO; keep its warnings and errors
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    return logger


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT end the main loop; the role then shuts its DHT (and p2pd) down."""

    def _handler(signum: int, _frame: Any) -> None:
        if stop.is_set():  # a second signal: the user insists
            os._exit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def load_role_context(role: str, args: argparse.Namespace) -> RoleContext:
    manifest = load_manifest(args.manifest)
    if not isinstance(manifest.spec, SwarmSpec):
        raise SystemExit(f"{args.manifest}: role {role} needs a Swarm manifest")
    ctx = RoleContext(role=role, args=args, manifest=manifest)
    install_signal_handlers(ctx.stop)
    return ctx
