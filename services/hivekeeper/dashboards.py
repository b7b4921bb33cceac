"""Grafana dashboards, generated: `hivekeeper dashboards --out DIR` writes one JSON file per
dashboard (the chart ships them in charts/hivekeeper/dashboards/, as ConfigMaps for Grafana's
sidecar). Each panel names the source it needs: "swarm" panels read what `hivekeeper up
--prometheus` scrapes locally; "blocks" and "experts" what those kinds' processes export;
"operator" panels need the operator, which runs only in a cluster.

Series carry no swarm, role or peer label of their own: identity comes from each process's
`hivekeeper_peer_info`, joined on the scrape target (docs/metrics.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA_VERSION = 39
SELECT = 'swarm=~"$swarm", namespace=~"$namespace"'


def identity(labels: str = "swarm", **match: str) -> str:
    """`* on(instance, job) group_left(LABELS) hivekeeper_peer_info{...}`: gives a series its identity."""
    selector = ", ".join([SELECT] + [f'{k}=~"{v}"' for k, v in match.items()])
    return f"on(instance, job) group_left({labels}) hivekeeper_peer_info{{{selector}}}"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or stat
    source: str = "swarm"  # swarm | blocks | experts | operator: what must be scraped (module docstring)
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    panels: tuple[Panel, ...]
    description: str = ""
    tags: tuple[str, ...] = field(default=("hivekeeper",))
    variables: tuple[str, ...] = ("namespace", "swarm")


def _panel(panel: Panel, index: int) -> dict:
    width = 6 if panel.kind == "stat" else 12
    per_row = 24 // width
    return {
        "id": index + 1, "type": panel.kind, "title": panel.title, "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 4 if panel.kind == "stat" else 8, "w": width, "x": (index % per_row) * width,
                    "y": (index // per_row) * 8},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if panel.kind == "timeseries" else {},
        "targets": [{"refId": chr(ord("A") + i), "expr": t.expr, "legendFormat": t.legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, t in enumerate(panel.targets)],
        "hivekeeper": {"source": panel.source},
    }


def _variables(names: tuple[str, ...]) -> list[dict]:
    out = [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
    queries = {
        "namespace": ("label_values(hivekeeper_peer_info, namespace)", "Namespace"),
        "swarm": ('label_values(hivekeeper_peer_info{namespace=~"$namespace"}, swarm)', "Resource"),
        "kind": ("label_values(hivekeeper_operator_reconciles_total, kind)", "Kind"),
    }
    for name in names:
        query, label = queries[name]
        out.append({"name": name, "label": label, "type": "query", "query": {"query": query, "refId": name},
                    "datasource": {"type": "prometheus", "uid": "${datasource}"}, "includeAll": True,
                    "allValue": ".*", "multi": True, "refresh": 2,
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]}})
    return out


def render(dashboard: Dashboard) -> dict:
    return {"uid": dashboard.uid, "title": dashboard.title, "description": dashboard.description,
            "tags": list(dashboard.tags), "schemaVersion": SCHEMA_VERSION, "editable": True,
            "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
            "templating": {"list": _variables(dashboard.variables)},
            "panels": [_panel(panel, i) for i, panel in enumerate(dashboard.panels)]}


MONITOR = identity("swarm", role="monitor")
BACKBONE = identity("swarm", role="backbone")  # every lab of a pooled swarm runs one
BALANCER = identity("swarm", role="balancer")
AVERAGING_PEERS = identity("swarm, peer", role="trainer|auxiliary")

SWARM_OVERVIEW = Dashboard(
    uid="hivekeeper-swarm", title="hivekeeper / Swarm overview",
    description="A Swarm's progress: global step, loss, held-out metrics, throughput, and who is there.",
    panels=(
        Panel("Global step", (Target(f"max by (swarm) (hivekeeper_global_step * {MONITOR})", "{{swarm}}"),),
              kind="stat"),
        Panel("Collaboration samples/s",
              (Target(f"max by (swarm) (hivekeeper_collaboration_samples_per_second * {MONITOR})", "{{swarm}}"),),
              unit="short", kind="stat"),
        Panel("Trainers alive",
              (Target(f'max by (swarm) (hivekeeper_peers_alive{{role="trainer"}} * {identity("swarm", role="backbone")})',
                      "{{swarm}}"),), kind="stat"),
        Panel("Checkpoints saved", (Target(f"max by (swarm) (hivekeeper_checkpoints_saved_total * {MONITOR})",
                                           "{{swarm}}"),), kind="stat"),
        Panel("Training loss", (Target(f"max by (swarm) (hivekeeper_loss * {MONITOR})", "{{swarm}}"),),
              description="mean loss over the trainers of the latest step they report"),
        Panel("Held-out metrics", (Target(f"max by (swarm, metric) (hivekeeper_eval_metric * {MONITOR})",
                                          "{{swarm}} {{metric}}"),)),
        Panel("Samples/s by trainer",
              (Target(f"hivekeeper_samples_per_second * {identity('swarm, peer', role='trainer')}", "{{peer}}"),)),
        Panel("Peers by role (joins and leaves)",
              (Target(f'max by (role) (hivekeeper_peers_alive * {identity("swarm", role="backbone")})', "{{role}}"),),
              description="peers with a fresh report in the DHT, as the backbone counts them"),
        Panel("State loads (joins, catching up)",
              (Target(f"sum by (peer) (increase(hivekeeper_state_loads_total[$__rate_interval]) * {AVERAGING_PEERS})",
                      "{{peer}}"),)),
        Panel("Optimizer steps/s",
              (Target(f"max by (swarm) (deriv(hivekeeper_global_step[$__rate_interval]) * {MONITOR})", "achieved"),
               Target(f"max by (swarm) (hivekeeper_plan_steps_per_second * {BALANCER})", "planned")),
              description="achieved (the monitor's global step) against the averaging plan's prediction"),
        Panel("Samples/s by lab",
              (Target(f"max by (lab) (hivekeeper_lab_samples_per_second * {BACKBONE})", "{{lab}}"),),
              description="each party of a swarm pooled by labs (the host, each lab, each volunteer), from the "
                          "peers' reports in the DHT: any lab's Prometheus sees every party"),
        Panel("Share of the samples by lab",
              (Target(f"max by (lab) (hivekeeper_lab_sample_share * {BACKBONE})", "{{lab}}"),), unit="percentunit"),
        Panel("Peers by lab", (Target(f"max by (lab) (hivekeeper_lab_peers * {BACKBONE})", "{{lab}}"),)),
    ),
)

AVERAGING = Dashboard(
    uid="hivekeeper-averaging", title="hivekeeper / Averaging rounds",
    description="Gradient averaging: how long rounds take, how they end, who moves how many bytes, "
                "and the balancer's plan against what the swarm achieves; with replicas that train alone, "
                "their merges or DiLoCo's outer rounds.",
    panels=(
        Panel("Round duration", tuple(
            Target(f"histogram_quantile({q}, sum by (le) (rate(hivekeeper_averaging_round_duration_seconds_bucket"
                   f"[$__rate_interval]) * {identity('swarm', role='trainer|auxiliary')}))", f"p{int(q * 100)}")
            for q in (0.5, 0.9, 0.99)), unit="s"),
        Panel("Round outcomes",
              (Target(f"sum by (outcome) (increase(hivekeeper_averaging_rounds_total[$__rate_interval]) * "
                      f"{identity('swarm', role='trainer|auxiliary')})", "{{outcome}}"),)),
        Panel("Group size", (Target(f"hivekeeper_averaging_group_size * {AVERAGING_PEERS}", "{{peer}}"),)),
        Panel("Bytes moved in all-reduce", tuple(
            Target(f"rate(hivekeeper_averaging_{way}_bytes_total[$__rate_interval]) * {AVERAGING_PEERS}",
                   f"{{{{peer}}}} {way}") for way in ("sent", "received")), unit="Bps",
              description="tensor bytes per second each peer sends and receives in rounds (after compression)"),
        Panel("Bytes sent in all-reduce by lab",
              (Target('label_replace(sum by (lab) (rate(hivekeeper_averaging_sent_bytes_total[$__rate_interval]) * '
                      f'{identity("lab", role="trainer|auxiliary")}), "lab", "(this lab)", "lab", "")', "{{lab}}"),),
              unit="Bps", description="the averaging peers this Prometheus scrapes, by the lab that admitted them"),
        Panel("Measured upload", (Target(f"hivekeeper_upload_bytes_per_second * {AVERAGING_PEERS}", "{{peer}}"),),
              unit="Bps", description="probe at join, then what rounds achieve: the planner's input"),
        Panel("Measured download", (Target(f"hivekeeper_download_bytes_per_second * {AVERAGING_PEERS}", "{{peer}}"),),
              unit="Bps"),
        Panel("Planned vs achieved steps/s",
              (Target(f"max by (swarm) (hivekeeper_plan_steps_per_second * {BALANCER})", "planned"),
               Target(f"max by (swarm) (deriv(hivekeeper_global_step[$__rate_interval]) * {MONITOR})", "achieved"))),
        Panel("Efficiency (achieved / predicted steps/s)",
              (Target(f"max by (swarm) (deriv(hivekeeper_global_step[$__rate_interval]) * {MONITOR}) / "
                      f"max by (swarm) (hivekeeper_plan_steps_per_second * {BALANCER})", "{{swarm}}"),),
              unit="percentunit", kind="stat",
              description="under 0.5 for long: something the plan does not model (failed rounds, state loads, "
                          "restarts); the panel beside it shows where a predicted step's time goes"),
        Panel("Predicted step by part",
              (Target(f"max by (part) (hivekeeper_plan_step_seconds * {BALANCER})", "{{part}}"),), unit="s",
              description="compute and transfer from the LP; lag, wait, roundTrips and after measured by the "
                          "computing peers (the parts that do not scale with the vector)"),
        Panel("Step phases by trainer",
              (Target(f"hivekeeper_step_phase_seconds{{phase!=\"step\"}} * {identity('swarm, peer', role='trainer')}",
                      "{{peer}} {{phase}}"),), unit="s",
              description="median of each trainer's recent steps: accumulate, wait (trigger to all-reduce), "
                          "allreduce, after (optimizer step)"),
        Panel("Aggregation share by peer",
              (Target(f"max by (peer) (hivekeeper_plan_aggregation_share * {BALANCER})", "{{peer}}"),),
              unit="percentunit"),
        Panel("Plan bounds", (Target(f"max(hivekeeper_plan_compute_bound_steps_per_second * {BALANCER})", "compute"),
                              Target(f"max(hivekeeper_plan_aggregation_bound_steps_per_second * {BALANCER})",
                                     "aggregation"))),
        Panel("Plan age", (Target(f"time() - max(hivekeeper_plan_last_update_timestamp_seconds * {BALANCER})",
                                  "seconds since the last plan"),), unit="s", kind="stat"),
        Panel("Outer steps (DiLoCo) and merges by replica",
              (Target(f"hivekeeper_outer_step * {identity('swarm, peer', role='trainer')}", "{{peer}}"),),
              description="replicas that train alone (averaging.mode diloco, parameters, ties): outer steps or "
                          "merges each has taken; replicas that agree on the outer state show one line"),
        Panel("Inner steps per outer step",
              (Target(f"max by (swarm) (hivekeeper_local_step * {identity('swarm', role='trainer')}) / "
                      f"clamp_min(max by (swarm) (hivekeeper_outer_step * {identity('swarm', role='trainer')}), 1)",
                      "{{swarm}}"),),
              description="DiLoCo: local optimizer steps between outer rounds (its H, higher when rounds fail)"),
    ),
)

OPERATOR = Dashboard(
    uid="hivekeeper-operator", title="hivekeeper / Operator", variables=("kind",),
    description="The operator's reconciles, errors and durations, by kind.",
    panels=(
        Panel("Reconciles/s", (Target('sum by (kind, result) (rate(hivekeeper_operator_reconciles_total{kind=~"$kind"}'
                                      '[$__rate_interval]))', "{{kind}} {{result}}"),), source="operator"),
        Panel("Errors by reason", (Target('sum by (kind, reason) (increase(hivekeeper_operator_reconcile_errors_total'
                                          '{kind=~"$kind"}[$__rate_interval]))', "{{kind}} {{reason}}"),),
              source="operator"),
        Panel("Reconcile duration p50 / p99", tuple(
            Target(f'histogram_quantile({q}, sum by (le, kind) (rate(hivekeeper_operator_reconcile_duration_seconds_bucket'
                   f'{{kind=~"$kind"}}[$__rate_interval])))', f"{{{{kind}}}} p{int(q * 100)}") for q in (0.5, 0.99)),
            unit="s", source="operator"),
        Panel("Child writes", (Target('sum by (child_kind, action) (increase(hivekeeper_operator_child_writes_total'
                                      '{kind=~"$kind"}[$__rate_interval]))', "{{child_kind}} {{action}}"),),
              source="operator"),
        Panel("Resources by phase", (Target('sum by (kind, phase) (hivekeeper_operator_resources{kind=~"$kind"})',
                                            "{{kind}} {{phase}}"),), source="operator"),
    ),
)

SERVERS = identity("swarm, peer", role="block-server")
BLOCKS_BACKBONE = identity("swarm", role="backbone-blocks")

BLOCK_SERVER = Dashboard(
    uid="hivekeeper-blockserver", title="hivekeeper / BlockServer",
    description="Petals-style serving: block coverage and throughput, each server's span, cache and load, "
                "and what clients see (latency, failovers).",
    panels=(
        Panel("Blocks served", (Target(f"max by (swarm) (hivekeeper_block_served_blocks * {BLOCKS_BACKBONE})",
                                       "{{swarm}}"),), kind="stat", source="blocks"),
        Panel("Worst block's throughput",
              (Target(f"max by (swarm) (hivekeeper_block_min_throughput_tokens_per_second * {BLOCKS_BACKBONE})",
                      "{{swarm}}"),), unit="short", kind="stat", source="blocks",
              description="tokens/s of the least-served block, online servers summed: the chain's bottleneck"),
        Panel("Servers per block", (Target(f"max by (block) (hivekeeper_block_servers * {BLOCKS_BACKBONE})",
                                           "block {{block}}"),), source="blocks"),
        Panel("Throughput per server", (Target(f"hivekeeper_block_throughput_tokens_per_second * {SERVERS}",
                                               "{{peer}}"),), source="blocks"),
        Panel("Spans", (Target(f"hivekeeper_block_span_start * {SERVERS}", "{{peer}} first"),
                        Target(f"hivekeeper_block_span_end * {SERVERS} - 1", "{{peer}} last")), source="blocks"),
        Panel("Attention cache left", (Target(f"hivekeeper_block_cache_tokens_left * {SERVERS}", "{{peer}}"),),
              source="blocks"),
        Panel("Open inference sessions", (Target(f"hivekeeper_block_sessions * {SERVERS}", "{{peer}}"),),
              source="blocks"),
        Panel("Requests/s", (Target(f"sum by (kind, outcome) (rate(hivekeeper_block_requests_total[$__rate_interval])"
                                    f" * {SERVERS})", "{{kind}} {{outcome}}"),), source="blocks"),
        Panel("Inference step latency (server compute)", tuple(
            Target(f'histogram_quantile({q}, sum by (le) (rate(hivekeeper_block_request_duration_seconds_bucket'
                   f'{{kind="inference"}}[$__rate_interval]) * {SERVERS}))', f"p{int(q * 100)}")
            for q in (0.5, 0.99)), unit="s", source="blocks"),
        Panel("Span moves and client failovers",
              (Target(f"sum(increase(hivekeeper_block_span_moves_total[$__rate_interval]) * {SERVERS})", "span moves"),
               Target(f"sum(increase(hivekeeper_client_failovers_total[$__rate_interval]) * "
                      f"{identity('swarm', role='block-client')})", "failovers")), source="blocks"),
    ),
)

EXPERT_SERVERS = identity("swarm, peer", role="expert-server")
EXPERT_TRAINERS = identity("swarm, peer", role="expert-trainer")

EXPERT_POOL = Dashboard(
    uid="hivekeeper-expertpool", title="hivekeeper / ExpertPool",
    description="Learning@home: which experts are up, how expert requests go, beam-search latency, "
                "and the trainers' progress.",
    panels=(
        Panel("Experts alive", (Target(f"max by (swarm) (hivekeeper_experts_alive * "
                                       f"{identity('swarm', role='backbone-experts')})", "{{swarm}}"),),
              kind="stat", source="experts"),
        Panel("Experts hosted per server", (Target(f"hivekeeper_experts_hosted * {EXPERT_SERVERS}", "{{peer}}"),),
              source="experts"),
        Panel("Expert requests/s by outcome",
              (Target(f"sum by (outcome) (rate(hivekeeper_dmoe_expert_requests_total[$__rate_interval]) * "
                      f"{EXPERT_TRAINERS})", "{{outcome}}"),), source="experts"),
        Panel("Expert request latency (replies)", tuple(
            Target(f'histogram_quantile({q}, sum by (le, call) (rate(hivekeeper_dmoe_expert_request_seconds_bucket'
                   f'{{outcome="ok"}}[$__rate_interval]) * {EXPERT_TRAINERS}))', f"{{{{call}}}} p{int(q * 100)}")
            for q in (0.5, 0.9)), unit="s", source="experts",
            description="from a trainer's request to an expert's reply (network, queue and compute), "
                        "by call: forward, backward"),
        Panel("Batches dropped (fewer than kMin replies)",
              (Target(f"sum(increase(hivekeeper_dmoe_failed_batches_total[$__rate_interval]) * {EXPERT_TRAINERS})",
                      "dropped"),), source="experts"),
        Panel("Beam-search latency", tuple(
            Target(f"histogram_quantile({q}, sum by (le) (rate(hivekeeper_dmoe_beam_search_seconds_bucket"
                   f"[$__rate_interval]) * {EXPERT_TRAINERS}))", f"p{int(q * 100)}") for q in (0.5, 0.99)),
            unit="s", source="experts"),
        Panel("Batches in flight", (Target(f"hivekeeper_dmoe_batches_in_flight * {EXPERT_TRAINERS}", "{{peer}}"),),
              source="experts"),
        Panel("Trainer samples/s", (Target(f"hivekeeper_samples_per_second * {EXPERT_TRAINERS}", "{{peer}}"),),
              source="experts"),
        Panel("Trainer loss and held-out metrics",
              (Target(f"hivekeeper_loss * {EXPERT_TRAINERS}", "{{peer}} loss"),
               Target(f"hivekeeper_eval_metric * {EXPERT_TRAINERS}", "{{peer}} {{metric}}")), source="experts"),
        Panel("Expert updates (backward requests applied)",
              (Target(f"sum by (expert) (hivekeeper_expert_updates * {EXPERT_SERVERS})", "{{expert}}"),),
              source="experts"),
    ),
)

DASHBOARDS: list[Dashboard] = [SWARM_OVERVIEW, AVERAGING, BLOCK_SERVER, EXPERT_POOL, OPERATOR]


def files() -> dict[str, str]:
    return {f"{d.uid}.json": json.dumps(render(d), indent=2) + "\n" for d in DASHBOARDS}


def write(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = files()
    for name, text in written.items():
        (out / name).write_text(text)
    return [out / name for name in written]


def expressions(substitutions: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(dashboard uid, panel title, source, expr with variables substituted) for every target."""
    out = []
    for dashboard in DASHBOARDS:
        for panel in dashboard.panels:
            for target in panel.targets:
                expr = target.expr
                for name, value in substitutions.items():
                    expr = expr.replace(f"${name}", value)
                out.append((dashboard.uid, panel.title, panel.source, expr))
    return out
