"""The local `Network`: every role on one address (loopback unless `up --host`), ports chosen
free up front so the runner knows where each process serves metrics and where the backbone
listens before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

from hivekeeper.spec.network import PeerNetwork
from hivekeeper.spec.volunteers import VolunteersSpec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalNetwork:
    entry_points: tuple[str, ...] = ()  # a local run hosts its swarm (a lab joins one with `hivekeeper join`)
    index_base = 0

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", volunteers: Optional[VolunteersSpec] = None):
        self.run_dir = run_dir
        self.listen_host = host
        self.volunteers = volunteers or VolunteersSpec()
        self._ports: dict[tuple[str, str], int] = {}

    def port(self, role_name: str, port_name: str) -> int:
        # What volunteers dial is on the spec's ports, as in a cluster (a router may forward them).
        if role_name.startswith("relay-") and port_name == "p2p":
            return self.volunteers.relay_port + int(role_name.split("-")[1])
        if role_name == "auth-0" and port_name == "grpc":
            return self.volunteers.gateway_port
        if port_name == "p2p" and not role_name.startswith(("backbone", "relay")):
            return 0  # nobody dials these directly; the DHT carries their addresses
        key = (role_name, port_name)
        if key not in self._ports:
            taken = set(self._ports.values())
            port = free_port(self.listen_host)
            while port in taken:
                port = free_port(self.listen_host)
            self._ports[key] = port
        return self._ports[key]

    def backbone_maddr(self, index: int, port: int, peer_id: str, component: str = "backbone") -> str:
        return f"/ip4/{self.listen_host}/tcp/{port}/p2p/{peer_id}"

    def identity_path(self, role_name: str) -> str:
        return str(self.run_dir / "keys" / f"{role_name}.key")

    def announce_host(self, role_name: str) -> str | None:
        return None

    def public_address(self, role_name: str, index: int, exposure: PeerNetwork) -> str | None:
        return None  # one machine: every peer dials the others where they listen

    def gateway_address(self) -> str:
        return f"{self.listen_host}:{self.port('auth-0', 'grpc')}"

    def relay_public_address(self, index: int) -> str:
        return f"{self.volunteers.public_host or self.listen_host}:{self.port(f'relay-{index}', 'p2p')}"

    def access_path(self, name: str) -> str:
        return str(self.run_dir / "keys" / name)
