"""The local `Network`: every role on loopback, ports chosen free up front so the runner knows
where each process serves metrics and where the backbone listens before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalNetwork:
    listen_host = "127.0.0.1"

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._ports: dict[tuple[str, str], int] = {}

    def port(self, role_name: str, port_name: str) -> int:
        if port_name == "p2p" and not role_name.startswith("backbone"):
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
