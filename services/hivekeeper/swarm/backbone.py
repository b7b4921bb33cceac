"""The Swarm's backbone: the shared backbone lifecycle, counting who is alive (and the swarm's
step, rate and parties: what a joining lab's status shows, having no monitor) and answering the
bandwidth probes of joining peers (the averaging plan needs every peer's rates)."""

from __future__ import annotations

import argparse
from collections import Counter

from hivekeeper.runtime.backbone import run_backbone
from hivekeeper.runtime.bandwidth import serve_probes
from hivekeeper.runtime.reports import read_peer_reports
from hivekeeper.swarm.parties import export_parties, parties_of, swarm_figures
from hivekeeper.swarm.role import load_swarm_context

ROLES = ("backbone", "trainer", "auxiliary", "monitor", "balancer")


def run(args: argparse.Namespace) -> int:
    ctx = load_swarm_context("backbone", args)

    def tick(dht) -> None:
        ctx.publish_report(dht, {})
        reports = read_peer_reports(dht, ctx.run_id)
        alive = Counter(report["role"] for report in reports)
        for role in ROLES:
            ctx.metrics.peers_alive.labels(role).set(alive.get(role, 0))
        export_parties(ctx.metrics, parties_of(reports, ctx.run_id))
        ctx.status.update(peersAlive=dict(alive), **swarm_figures(reports, ctx.run_id))

    return run_backbone(ctx, tick, on_start=serve_probes)
