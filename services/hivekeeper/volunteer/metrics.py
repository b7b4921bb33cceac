"""Metrics of the relay role: the Swarm roles' metrics plus what a relay does for volunteers."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from hivekeeper.metrics import SwarmMetrics


class RelayMetrics(SwarmMetrics):
    def __init__(self, registry=None):
        super().__init__(registry)
        r = self.registry
        self.connected_peers = Gauge(
            "hivekeeper_relay_connected_peers", "Peers with an open libp2p connection to this relay", registry=r)
        self.reachability_checks = Counter(
            "hivekeeper_reachability_checks", "Dial-back reachability checks this relay answered, by outcome",
            ["outcome"], registry=r)
        for outcome in ("reachable", "unreachable", "error"):
            self.reachability_checks.labels(outcome)
