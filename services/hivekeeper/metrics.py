"""Prometheus metrics of the Swarm services. Names follow Prometheus conventions
(`hivekeeper_` prefix, base units, `_total` counters). Which swarm, role and peer a series
belongs to comes from target labels (the scrape config or Kubernetes service discovery) and
from `hivekeeper_peer_info`, not from per-sample labels, so label values stay bounded."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

ROUND_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class SwarmMetrics:
    """Every metric a Swarm role may export; each role sets the ones it has."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.peer_info = Info("hivekeeper_peer", "Identity of this process in the swarm", registry=r)
        self.samples = Counter("hivekeeper_samples", "Training samples processed by this peer", registry=r)
        self.samples_per_second = Gauge(
            "hivekeeper_samples_per_second", "This peer's recent training throughput", registry=r
        )
        self.collaboration_samples_per_second = Gauge(
            "hivekeeper_collaboration_samples_per_second",
            "Training throughput of the whole collaboration, as this peer sees it in the DHT",
            registry=r,
        )
        self.local_step = Gauge("hivekeeper_local_step", "Optimizer steps (epochs) this peer has taken", registry=r)
        self.global_step = Gauge("hivekeeper_global_step", "Latest global optimizer step in the collaboration", registry=r)
        self.loss = Gauge("hivekeeper_loss", "Mean training loss of this peer's latest step", registry=r)
        self.averaging_rounds = Counter(
            "hivekeeper_averaging_rounds", "Gradient averaging rounds by outcome", ["outcome"], registry=r
        )
        for outcome in ("success", "failure", "skipped"):
            self.averaging_rounds.labels(outcome)
        self.averaging_round_duration = Histogram(
            "hivekeeper_averaging_round_duration_seconds",
            "Time from the start of an all-reduce to the averaged result",
            buckets=ROUND_SECONDS_BUCKETS,
            registry=r,
        )
        self.averaging_group_size = Gauge(
            "hivekeeper_averaging_group_size", "Peers in this peer's latest averaging group", registry=r
        )
        self.averaging_sent_bytes = Counter(
            "hivekeeper_averaging_sent_bytes", "Bytes of tensor parts this peer sent in averaging", registry=r
        )
        self.averaging_received_bytes = Counter(
            "hivekeeper_averaging_received_bytes", "Bytes of tensor parts this peer received in averaging", registry=r
        )
        self.peers_alive = Gauge(
            "hivekeeper_peers_alive", "Peers of the collaboration seen alive in the DHT, by role", ["role"], registry=r
        )
        self.state_loads = Counter("hivekeeper_state_loads", "Times this peer loaded state from others", registry=r)
        self.eval_metric = Gauge(
            "hivekeeper_eval_metric", "Held-out metric of the averaged model (monitor)", ["metric"], registry=r
        )
        self.checkpoints = Counter("hivekeeper_checkpoints_saved", "Checkpoints the monitor saved", registry=r)
