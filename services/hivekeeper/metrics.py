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
            "hivekeeper_samples_per_second",
            "This peer's recent training throughput (kept while the plan makes it an aggregator)", registry=r
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
        # inputs of the averaging plan: a short probe at join, then the rates achieved in averaging
        self.upload_bytes_per_second = Gauge(
            "hivekeeper_upload_bytes_per_second",
            "This peer's measured upload rate (bandwidth probe at join, then averaging transfers)",
            registry=r,
        )
        self.download_bytes_per_second = Gauge(
            "hivekeeper_download_bytes_per_second",
            "This peer's measured download rate (bandwidth probe at join, then averaging transfers)",
            registry=r,
        )
        # the averaging plan (balancer)
        self.plans = Counter("hivekeeper_plans", "Averaging plans the balancer solved", registry=r)
        self.plan_input_errors = Counter(
            "hivekeeper_plan_input_errors", "Times the balancer could not read its inputs (Prometheus down)", registry=r)
        self.plan_steps_per_second = Gauge(
            "hivekeeper_plan_steps_per_second", "Optimizer steps/s the current averaging plan predicts", registry=r)
        self.plan_compute_bound = Gauge(
            "hivekeeper_plan_compute_bound_steps_per_second",
            "Steps/s the plan's computing peers' samples allow", registry=r)
        self.plan_aggregation_bound = Gauge(
            "hivekeeper_plan_aggregation_bound_steps_per_second",
            "Gradient vectors/s the plan's aggregators can average", registry=r)
        self.plan_averaging_seconds = Gauge(
            "hivekeeper_plan_averaging_seconds", "Time to average one gradient vector under the plan", registry=r)
        self.plan_solve_seconds = Gauge(
            "hivekeeper_plan_solve_seconds", "Time the latest plan took to solve", registry=r)
        self.plan_updated = Gauge(
            "hivekeeper_plan_last_update_timestamp_seconds",
            "When the balancer last published the plan (renewals included)", registry=r)
        self.plan_share = Gauge(
            "hivekeeper_plan_aggregation_share", "Share of the gradient vector each peer aggregates under the plan",
            ["peer"], registry=r)
        self.plan_computes_gradients = Gauge(
            "hivekeeper_plan_computes_gradients", "1 if the plan has the peer compute gradients, 0 if it only aggregates",
            ["peer"], registry=r)
        self.peers_alive = Gauge(
            "hivekeeper_peers_alive", "Peers of the collaboration seen alive in the DHT, by role", ["role"], registry=r
        )
        self.state_loads = Counter("hivekeeper_state_loads", "Times this peer loaded state from others", registry=r)
        self.eval_metric = Gauge(
            "hivekeeper_eval_metric", "Held-out metric of the averaged model (monitor)", ["metric"], registry=r
        )
        self.checkpoints = Counter("hivekeeper_checkpoints_saved", "Checkpoints the monitor saved", registry=r)
        # the token service (auth role)
        self.auth_tokens_issued = Counter(
            "hivekeeper_auth_tokens_issued", "Access tokens the token service issued, by invite kind",
            ["kind"], registry=r)
        self.auth_refusals = Counter(
            "hivekeeper_auth_refusals", "Join requests the token service refused, by reason", ["reason"], registry=r)
