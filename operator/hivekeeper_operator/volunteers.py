"""A resource's door for volunteers (spec.volunteers), as pure functions.

Children, when enabled (besides the relay and auth roles, planned like any other):
  NAME-swarm-auth  Secret   the token-signing key (made once; only the auth pod mounts it)
  NAME-invites     Secret   an internal invite per role: every peer asks the token service
                            for its access token with it, like a volunteer with theirs
  NAME-relay-I     Service  LoadBalancer or NodePort: relay I at volunteers.relayPort + I
  NAME-gateway     Service  LoadBalancer or NodePort: the token service's gRPC port
The relays announce the address volunteers dial: volunteers.publicHost, or else their
LoadBalancer's, read from the Service's status (until it has one, the relay runs unannounced
and the token service offers volunteers only the relays that have one)."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from hivekeeper.auth.signing import signing_key_from_pem
from hivekeeper.auth.tokens import InvalidToken, mint_invite, read_invite
from hivekeeper.spec.volunteers import VolunteersSpec
from hivekeeper.topology import GRPC, P2P, Role

TOKEN_SERVICE = "auth"  # the token service's component
PLAN_SIGNER = "balancer-0"  # the role whose averaging plan volunteers follow, where there is one
INTERNAL_INVITE_SECONDS = 365 * 24 * 3600.0
SWARM_KEY = "swarm-auth.pem"


def swarm_auth_secret_name(name: str) -> str:
    return f"{name}-swarm-auth"


def invites_secret_name(name: str) -> str:
    return f"{name}-invites"


def relay_service_name(name: str, index: int) -> str:
    return f"{name}-relay-{index}"


def gateway_service_name(name: str) -> str:
    return f"{name}-gateway"


def relay_ids(door: VolunteersSpec, peer_ids: dict[str, str]) -> list[str]:
    return [peer_ids[f"relay-{i}"] for i in range(door.relays)]


@dataclass
class VolunteerAccess:
    """What admitting volunteers needs besides the roles: made once, kept in Secrets."""

    relay_hosts: list[Optional[str]]  # public host of each relay, None while unknown
    auth_data: dict[str, str]  # Secret data: the signing key
    invites_data: dict[str, str]  # Secret data: every role's invite


def generate_swarm_key() -> bytes:
    """A fresh token-signing key, PEM."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def ensure_access(auth_data: Optional[dict[str, str]], invites_data: Optional[dict[str, str]], swarm: str,
                  roles: list[Role], generate: Callable[[], bytes] = generate_swarm_key,
                  now: Optional[float] = None) -> tuple[dict[str, str], dict[str, str]]:
    """Secret `data` for the signing key (kept once made) and for the invites: one for every
    role but the token service's own, existing ones kept while their key is the current one."""
    auth = dict(auth_data or {})
    if SWARM_KEY not in auth:
        auth[SWARM_KEY] = base64.b64encode(generate()).decode()
    key = signing_key_from_pem(base64.b64decode(auth[SWARM_KEY]), SWARM_KEY)
    public = key.get_public_key()
    now = time.time() if now is None else now
    invites: dict[str, str] = {}
    for role in roles:
        if role.component == TOKEN_SERVICE:
            continue
        name = f"{role.name}.invite"
        kept = (invites_data or {}).get(name)
        if kept:
            try:
                invite = read_invite(base64.b64decode(kept).decode(), public, now=now + 7 * 24 * 3600)
                if invite.identity == f"{swarm}/{role.name}":
                    invites[name] = kept
                    continue
            except (InvalidToken, ValueError):
                pass  # signed by a replaced key, or expiring within the week: mint a new one
        text = mint_invite(key, f"{swarm}/{role.name}", now + INTERNAL_INVITE_SECONDS, internal=True)
        invites[name] = base64.b64encode(text.encode()).decode()
    return auth, invites


def public_hosts(spec: VolunteersSpec, services: list[Optional[dict[str, Any]]]) -> list[Optional[str]]:
    """The host each relay announces: the spec's, or its LoadBalancer Service's ingress."""
    if spec.public_host:
        return [spec.public_host] * spec.relays
    return [ingress_host(service) for service in services]


def ingress_host(service: Optional[dict[str, Any]]) -> Optional[str]:
    """A LoadBalancer Service's address once it has one (IP or hostname), else None."""
    ingress = (((service or {}).get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    return next((i.get("ip") or i.get("hostname") for i in ingress if i.get("ip") or i.get("hostname")), None)


def external_services(meta: Callable[..., dict], swarm: str, spec: VolunteersSpec,
                      pod_selector: Callable[[str, str], dict[str, str]]) -> list[dict[str, Any]]:
    """The Services volunteers dial: one per relay (each announces its own port) and the gateway."""
    def service(name: str, component: str, selector: dict[str, str], port: int, target: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": target, "port": port, "targetPort": target, "protocol": "TCP"}
        if spec.service_type == "NodePort":
            entry["nodePort"] = port
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, component),
                "spec": {"type": spec.service_type, "selector": selector, "ports": [entry],
                         # volunteers are told the relay's address: keep their source address intact
                         "externalTrafficPolicy": "Local"}}

    out = [service(relay_service_name(swarm, i), "relay", pod_selector("relay", i), spec.relay_port + i, P2P)
           for i in range(spec.relays)]
    out.append(service(gateway_service_name(swarm), "auth", pod_selector("auth", 0), spec.gateway_port, GRPC))
    return out
