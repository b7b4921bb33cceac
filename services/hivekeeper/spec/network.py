"""How a role group's peers are reached from outside their cluster (`network` on a group): the
labs of a pooled swarm dial each other's peers across clusters, where no pod IP routes.

Inside a cluster peers always talk over pod IPs. `expose` adds to that:
  Cluster       nothing: pod IPs only (the default)
  ClientOnly    nothing, and the peers accept no inbound connection at all: DeDLOC's client-mode
                peers, which send their part of each round but never aggregate (the averaging
                plan gives them no share)
  NodePort      peer i announces publicHost (default: its node's IP) at node port `port` + i;
                the operator makes a NodePort Service for each peer
  LoadBalancer  each peer announces its own LoadBalancer Service's address (or publicHost) at
                `port` (default 31337), once the Service has one
  HostPort      each peer announces its node's IP at `port` (default 31337) on that node: one
                peer of the group per node"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from hivekeeper.spec.base import CelRule, SpecModel

NODE_PORTS = (30000, 32767)  # Kubernetes' default NodePort range
DEFAULT_PUBLIC_PORT = 31337  # a LoadBalancer's or a host port's, when `port` is not set
Expose = Literal["Cluster", "ClientOnly", "NodePort", "LoadBalancer", "HostPort"]
PUBLIC = ("NodePort", "LoadBalancer", "HostPort")  # the ways that add an address peers outside dial


class PeerNetwork(SpecModel):
    """How peers outside the cluster reach this group's peers."""

    expose: Expose = Field("Cluster", description=(
        "Cluster: pod IPs only; ClientOnly: outbound only (client mode: the peers never aggregate); "
        "NodePort, LoadBalancer, HostPort: each peer also announces a public address, and the operator "
        "makes the Service or host port it needs"))
    port: Optional[int] = Field(None, ge=1, le=65535, description=(
        "NodePort: peer 0's node port (peer i: port + i); LoadBalancer and HostPort: every peer's port "
        f"(default {DEFAULT_PUBLIC_PORT})"))
    public_host: Optional[str] = Field(None, min_length=1, max_length=253, description=(
        "the address peers outside dial (NodePort: default the peer's node's IP; LoadBalancer: default "
        "the Service's)"))

    cel_rules = (
        CelRule("self.expose != 'NodePort' || has(self.port)",
                "expose NodePort: set port, peer 0's node port (peer i: port + i)", ".port"),
        CelRule(f"!has(self.port) || self.expose in {list(PUBLIC)}",
                "only NodePort, LoadBalancer and HostPort peers have a public port", ".port"),
        CelRule("!has(self.publicHost) || self.expose in ['NodePort', 'LoadBalancer']",
                "only NodePort and LoadBalancer peers announce a host other than their node's", ".publicHost"),
    )

    @model_validator(mode="after")
    def _consistent(self) -> "PeerNetwork":
        if self.expose == "NodePort" and self.port is None:
            raise ValueError("port: expose NodePort: set port, peer 0's node port (peer i: port + i)")
        if self.port is not None and self.expose not in PUBLIC:
            raise ValueError("port: only NodePort, LoadBalancer and HostPort peers have a public port")
        if self.public_host is not None and self.expose not in ("NodePort", "LoadBalancer"):
            raise ValueError("publicHost: only NodePort and LoadBalancer peers announce a host other than their node's")
        return self

    @property
    def public(self) -> bool:
        return self.expose in PUBLIC

    def public_port(self, index: int) -> int:
        """The port peer `index` of the group announces."""
        if self.expose == "NodePort":
            assert self.port is not None
            return self.port + index
        return self.port or DEFAULT_PUBLIC_PORT

    def node_ports(self, replicas: int) -> range:
        """The node ports the group's peers take (none unless NodePort)."""
        if self.expose != "NodePort" or self.port is None:
            return range(0)
        return range(self.port, self.port + replicas)


def node_port_rule(group: str) -> CelRule:
    """A kind's check that a NodePort group's ports (port + i, for each of its replicas) are node ports."""
    network = f"self.{group}.network"
    return CelRule(f"{network}.expose != 'NodePort' || !has({network}.port) || ({network}.port >= {NODE_PORTS[0]} "
                   f"&& {network}.port + self.{group}.replicas - 1 <= {NODE_PORTS[1]})",
                   f"every peer's node port (port + i) must be within {NODE_PORTS[0]}-{NODE_PORTS[1]}",
                   f".{group}.network.port")


def not_client_only_rule(group: str, why: str) -> CelRule:
    """A kind's check that a group whose peers others must dial is not ClientOnly."""
    return CelRule(f"self.{group}.network.expose != 'ClientOnly'", f"cannot be ClientOnly: {why}",
                   f".{group}.network.expose")


def check_networks(groups: dict[str, tuple[PeerNetwork, int]], dialed: dict[str, str],
                   taken: dict[str, range] | None = None) -> None:
    """The model's twin of the rules above for a kind's groups (name -> (network, replicas)):
    node ports in range, no ClientOnly where others must dial (`dialed`: group -> why), and no
    node port taken twice, by two groups or by a group and `taken` (the volunteers' door)."""
    low, high = NODE_PORTS
    used: dict[int, str] = {port: owner for owner, ports in (taken or {}).items() for port in ports}
    for group, (network, replicas) in groups.items():
        if group in dialed and network.expose == "ClientOnly":
            raise ValueError(f"{group}.network.expose: cannot be ClientOnly: {dialed[group]}")
        ports = network.node_ports(replicas)
        if ports and (ports.start < low or ports.stop - 1 > high):
            raise ValueError(f"{group}.network.port: every peer's node port (port + i) must be within {low}-{high}")
        for port in ports:
            if port in used:
                raise ValueError(f"{group}.network.port: node port {port} is {used[port]}'s too")
            used[port] = group
