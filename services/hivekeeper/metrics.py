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
        self.registry = r = registry or CollectorRegistry()

        def gauge(name: str, documentation: str, *labels: str) -> Gauge:
            return Gauge(name, documentation, labels, registry=r)

        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, labels, registry=r)

        self.peer_info = Info("hivekeeper_peer", "Identity of this process in the swarm", registry=r)
        self.samples = counter("hivekeeper_samples", "Training samples processed by this peer")
        self.samples_per_second = gauge(
            "hivekeeper_samples_per_second",
            "This peer's recent training throughput (kept while the plan makes it an aggregator)")
        self.collaboration_samples_per_second = gauge(
            "hivekeeper_collaboration_samples_per_second",
            "Training throughput of the whole collaboration, as this peer sees it in the DHT")
        self.local_step = gauge("hivekeeper_local_step", "Optimizer steps (epochs) this peer has taken")
        self.global_step = gauge("hivekeeper_global_step", "Latest global optimizer step in the collaboration")
        self.loss = gauge("hivekeeper_loss", "Mean training loss of this peer's latest step")
        self.outer_step = gauge("hivekeeper_outer_step",
                                "Outer steps this replica has taken (DiLoCo; merges in the other merging modes)")
        self.averaging_rounds = counter(
            "hivekeeper_averaging_rounds", "Gradient averaging rounds by outcome", "outcome")
        for outcome in ("success", "failure", "skipped", "resync"):
            self.averaging_rounds.labels(outcome)
        self.parameter_rounds = counter(
            "hivekeeper_parameter_rounds", "Parameter averaging rounds (held on the gradient round's group) by outcome",
            "outcome")
        for outcome in ("averaged", "failed"):
            self.parameter_rounds.labels(outcome)
        self.averaging_round_duration = Histogram(
            "hivekeeper_averaging_round_duration_seconds",
            "Time from the start of an all-reduce to the averaged result", buckets=ROUND_SECONDS_BUCKETS, registry=r)
        self.step_phase_seconds = gauge(
            "hivekeeper_step_phase_seconds",
            "Where this peer's recent collaborative steps spent their time (median of the last 16): "
            "accumulate, wait (trigger to all-reduce), allreduce, after (optimizer step), step (the whole period)",
            "phase")
        self.averaging_group_size = gauge(
            "hivekeeper_averaging_group_size", "Peers in this peer's latest averaging group")
        self.averaging_sent_bytes = counter(
            "hivekeeper_averaging_sent_bytes", "Bytes of tensor parts this peer sent in averaging")
        self.averaging_received_bytes = counter(
            "hivekeeper_averaging_received_bytes", "Bytes of tensor parts this peer received in averaging")
        # inputs of the averaging plan: a short probe at join, then the rates achieved in averaging
        self.upload_bytes_per_second = gauge(
            "hivekeeper_upload_bytes_per_second",
            "This peer's measured upload rate (bandwidth probe at join, then averaging transfers)")
        self.download_bytes_per_second = gauge(
            "hivekeeper_download_bytes_per_second",
            "This peer's measured download rate (bandwidth probe at join, then averaging transfers)")
        # the averaging plan (balancer)
        self.plans = counter("hivekeeper_plans", "Averaging plans the balancer solved")
        self.plan_input_errors = counter(
            "hivekeeper_plan_input_errors", "Times the balancer could not read its inputs (Prometheus down)")
        self.plan_steps_per_second = gauge(
            "hivekeeper_plan_steps_per_second", "Optimizer steps/s the current averaging plan predicts")
        self.plan_compute_bound = gauge(
            "hivekeeper_plan_compute_bound_steps_per_second", "Steps/s the plan's computing peers' samples allow")
        self.plan_aggregation_bound = gauge(
            "hivekeeper_plan_aggregation_bound_steps_per_second",
            "Gradient vectors/s the plan's aggregators can average")
        self.plan_averaging_seconds = gauge(
            "hivekeeper_plan_averaging_seconds", "Time to average one gradient vector under the plan")
        self.plan_step_seconds = gauge(
            "hivekeeper_plan_step_seconds",
            "The plan's predicted time per step by part: compute, transfer, and the fixed costs the peers "
            "measure (lag, wait, roundTrips, after)", "part")
        self.plan_solve_seconds = gauge("hivekeeper_plan_solve_seconds", "Time the latest plan took to solve")
        self.plan_updated = gauge(
            "hivekeeper_plan_last_update_timestamp_seconds",
            "When the balancer last published the plan (renewals included)")
        self.plan_share = gauge(
            "hivekeeper_plan_aggregation_share", "Share of the gradient vector each peer aggregates under the plan",
            "peer")
        self.plan_computes_gradients = gauge(
            "hivekeeper_plan_computes_gradients",
            "1 if the plan has the peer compute gradients, 0 if it only aggregates", "peer")
        self.peers_alive = gauge("hivekeeper_peers_alive", "Peers of the collaboration seen alive in the DHT, by role",
                                 "role")
        # each party of a swarm pooled by labs, from the peers' DHT reports (swarm.parties): what a
        # lab's part is, readable in any lab's Prometheus, the peers of the others included
        self.lab_peers = gauge("hivekeeper_lab_peers", "Peers of each party (a lab, a volunteer, the host) "
                                                       "reporting in the DHT", "lab")
        self.lab_samples_per_second = gauge("hivekeeper_lab_samples_per_second",
                                            "Samples/s each party's trainers report", "lab")
        self.lab_sample_share = gauge("hivekeeper_lab_sample_share",
                                      "Each party's share of the samples computed so far", "lab")
        self.state_loads = counter("hivekeeper_state_loads", "Times this peer loaded state from others")
        self.replica_resyncs = counter(
            "hivekeeper_replica_resyncs",
            "Rounds in which this replica's parameters differed from its averaging group's: it dropped its "
            "update and reloaded the state")
        self.eval_metric = gauge("hivekeeper_eval_metric", "Held-out metric of the averaged model (monitor)", "metric")
        self.checkpoints = counter("hivekeeper_checkpoints_saved", "Checkpoints the monitor saved")
