"""The Kubernetes `Network` for `hivekeeper.topology`: every pod has its own IP, so every role
listens on the same fixed ports; backbone peers have stable DNS names through their headless
Service; a role announces its pod IP (the downward API puts it in $POD_IP), and a peer of a
group exposed outside the cluster (`spec.network`) its public address too: its node's IP ($HOST_IP)
at a node or host port, or its LoadBalancer Service's address."""

from __future__ import annotations

from typing import Optional, Sequence

from hivekeeper.spec.network import PeerNetwork
from hivekeeper.topology import JOIN_INVITE

P2P_PORT = 31337
METRICS_PORT = 9300
GRPC_PORT = 50051  # the token service (auth role)
KEYS_DIR = "/var/run/hivekeeper/keys"
INVITES_DIR = "/var/run/hivekeeper/invites"  # Secret NAME-invites: every role's invite
SWARM_KEY_DIR = "/var/run/hivekeeper/swarm-auth"  # Secret NAME-swarm-auth: the auth role's signing key
ALLOWLIST_DIR = "/var/run/hivekeeper/allowlist"  # the user's Secret named by volunteers.allowlistSecret
JOIN_DIR = "/var/run/hivekeeper/join"  # a joining lab's invite: the user's Secret named by join.inviteSecret
CONFIG_DIR = "/etc/hivekeeper"
RUN_DIR = "/var/lib/hivekeeper"
POD_IP_VARIABLE = "$(POD_IP)"
HOST_IP_VARIABLE = "$(HOST_IP)"  # the pod's node's IP (status.hostIP)


class KubernetesNetwork:
    listen_host = "0.0.0.0"

    def __init__(self, swarm: str, namespace: str, cluster_domain: str = "cluster.local",
                 relay_public_hosts: Sequence[Optional[str]] = (), relay_port: int = P2P_PORT,
                 entry_points: Sequence[str] = (), index_base: int = 0,
                 peer_public_hosts: Optional[dict[str, str]] = None):
        self.swarm, self.namespace, self.cluster_domain = swarm, namespace, cluster_domain
        self.relay_public_hosts = list(relay_public_hosts)  # None: its LoadBalancer has no address yet
        self.relay_port = relay_port  # the first relay's public port (volunteers.relayPort)
        self.entry_points = tuple(entry_points)  # a joining lab's: the host's (topology.Network)
        self.index_base = index_base
        self.peer_public_hosts = dict(peer_public_hosts or {})  # role name -> its LoadBalancer's address

    def port(self, role_name: str, port_name: str) -> int:
        return {"p2p": P2P_PORT, "grpc": GRPC_PORT}.get(port_name, METRICS_PORT)

    def backbone_host(self, index: int, component: str = "backbone") -> str:
        service = f"{self.swarm}-{component}"
        return f"{service}-{index}.{service}.{self.namespace}.svc.{self.cluster_domain}"

    def backbone_maddr(self, index: int, port: int, peer_id: str, component: str = "backbone") -> str:
        return f"/dns4/{self.backbone_host(index, component)}/tcp/{port}/p2p/{peer_id}"

    def identity_path(self, role_name: str) -> str:
        return f"{KEYS_DIR}/{role_name}.key"

    def announce_host(self, role_name: str) -> str | None:
        # Expanded in the pod (by the launcher, as Kubernetes expands $(VAR) in args).
        return POD_IP_VARIABLE

    def public_address(self, role_name: str, index: int, exposure: PeerNetwork) -> str | None:
        if exposure.expose == "LoadBalancer":
            host = exposure.public_host or self.peer_public_hosts.get(role_name)
        elif exposure.expose == "NodePort":
            host = exposure.public_host or HOST_IP_VARIABLE  # a node port answers on the peer's own node
        elif exposure.expose == "HostPort":
            host = HOST_IP_VARIABLE
        else:
            return None
        return f"{host}:{exposure.public_port(index)}" if host else None

    def gateway_address(self) -> str:
        return f"{self.backbone_host(0, 'auth')}:{GRPC_PORT}"

    def relay_public_address(self, index: int) -> str | None:
        host = self.relay_public_hosts[index] if index < len(self.relay_public_hosts) else None
        return f"{host}:{self.relay_port + index}" if host else None

    def access_path(self, name: str) -> str:
        directory = {"swarm-auth.pem": SWARM_KEY_DIR, "allowlist": ALLOWLIST_DIR, "swarm-info.json": CONFIG_DIR,
                     JOIN_INVITE: JOIN_DIR}
        return f"{directory.get(name, INVITES_DIR)}/{name}"
