"""Peers from outside the cluster (DeDLOC section 3.3 and appendix I.5): relays they reach the
swarm through, and the token service that admits only allowlisted identities."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool, model_validator

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.placement import Placement

NODE_PORTS = (30000, 32767)  # Kubernetes' default NodePort range


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
    allowlist_secret: Optional[str] = Field(
        None, description="a Secret whose key 'allowlist' lists more identities, one a line (cluster only)")
    token_ttl_seconds: float = Field(3600.0, ge=60, description="lifetime of an access token; peers renew it")
    placement: Placement = Field(default_factory=Placement, description="the relays' and the token service's")

    cel_rules = (
        CelRule("!self.enabled || (has(self.allowlist) && size(self.allowlist) > 0) || has(self.allowlistSecret)",
                "volunteers.enabled admits only allowlisted identities: set allowlist or allowlistSecret", ".allowlist"),
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

    @model_validator(mode="after")
    def _someone_may_join(self) -> "VolunteersSpec":
        if self.enabled and not self.allowlist and self.allowlist_secret is None:
            raise ValueError("volunteers.enabled admits only allowlisted identities: set allowlist or allowlistSecret")
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
