"""Peers from outside the cluster (DeDLOC section 3.3 and appendix I.5): relays they reach the
swarm through, and the token service that admits only allowlisted identities: single volunteers
by name, and labs that pool a cluster's peers, each with a peer quota and the roles it may run."""

from __future__ import annotations

from typing import Literal, Optional, Sequence

from pydantic import Field, StrictBool, model_validator

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.network import NODE_PORTS
from hivekeeper.spec.placement import Placement



# What a lab's peers may run, by the kind's word for it: a Swarm's backbone, trainers and
# auxiliaries; a BlockServer's backbone and servers; an ExpertPool's backbone, expert servers and
# trainers (hivekeeper.auth.labs maps them to roles).
LAB_ROLES = ("backbone", "trainer", "auxiliary", "server")
LabRole = Literal["backbone", "trainer", "auxiliary", "server"]
LAB_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # a DNS label: it names the lab's peers and metrics


class LabSpec(SpecModel):
    name: str = Field(..., min_length=1, max_length=63, pattern=LAB_NAME_PATTERN,
                      description="the lab's identity: what its invite names (a DNS label)")
    max_peers: int = Field(..., ge=1, le=10_000, description="at most this many of its peers hold a token at once")
    roles: list[LabRole] = Field(..., min_length=1, max_length=len(LAB_ROLES),
                                 description="what its peers may run: backbone, trainer, auxiliary, server")

    cel_rules = (
        CelRule("self.roles.all(r, self.roles.exists_one(s, s == r))", "names a role twice", ".roles"),
    )

    @model_validator(mode="after")
    def _roles_once(self) -> "LabSpec":
        if len(set(self.roles)) != len(self.roles):
            raise ValueError(f"roles: lab {self.name!r} names a role twice")
        return self


def lab_roles_rule(allowed: Sequence[str], kind: str) -> CelRule:
    """The kind's check that its labs run only roles it has (a kind's spec lists it in cel_rules)."""
    listed = ", ".join(f"'{role}'" for role in allowed)
    return CelRule(f"!has(self.volunteers.labs) || self.volunteers.labs.all(l, l.roles.all(r, r in [{listed}]))",
                   f"a lab of a {kind} may run only {', '.join(allowed)}", ".volunteers.labs")


def check_lab_roles(volunteers: "VolunteersSpec", allowed: Sequence[str], kind: str) -> None:
    for lab in volunteers.labs:
        other = [role for role in lab.roles if role not in allowed]
        if other:
            raise ValueError(f"volunteers.labs: lab {lab.name!r} names {', '.join(other)}; a lab of a {kind} "
                             f"may run only {', '.join(allowed)}")


class VolunteersSpec(SpecModel):
    enabled: StrictBool = Field(False, description="run relays and the token service; every peer then needs a token")
    relays: int = Field(1, ge=1, le=8, description="circuit relays: DHT entry points with a public address")
    service_type: Literal["LoadBalancer", "NodePort"] = Field(
        "LoadBalancer", description="how the relays and the token service are exposed outside the cluster")
    public_host: Optional[str] = Field(
        None, description="the address volunteers dial (default: the LoadBalancer's; locally the --host of up)")
    relay_port: int = Field(31337, ge=1, le=65535,
                            description="the first relay's port (relay i: relayPort + i); a node port for NodePort")
    gateway_port: int = Field(31336, ge=1, le=65535, description="the token service's gRPC port (NodePort: node port)")
    allowlist: list[str] = Field(default_factory=list, description="identities that may get a token")
    labs: list[LabSpec] = Field(default_factory=list, max_length=64,
                                description="labs that pool their clusters' peers: one invite each, a token per "
                                            "peer, at most maxPeers at once, only the roles listed")
    allowlist_secret: Optional[str] = Field(
        None, description="a Secret whose key 'allowlist' lists more identities, one a line (cluster only)")
    token_ttl_seconds: float = Field(3600.0, ge=60, description="lifetime of an access token; peers renew it")
    placement: Placement = Field(default_factory=Placement, description="the relays' and the token service's")

    cel_rules = (
        CelRule("!self.enabled || (has(self.allowlist) && size(self.allowlist) > 0) || "
                "(has(self.labs) && size(self.labs) > 0) || has(self.allowlistSecret)",
                "volunteers.enabled admits only allowlisted identities: set allowlist, labs or allowlistSecret",
                ".allowlist"),
        CelRule("self.serviceType != 'NodePort' || !self.enabled || (has(self.publicHost) && size(self.publicHost) > 0)",
                "serviceType NodePort: set publicHost, a node address volunteers can reach", ".publicHost"),
        CelRule(f"self.serviceType != 'NodePort' || (self.relayPort >= {NODE_PORTS[0]} && "
                f"self.relayPort + self.relays - 1 <= {NODE_PORTS[1]})",
                f"every relay's NodePort (relayPort + i) must be within {NODE_PORTS[0]}-{NODE_PORTS[1]}", ".relayPort"),
        CelRule(f"self.serviceType != 'NodePort' || (self.gatewayPort >= {NODE_PORTS[0]} && "
                f"self.gatewayPort <= {NODE_PORTS[1]})",
                f"a NodePort must be within {NODE_PORTS[0]}-{NODE_PORTS[1]}", ".gatewayPort"),
        CelRule("self.gatewayPort < self.relayPort || self.gatewayPort >= self.relayPort + self.relays",
                "collides with a relay port (relayPort + i)", ".gatewayPort"),
    )

    def node_ports(self) -> dict[str, range]:
        """The node ports the door's Services take, by field (none unless enabled with NodePort)."""
        if not self.enabled or self.service_type != "NodePort":
            return {}
        return {"volunteers.relayPort": range(self.relay_port, self.relay_port + self.relays),
                "volunteers.gatewayPort": range(self.gateway_port, self.gateway_port + 1)}

    @model_validator(mode="after")
    def _someone_may_join(self) -> "VolunteersSpec":
        if self.enabled and not self.allowlist and not self.labs and self.allowlist_secret is None:
            raise ValueError("volunteers.enabled admits only allowlisted identities: set allowlist, labs or "
                             "allowlistSecret")
        names = [lab.name for lab in self.labs]
        twice = sorted({name for name in names if names.count(name) > 1} | (set(names) & set(self.allowlist)))
        if twice:
            raise ValueError(f"labs: {', '.join(twice)}: a lab's name appears once, and not on the allowlist too")
        if self.service_type == "NodePort" and self.enabled and not self.public_host:
            raise ValueError("serviceType NodePort: set publicHost, a node address volunteers can reach")
        if self.service_type == "NodePort":
            low, high = NODE_PORTS
            ports = {"relayPort": (self.relay_port, self.relay_port + self.relays - 1),
                     "gatewayPort": (self.gateway_port, self.gateway_port)}
            outside = [name for name, (first, last) in ports.items() if first < low or last > high]
            if outside:
                raise ValueError(f"{', '.join(outside)}: a NodePort must be within {low}-{high}")
        if self.gateway_port in range(self.relay_port, self.relay_port + self.relays):
            raise ValueError(f"gatewayPort {self.gateway_port} collides with a relay port")
        return self
