"""A role's command line (`hivekeeper run ROLE ...`), in sets: what every role takes, how a DHT
peer gets in (relays, tokens), and what only the relay and the token service need. A kind's
roles add their own (`RoleEntry.arguments`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Optional

ArgumentSet = Callable[[argparse.ArgumentParser], None]


def common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--manifest", required=True, help="the resource's manifest (YAML or JSON)")
    parser.add_argument("--index", type=int, default=0, help="this replica's index within its role")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--announce-host", default=None, help="address other peers dial (default: --host)")
    parser.add_argument("--p2p-port", type=int, default=0, help="libp2p port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=0, help="HTTP port for /metrics, /healthz, /readyz")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of backbone peers")
    parser.add_argument("--identity", default=None, help="libp2p private key file (stable peer ID)")
    parser.add_argument("--run-dir", default=".", help="where logs, traces and checkpoints go")


def peer_access(parser: argparse.ArgumentParser) -> None:
    """How a DHT peer is reached from outside its cluster (a public address, relays, or not at
    all) and gets in where volunteers are admitted (with tokens)."""
    parser.add_argument("--client-mode", action="store_true",
                        help="accept no inbound connections (a peer nobody can dial, not even through a relay)")
    parser.add_argument("--public-address", default=None, metavar="HOST:PORT",
                        help="where peers outside the cluster dial this peer (announced along with --announce-host)")
    parser.add_argument("--relay", nargs="*", default=[], metavar="MADDR",
                        help="circuit relays to be reachable through (a peer behind NAT)")
    parser.add_argument("--gateway", default=None, metavar="HOST:PORT",
                        help="the token service: sign every DHT request with a token from it")
    parser.add_argument("--invite", default=None, metavar="PATH", help="file with this peer's invite (with --gateway)")


def token_service(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--swarm-key", default=None, metavar="PATH", help="the resource's token-signing key")
    parser.add_argument("--allowlist-file", default=None, metavar="PATH",
                        help="more allowed identities, one a line (re-read when it changes)")
    parser.add_argument("--grpc-port", type=int, default=0, help="the token service's gRPC port")
    parser.add_argument("--swarm-info", default=None, metavar="PATH",
                        help="JSON the token service hands to joining peers (manifest, peers, relays)")


@dataclass(frozen=True)
class RoleEntry:
    """One `hivekeeper run` role: the module whose `run(args)` it calls (imported only when it
    runs: roles pull in torch and hivemind) and the argument sets it takes beyond `common`."""

    module: str
    arguments: tuple[ArgumentSet, ...] = (peer_access,)
    help: Optional[str] = None
    # the word a lab's allowlist entry grants this role by (spec.volunteers.labs; the kind spec's
    # LAB_ROLES): its token asks for that role. None: no lab may run it
    lab_role: Optional[str] = None
