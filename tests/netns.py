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

import hashlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
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


class WanLab(NatLab):
    """Two labs joined by a WAN: namespaces "a" and "b", each a lab's network, and a "wan"
    router between them. Both labs have public addresses and route to each other through the
    WAN; nothing blocks either way.

        a 11.R.1.1/24 --- 11.R.1.2 [wan: delay line, rate cap each way] 11.R.2.2 --- 11.R.2.1/24 b

    `shape` makes it a WAN: every forwarded packet is held for half the round trip (this kernel
    has no netem: bench/wandelay holds the packets netfilter queues to it), then leaves through
    a tbf rate cap on the link toward its lab, whose queue is the bottleneck's buffer."""

    def __init__(self, name: str | None = None):
        super().__init__(name)
        self.a, self.wan, self.b = (f"{self.name}-{part}" for part in ("a", "wan", "b"))
        self.a_ip, self.wan_a_ip = f"11.{self.net}.1.1", f"11.{self.net}.1.2"
        self.b_ip, self.wan_b_ip = f"11.{self.net}.2.1", f"11.{self.net}.2.2"
        self.wan_links = (f"{self.name}w", f"{self.name}x")  # the WAN's ends toward a and toward b
        self._delay_line: subprocess.Popen | None = None
        self._delay_ms: float | None = None

    @property
    def namespaces(self) -> tuple[str, str, str]:
        return self.a, self.wan, self.b

    def _build(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self._created.append(ns)
            self.run(ns, ["ip", "link", "set", "lo", "up"])
        n, (to_a, to_b) = self.name, self.wan_links
        self._veth(f"{n}a", self.a, f"{self.a_ip}/24", to_a, self.wan, f"{self.wan_a_ip}/24")
        self._veth(f"{n}b", self.b, f"{self.b_ip}/24", to_b, self.wan, f"{self.wan_b_ip}/24")
        self.run(self.a, ["ip", "route", "add", "default", "via", self.wan_a_ip])
        self.run(self.b, ["ip", "route", "add", "default", "via", self.wan_b_ip])
        self.run(self.wan, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])

    def shape(self, mbit: float, rtt_ms: float) -> None:
        """Caps each direction of the WAN at `mbit` and delays it by half of `rtt_ms`. The cap's
        queue holds two round trips at the cap (at least 128 KiB), its burst 5 ms (at least a
        64 KiB GSO packet)."""
        if rtt_ms != self._delay_ms:
            self._start_delay_line(rtt_ms / 2)
        rate = mbit * 1e6 / 8
        limit, burst = max(128 << 10, int(rate * rtt_ms / 1e3 * 2)), max(64 << 10, int(rate * 0.005))
        for link in self.wan_links:
            self.run(self.wan, ["tc", "qdisc", "replace", "dev", link, "root", "tbf", "rate", f"{mbit:g}mbit",
                                "burst", str(burst), "limit", str(limit)])

    def _start_delay_line(self, delay_ms: float) -> None:
        self._stop_delay_line()
        self._delay_line = self.popen(self.wan, [str(build_wandelay()), "-queue", "0", "-delay", f"{delay_ms:g}ms"],
                                      stdout=subprocess.PIPE, text=True)
        assert self._delay_line.stdout is not None
        if self._delay_line.stdout.readline().strip() != "ready":
            raise RuntimeError(f"wandelay did not start (exit {self._delay_line.wait(10)})")
        self.run(self.wan, ["iptables", "-w", "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", "0"])
        self._delay_ms = delay_ms * 2

    def _stop_delay_line(self) -> None:
        if self._delay_line is not None:
            self.run(self.wan, ["iptables", "-w", "-F", "FORWARD"])
            self._delay_line.terminate()
            self._delay_line.wait(10)
            self._delay_line, self._delay_ms = None, None

    def wan_bytes(self) -> int:
        """Bytes the WAN has carried so far, both ways (what left it toward either lab)."""
        total = 0
        for link in self.wan_links:
            stats = json.loads(self.run(self.wan, ["ip", "-j", "-s", "link", "show", "dev", link]).stdout)
            total += stats[0]["stats64"]["tx"]["bytes"]
        return total

    def close(self) -> None:
        if self._delay_line is not None and self._delay_line.poll() is None:
            self._delay_line.kill()
            self._delay_line.wait(10)
        super().close()


WANDELAY_SOURCE = Path(__file__).resolve().parents[1] / "bench" / "wandelay"


def build_wandelay() -> Path:
    """bench/wandelay built with this machine's Go, cached by its source's digest."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(WANDELAY_SOURCE.glob("*.go")))).hexdigest()[:16]
    binary = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hivekeeper" / f"wandelay-{digest}"
    if not binary.exists():
        binary.parent.mkdir(parents=True, exist_ok=True)
        built = binary.with_suffix(".tmp")
        subprocess.run(["go", "build", "-o", str(built), "."], cwd=WANDELAY_SOURCE, check=True,
                       env={**os.environ, "CGO_ENABLED": "0"})
        built.rename(binary)
    return binary


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)
