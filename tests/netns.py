"""A NAT lab in Linux network namespaces: a "cluster" namespace, a "home" namespace and a "nat"
router between them that masquerades home's traffic and drops every new connection from the
cluster side (no inbound path, like a home router without port forwarding).

    cluster 11.R.1.1/24 --- 11.R.1.2 [nat: MASQUERADE, FORWARD drops inbound] 10.R.2.1 --- 10.R.2.2/24 home

The cluster side has a public address, as a relay's real one would be: libp2p's autorelay
builds no /p2p-circuit address from a relay with only private or reserved addresses (10/8,
127/8, 198.18/15, ... so this lab uses 11.0.0.0/8). It is never routed anywhere: the lab's
namespaces have no link outside the lab. Home has a private address.

Everything (namespaces, veths, routes, rules) lives inside the lab's own namespaces, named
`hkt<random>-...`; leaving the context kills every process still running in them and deletes
them, after a failure too."""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from typing import Any, Sequence

import pytest

PREFIX = "hkt"


def skip_unless_possible() -> None:
    """pytest.skip with the reason when this machine cannot build the lab."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found (iptables: apt-get install iptables)")
    probe = f"{PREFIX}{secrets.token_hex(3)}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"ip netns unavailable: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)


class NatLab:
    def __init__(self, name: str | None = None):
        self.name = name or f"{PREFIX}{secrets.token_hex(3)}"
        self.net = random.randint(16, 250)  # only inside the lab's namespaces anyway
        self.cluster, self.nat, self.home = (f"{self.name}-{part}" for part in ("cluster", "nat", "home"))
        self.cluster_ip = f"11.{self.net}.1.1"
        self.nat_cluster_ip = f"11.{self.net}.1.2"  # home's public address, as the cluster sees it
        self.nat_home_ip = f"10.{self.net}.2.1"
        self.home_ip = f"10.{self.net}.2.2"
        self._created: list[str] = []

    @property
    def namespaces(self) -> tuple[str, str, str]:
        return self.cluster, self.nat, self.home

    def __enter__(self) -> "NatLab":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self._created.append(ns)
            self.run(ns, ["ip", "link", "set", "lo", "up"])
        n = self.name  # interface names: at most 15 characters
        self._veth(f"{n}c", self.cluster, f"{self.cluster_ip}/24", f"{n}n", self.nat, f"{self.nat_cluster_ip}/24")
        self._veth(f"{n}h", self.home, f"{self.home_ip}/24", f"{n}m", self.nat, f"{self.nat_home_ip}/24")
        self.run(self.home, ["ip", "route", "add", "default", "via", self.nat_home_ip])
        # the cluster can route to home's subnet, so only the firewall stops it (not a missing route)
        self.run(self.cluster, ["ip", "route", "add", f"10.{self.net}.2.0/24", "via", self.nat_cluster_ip])
        self.run(self.nat, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
        ipt = ["iptables", "-w"]
        self.run(self.nat, [*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", f"{n}n", "-j", "MASQUERADE"])
        self.run(self.nat, [*ipt, "-P", "FORWARD", "DROP"])
        self.run(self.nat, [*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                            "-j", "ACCEPT"])
        self.run(self.nat, [*ipt, "-A", "FORWARD", "-i", f"{n}m", "-o", f"{n}n", "-j", "ACCEPT"])
        # and the router itself answers nothing from the cluster side but replies
        self.run(self.nat, [*ipt, "-A", "INPUT", "-i", f"{n}n", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"])

    def _veth(self, a: str, ns_a: str, addr_a: str, b: str, ns_b: str, addr_b: str) -> None:
        _ip("link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, a, addr_a), (ns_b, b, addr_b)):
            self.run(ns, ["ip", "addr", "add", addr, "dev", dev])
            self.run(ns, ["ip", "link", "set", dev, "up"])

    def command(self, ns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def run(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("check", True)
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(ns, argv), **kwargs)

    def popen(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """A process inside `ns`, in a session of its own (its p2pd children go with its group)."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.command(ns, argv), **kwargs)

    def pids(self, ns: str) -> list[int]:
        found = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(p) for p in found.stdout.split()]

    def kill_all(self, ns: str, grace: float = 3.0) -> None:
        """SIGTERM every process in `ns` (all of them are the lab's), SIGKILL what is left."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
            pids = self.pids(ns)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids(ns) and time.monotonic() < deadline:
                time.sleep(0.1)

    def close(self) -> None:
        for ns in reversed(self._created):
            self.kill_all(ns)
            _ip("netns", "del", ns, check=False)  # its veth ends go with it
        self._created.clear()


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)
