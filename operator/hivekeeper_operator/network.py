"""The Kubernetes `Network` for `hivekeeper.topology`: every pod has its own IP, so every role
listens on the same fixed ports; backbone peers have stable DNS names through their headless
Service; a role announces its pod IP (the downward API puts it in $POD_IP)."""

from __future__ import annotations

P2P_PORT = 31337
METRICS_PORT = 9300
KEYS_DIR = "/var/run/hivekeeper/keys"
CONFIG_DIR = "/etc/hivekeeper"
RUN_DIR = "/var/lib/hivekeeper"
POD_IP_VARIABLE = "$(POD_IP)"


class KubernetesNetwork:
    listen_host = "0.0.0.0"

    def __init__(self, swarm: str, namespace: str, cluster_domain: str = "cluster.local"):
        self.swarm = swarm
        self.namespace = namespace
        self.cluster_domain = cluster_domain

    def port(self, role_name: str, port_name: str) -> int:
        return P2P_PORT if port_name == "p2p" else METRICS_PORT

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
