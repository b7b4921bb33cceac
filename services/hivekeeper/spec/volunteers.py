"""Peers from outside the cluster (DeDLOC section 3.3 and appendix I.5): relays they reach the
swarm through, and the token service that admits only allowlisted identities."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, StrictBool, model_validator

from hivekeeper.spec.base import SpecModel


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

    @model_validator(mode="after")
    def _someone_may_join(self) -> "VolunteersSpec":
        if self.enabled and not self.allowlist and self.allowlist_secret is None:
            raise ValueError("volunteers.enabled admits only allowlisted identities: set allowlist or allowlistSecret")
        if self.service_type == "NodePort" and self.enabled and not self.public_host:
            raise ValueError("serviceType NodePort: set publicHost, a node address volunteers can reach")
        if self.service_type == "NodePort":
            ports = {"relayPort": self.relay_port + self.relays - 1, "gatewayPort": self.gateway_port}
            outside = [name for name, port in ports.items() if not 30000 <= port <= 32767]
            if outside:
                raise ValueError(f"{', '.join(outside)}: a NodePort must be within 30000-32767")
        if self.gateway_port in range(self.relay_port, self.relay_port + self.relays):
            raise ValueError(f"gatewayPort {self.gateway_port} collides with a relay port")
        return self
