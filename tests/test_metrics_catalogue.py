"""docs/metrics.md lists every metric the services (Swarm, BlockServer, ExpertPool roles) and the operator define, as exposed (name,
type, labels), lists none they do not define unless marked planned, and the alerting rules
read only metrics it lists."""

from __future__ import annotations

import re

import yaml
from prometheus_client.metrics import MetricWrapperBase

from conftest import REPO
from hivekeeper.blocks.metrics import BlockMetrics
from hivekeeper.experts.common import ExpertMetrics
from hivekeeper.hivemind_ext.admission import RefusalCounts
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.volunteer.metrics import AuthMetrics, RelayMetrics
from hivekeeper_operator.metrics import OperatorMetrics

CATALOGUE = REPO / "docs" / "metrics.md"
RULES = REPO / "charts" / "hivekeeper" / "files" / "alerts.yaml"
SUFFIX = {"counter": "_total", "info": "_info"}  # prometheus_client's family name lacks these


def defined() -> dict[str, tuple[str, set[str]]]:
    """Exposed name -> (type, label names) of every metric of the services and the operator. A
    name several kinds export (hivekeeper_samples_total, ...) must mean the same type and labels."""
    out: dict[str, tuple[str, set[str]]] = {}
    for metrics in (SwarmMetrics(), BlockMetrics(), ExpertMetrics(), RelayMetrics(), AuthMetrics(), OperatorMetrics()):
        for metric in vars(metrics).values():
            if isinstance(metric, MetricWrapperBase):
                family = metric.describe()[0]
                # an Info's labels are its value, set at run time; prometheus_client keeps the rest here
                labels = set() if family.type == "info" else set(metric._labelnames)
                name = family.name + SUFFIX.get(family.type, "")
                assert out.get(name, (family.type, labels)) == (family.type, labels), f"{name} differs between kinds"
                out[name] = (family.type, labels)
    for collector in (RefusalCounts(),):  # custom collectors every role of an open resource registers
        for family in collector.collect():
            out[family.name + SUFFIX.get(family.type, "")] = (family.type, {k for s in family.samples for k in s.labels})
    return out


def catalogue() -> dict[str, tuple[str, set[str], bool]]:
    """Metric -> (type, label names, planned) from the tables' rows."""
    out = {}
    for line in CATALOGUE.read_text().splitlines():
        row = re.match(r"\| `(hivekeeper_\w+)` \| (\w+) \|([^|]*)\|", line)
        if row:
            name, kind, labels = row.groups()
            # "`kind`, `result`: `success`, `error`": the names come before the colon, values after
            label_names = set() if kind == "info" else set(re.findall(r"`(\w+)`", labels.split(":")[0]))
            out[name] = (kind, label_names, "*planned*" in line)
    return out


def test_catalogue_lists_every_metric_as_exposed():
    documented = catalogue()
    for name, (kind, labels) in defined().items():
        assert name in documented, f"{name} is missing from docs/metrics.md"
        assert documented[name][:2] == (kind, labels), f"docs/metrics.md has {name} as {documented[name][:2]}"


def test_catalogue_lists_no_metric_that_is_not_defined_unless_planned():
    code = defined()
    stale = [name for name, (_, _, planned) in catalogue().items() if name not in code and not planned]
    assert not stale, f"docs/metrics.md lists metrics no module defines: {stale}"


def test_alerts_read_only_catalogued_metrics():
    documented = catalogue()
    groups = yaml.safe_load(RULES.read_text())["groups"]
    used = {name for group in groups for rule in group["rules"] for name in re.findall(r"hivekeeper_\w+", rule["expr"])}
    assert used and used <= set(documented), sorted(used - set(documented))
