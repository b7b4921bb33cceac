"""What every ExpertPool role shares: its context (the shared role layer) and its Prometheus
metrics."""

from __future__ import annotations

import argparse

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from hivekeeper.runtime.context import RoleContext
from hivekeeper.runtime.lifecycle import load_context
from hivekeeper.spec.expertpool import ExpertPoolSpec

PoolContext = RoleContext[ExpertPoolSpec]

BEAM_SEARCH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# cancelled: the layer stopped waiting (its examples had kMin replies, or the timeout passed)
REQUEST_OUTCOMES = ("ok", "error", "cancelled")
REQUEST_BUCKETS = BEAM_SEARCH_BUCKETS + (10, 30)  # an expert request may wait out its layer's timeout


class ExpertMetrics:
    """Every metric an ExpertPool role may export; each role sets the ones it has."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.peer_info = Info("hivekeeper_peer", "Identity of this process in the pool", registry=r)
        # servers
        self.experts_hosted = Gauge("hivekeeper_experts_hosted", "Experts this server holds", registry=r)
        self.expert_updates = Gauge(
            "hivekeeper_expert_updates", "Backward requests an expert has applied since it was created "
            "(carried over through checkpoints)", ["expert"], registry=r)
        self.expert_forward_batches = Gauge(
            "hivekeeper_expert_forward_batches", "Batches of forward requests an expert ran since this server "
            "started", ["expert"], registry=r)
        self.checkpoints = Counter("hivekeeper_expert_checkpoints_saved", "Expert checkpoints written", registry=r)
        # trainers
        self.samples = Counter("hivekeeper_samples", "Training samples processed by this peer", registry=r)
        self.samples_per_second = Gauge("hivekeeper_samples_per_second", "This trainer's recent throughput",
                                        registry=r)
        self.loss = Gauge("hivekeeper_loss", "Mean training loss of this trainer's recent batches", registry=r)
        self.failed_batches = Counter(
            "hivekeeper_dmoe_failed_batches", "Batches dropped because an example got fewer than kMin expert "
            "replies", registry=r)
        self.expert_calls = Counter("hivekeeper_dmoe_expert_requests", "Requests to experts by outcome",
                                    ["outcome"], registry=r)
        for outcome in ("ok", "failed"):
            self.expert_calls.labels(outcome)
        self.expert_request_seconds = Histogram(
            "hivekeeper_dmoe_expert_request_seconds", "Time from sending a request to an expert to its end, by "
            "call (forward, backward) and outcome (ok, error, cancelled)", ["call", "outcome"],
            buckets=REQUEST_BUCKETS, registry=r)
        for call in ("forward", "backward"):
            for outcome in REQUEST_OUTCOMES:
                self.expert_request_seconds.labels(call, outcome)
        self.beam_search = Histogram("hivekeeper_dmoe_beam_search_seconds",
                                     "Time to select a batch's top-k experts through the DHT",
                                     buckets=BEAM_SEARCH_BUCKETS, registry=r)
        self.in_flight = Gauge("hivekeeper_dmoe_batches_in_flight", "Batches being processed concurrently",
                               registry=r)
        self.eval_metric = Gauge("hivekeeper_eval_metric", "Held-out metric of this trainer's model",
                                 ["metric"], registry=r)
        # backbone
        self.peers_alive = Gauge("hivekeeper_peers_alive", "Peers of the pool seen alive in the DHT, by role",
                                 ["role"], registry=r)
        self.experts_alive = Gauge("hivekeeper_experts_alive", "Experts announced by live servers", registry=r)


def load_pool_context(role: str, args: argparse.Namespace, signals: bool = True) -> PoolContext:
    """The role's context. `signals=False` leaves SIGTERM/SIGINT handlers to the caller: a server
    forks hivemind's worker processes first, so that they keep the default handlers and die
    when the group is terminated."""
    return load_context(role, args, ExpertPoolSpec, ExpertMetrics(), signals=signals)
