"""Peers exposed outside their cluster (a group's `network.expose`), as pure functions.

Children, per peer of a NodePort or LoadBalancer group:
  NAME-ROLE-public  Service  NodePort (node port `port` + i) or LoadBalancer (port `port`),
                             selecting that one pod, with externalTrafficPolicy Local: the
                             peer's address is its node's, and others see where it dials from
A HostPort group needs no Service: its pods' p2p port takes the host port. Each peer announces
its public address along with its pod IP (`KubernetesNetwork.public_address`); a LoadBalancer
peer, once its Service has an address (until then it runs with its pod IP alone)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from hivekeeper.topology import P2P, Role

from hivekeeper_operator.volunteers import ingress_host

SERVICE_TYPES = ("NodePort", "LoadBalancer")  # the exposures that take a Service per peer


def public_service_name(name: str, role_name: str) -> str:
    return f"{name}-{role_name}-public"


def exposed_services(meta: Callable[..., dict], name: str, roles: list[Role],
                     pod_selector: Callable[[Role], dict[str, str]]) -> list[dict[str, Any]]:
    """The Service of each peer of a NodePort or LoadBalancer group."""
    out = []
    for role in roles:
        exposure = role.exposure
        if exposure.expose not in SERVICE_TYPES:
            continue
        port: dict[str, Any] = {"name": P2P, "port": exposure.public_port(role.index), "targetPort": P2P,
                                "protocol": "TCP"}
        if exposure.expose == "NodePort":
            port["nodePort"] = exposure.public_port(role.index)
        out.append({"apiVersion": "v1", "kind": "Service", "metadata": meta(public_service_name(name, role.name),
                                                                            role.component),
                    "spec": {"type": exposure.expose, "selector": pod_selector(role), "ports": [port],
                             "externalTrafficPolicy": "Local"}})
    return out


def awaited_hosts(roles: list[Role]) -> list[str]:
    """The roles whose public host is their LoadBalancer's, read from its Service's status."""
    return [role.name for role in roles if role.exposure.expose == "LoadBalancer" and not role.exposure.public_host]


def public_hosts(name: str, role_names: list[str],
                 get_service: Callable[[str], Optional[dict[str, Any]]]) -> dict[str, str]:
    """Role name -> its LoadBalancer Service's address, for those that have one."""
    hosts = {}
    for role_name in role_names:
        host = ingress_host(get_service(public_service_name(name, role_name)))
        if host:
            hosts[role_name] = host
    return hosts
