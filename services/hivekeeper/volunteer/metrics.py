"""Metrics of the roles that let volunteers in, for any kind: the relay and the token service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info


class AccessMetrics:
    """What both export: the process's identity, and (relay) who is alive in the DHT."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.peer_info = Info("hivekeeper_peer", "Identity of this process in the swarm", registry=r)
        self.peers_alive = Gauge(
            "hivekeeper_peers_alive", "Peers of the collaboration seen alive in the DHT, by role", ["role"], registry=r)


class RelayMetrics(AccessMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.connected_peers = Gauge(
            "hivekeeper_relay_connected_peers", "Peers with an open libp2p connection to this relay", registry=r)
        self.reachability_checks = Counter(
            "hivekeeper_reachability_checks", "Dial-back reachability checks this relay answered, by outcome",
            ["outcome"], registry=r)
        for outcome in ("reachable", "unreachable", "error"):
            self.reachability_checks.labels(outcome)


class AuthMetrics(AccessMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.auth_tokens_issued = Counter(
            "hivekeeper_auth_tokens_issued", "Access tokens the token service issued, by invite kind",
            ["kind"], registry=r)
        self.auth_refusals = Counter(
            "hivekeeper_auth_refusals", "Join requests the token service refused, by reason", ["reason"], registry=r)
