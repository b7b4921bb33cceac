"""The operator's own Prometheus metrics (served on /metrics beside /healthz and /readyz)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "hivekeeper_operator_reconciles", "Reconciles of hivekeeper resources, by kind and result",
            ["kind", "result"], registry=self.registry)
        self.errors = Counter(
            "hivekeeper_operator_reconcile_errors", "Reconciles that failed, by kind and reason",
            ["kind", "reason"], registry=self.registry)
        self.duration = Histogram(
            "hivekeeper_operator_reconcile_duration_seconds", "Time one reconcile takes, by kind",
            ["kind"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.writes = Counter(
            "hivekeeper_operator_child_writes", "Writes to child objects, by owner kind, child kind and action",
            ["kind", "child_kind", "action"], registry=self.registry)
        self.status_writes = Counter(
            "hivekeeper_operator_status_writes", "Status updates written, by kind", ["kind"], registry=self.registry)
        self.resources = Gauge(
            "hivekeeper_operator_resources", "hivekeeper resources seen at the last resync, by kind and phase",
            ["kind", "phase"], registry=self.registry)
        self.monitor_reads = Counter(
            "hivekeeper_operator_monitor_reads", "Reads of swarm monitors' status, by result",
            ["result"], registry=self.registry)
