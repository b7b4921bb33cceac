"""The pool's backbone: a DHT peer with a stable identity that servers and trainers bootstrap
from. It also counts the live peers and the experts they announce."""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from typing import Any

from hivekeeper.experts.common import load_pool_context
from hivekeeper.swarm.common import read_peer_reports, setup_logging

log = logging.getLogger("hivekeeper.experts.backbone")
ROLES = ("backbone-experts", "expert-server", "expert-trainer")


def pool_figures(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool's /status from the peers' reports: what the operator copies into the ExpertPool's
    status (its printer columns). Trainers share the experts but each counts its own batches: the
    step is the furthest trainer's (kept once the trainers are gone), the throughput the live
    trainers' sum."""
    trainers = [r for r in reports if r["role"] == "expert-trainer"]
    figures: dict[str, Any] = {
        "peersAlive": dict(Counter(r["role"] for r in reports)),
        "expertsAlive": sum(len(r.get("experts") or ()) for r in reports if r["role"] == "expert-server"),
        "samplesPerSecond": round(sum(r.get("samplesPerSecond") or 0.0 for r in trainers), 2),
    }
    steps = [r["step"] for r in trainers if isinstance(r.get("step"), int)]
    if steps:
        figures["step"] = max(steps)
    return figures


def run(args: argparse.Namespace) -> int:
    setup_logging("backbone-experts", args.index)
    ctx = load_pool_context("backbone-experts", args)
    ctx.start_endpoint()
    dht = ctx.make_dht()
    log.info("backbone up", extra={"fields": {"peer_id": str(dht.peer_id),
                                              "maddrs": [str(a) for a in dht.get_visible_maddrs()]}})
    ctx.endpoint.ready.set()
    try:
        while not ctx.stop.wait(2.0):
            ctx.publish_report(dht, {})
            figures = pool_figures(read_peer_reports(dht, ctx.run_id))
            for role in ROLES:
                ctx.metrics.peers_alive.labels(role).set(figures["peersAlive"].get(role, 0))
            ctx.metrics.experts_alive.set(figures["expertsAlive"])
            ctx.status.update(figures)
    finally:
        dht.shutdown()
    return 0
