"""Backbone role: a DHT peer with a stable identity (its key file) that every other peer
bootstraps from. It trains nothing; it keeps the DHT reachable, counts who is alive, and answers the bandwidth
probes of joining peers."""

from __future__ import annotations

import argparse
import logging
from collections import Counter

from hivekeeper.swarm.bandwidth import serve_probes
from hivekeeper.swarm.common import load_role_context, read_peer_reports, setup_logging

log = logging.getLogger("hivekeeper.backbone")
ROLES = ("backbone", "trainer", "auxiliary", "monitor", "balancer")



def run(args: argparse.Namespace) -> int:
    setup_logging("backbone", args.index)
    ctx = load_role_context("backbone", args)
    ctx.start_endpoint()
    dht = ctx.make_dht()
    serve_probes(dht)  # joining peers measure their bandwidth against us
    log.info("backbone up", extra={"fields": {"peer_id": str(dht.peer_id),
                                              "maddrs": [str(a) for a in dht.get_visible_maddrs()]}})
    ctx.endpoint.ready.set()
    try:
        while not ctx.stop.wait(2.0):
            ctx.publish_report(dht, {})
            alive = Counter(report["role"] for report in read_peer_reports(dht, ctx.run_id))
            for role in ROLES:
                ctx.metrics.peers_alive.labels(role).set(alive.get(role, 0))
            ctx.status.update(peersAlive=dict(alive))
    finally:
        dht.shutdown()
    return 0
