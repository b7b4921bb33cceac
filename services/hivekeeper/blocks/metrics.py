"""Prometheus metrics of the BlockServer roles (`hivekeeper_` prefix, base units)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

REQUEST_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
REQUEST_KINDS = ("forward", "backward", "inference")


class BlockMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.peer_info = Info("hivekeeper_peer", "Identity of this process in the swarm", registry=r)
        self.requests = Counter("hivekeeper_block_requests", "Requests served, by kind and outcome",
                                ["kind", "outcome"], registry=r)
        for kind in REQUEST_KINDS:
            for outcome in ("ok", "refused", "error"):
                self.requests.labels(kind, outcome)
        self.request_duration = Histogram("hivekeeper_block_request_duration_seconds",
                                          "Compute time of a served request", ["kind"],
                                          buckets=REQUEST_SECONDS_BUCKETS, registry=r)
        self.tokens = Counter("hivekeeper_block_tokens", "Token positions run through this server's blocks",
                              ["kind"], registry=r)
        for kind in REQUEST_KINDS:  # series exist from the start: rates and quantiles need two samples
            self.request_duration.labels(kind)
            self.tokens.labels(kind)
        self.span_start = Gauge("hivekeeper_block_span_start", "First block this server holds", registry=r)
        self.span_end = Gauge("hivekeeper_block_span_end", "One past the last block this server holds", registry=r)
        self.throughput = Gauge("hivekeeper_block_throughput_tokens_per_second",
                                "Announced throughput per block: min(compute, network)", registry=r)
        self.cache_tokens_left = Gauge("hivekeeper_block_cache_tokens_left",
                                       "Attention-cache token positions not reserved by sessions", registry=r)
        self.sessions = Gauge("hivekeeper_block_sessions", "Open inference sessions", registry=r)
        self.moves = Counter("hivekeeper_block_span_moves", "Times this server moved to another span", registry=r)
        self.served_blocks = Gauge("hivekeeper_block_served_blocks",
                                   "Blocks held by at least one online server (balancer)", registry=r)
        self.min_block_throughput = Gauge("hivekeeper_block_min_throughput_tokens_per_second",
                                          "Throughput of the worst-served block, online servers (balancer)",
                                          registry=r)
        self.block_servers = Gauge("hivekeeper_block_servers", "Online servers holding each block (backbone)",
                                   ["block"], registry=r)
        self.plans = Counter("hivekeeper_block_plans", "Span assignments the balancer published", registry=r)
        self.generated_tokens = Counter("hivekeeper_generated_tokens", "Tokens the client generated", registry=r)
        self.failovers = Counter("hivekeeper_client_failovers",
                                 "Times the client routed around a failed server and replayed", registry=r)
