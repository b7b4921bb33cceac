"""The pool's backbone: a DHT peer with a stable identity that servers and trainers bootstrap
from. It also counts the live peers and the experts they announce."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from hivekeeper.experts.common import load_pool_context
from hivekeeper.experts.kind import BACKBONE, SERVER, TRAINER
from hivekeeper.runtime.backbone import run_backbone
from hivekeeper.runtime.reports import read_peer_reports

ROLES = (BACKBONE, SERVER, TRAINER)


def pool_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool's /status from the peers' reports: what the operator copies into the ExpertPool's
    status (its printer columns). Trainers share the experts but each counts its own batches: the
    step is the furthest trainer's (kept once the trainers are gone), the throughput the live
    trainers' sum."""
    trainers = [r for r in reports if r["role"] == TRAINER]
    figures: dict[str, Any] = {
        "peersAlive": dict(Counter(r["role"] for r in reports)),
        "expertsAlive": sum(len(r.get("experts") or ()) for r in reports if r["role"] == SERVER),
        "samplesPerSecond": round(sum(r.get("samplesPerSecond") or 0.0 for r in trainers), 2),
    }
    steps = [r["step"] for r in trainers if isinstance(r.get("step"), int)]
    if steps:
        figures["step"] = max(steps)
    return figures


def run(args: argparse.Namespace) -> int:
    ctx = load_pool_context(BACKBONE, args)

    def tick(dht) -> None:
        ctx.publish_report(dht, {})
        figures = pool_figures(read_peer_reports(dht, ctx.run_id))
        for role in ROLES:
            ctx.metrics.peers_alive.labels(role).set(figures["peersAlive"].get(role, 0))
        ctx.metrics.experts_alive.set(figures["expertsAlive"])
        ctx.status.update(figures)

    return run_backbone(ctx, tick)
