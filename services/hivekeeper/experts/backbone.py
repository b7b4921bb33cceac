"""The pool's backbone: a DHT peer with a stable identity that servers and trainers bootstrap
from. It also counts the live peers and the experts they announce."""

from __future__ import annotations

import argparse
import logging
from collections import Counter

from hivekeeper.experts.common import load_pool_context
from hivekeeper.swarm.common import read_peer_reports, setup_logging

log = logging.getLogger("hivekeeper.experts.backbone")
ROLES = ("backbone-experts", "expert-server", "expert-trainer")


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
            reports = read_peer_reports(dht, ctx.run_id)
            alive = Counter(report["role"] for report in reports)
            experts = sum(len(r.get("experts") or ()) for r in reports if r["role"] == "expert-server")
            for role in ROLES:
                ctx.metrics.peers_alive.labels(role).set(alive.get(role, 0))
            ctx.metrics.experts_alive.set(experts)
            ctx.status.update(peersAlive=dict(alive), expertsAlive=experts)
    finally:
        dht.shutdown()
    return 0
