"""Block balancer role: reads the online servers from the DHT, computes the span assignment
that maximizes the worst block's throughput (`planning.blocks.plan_blocks`), and publishes it
when it beats the current placement by the balance-quality threshold; servers follow it."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

import numpy as np

from hivekeeper.blocks import protocol
from hivekeeper.blocks.backbone import coverage_figures
from hivekeeper.blocks.checkpoint import num_blocks
from hivekeeper.blocks.protocol import ServerInfo
from hivekeeper.blocks.role import load_block_context
from hivekeeper.blocks.selection import block_loads, coverage
from hivekeeper.planning.blocks import Server, plan_blocks

log = logging.getLogger("hivekeeper.blocks.balancer")


def proposal(servers: list[ServerInfo], blocks: int, balance_quality: float) -> Optional[dict[str, tuple[int, int]]]:
    """The plan's assignments if moving is worth it: the planned worst block beats the current
    one so that current/planned < balance_quality (an uncovered block always is)."""
    online = [s for s in servers if s.state == protocol.ONLINE]
    if not online:
        return None
    plan = plan_blocks(blocks, [Server(s.peer_id, s.throughput, s.end - s.start) for s in online])
    current = float(block_loads(online, blocks).min())
    if plan.min_throughput <= 0 or current / plan.min_throughput >= balance_quality:
        return None
    return {span.name: (span.start, span.end) for span in plan.assignments}


def run(args: argparse.Namespace) -> int:
    ctx = load_block_context("block-balancer", args)
    spec = ctx.manifest.spec
    blocks = num_blocks(spec.model)
    ctx.start_endpoint()
    dht = ctx.make_dht(client_mode=True)
    ctx.endpoint.ready.set()
    try:
        while not ctx.stop.wait(spec.balancer.replan_seconds):
            servers = protocol.read_servers(dht, ctx.run_id)
            held, worst = coverage(servers, blocks)
            ctx.metrics.served_blocks.set(held)
            ctx.metrics.min_block_throughput.set(worst)
            assignments = proposal(servers, blocks, spec.servers.balance_quality)
            if assignments is not None:
                online = [s for s in servers if s.state == protocol.ONLINE]
                planned = np.zeros(blocks)
                by_peer = {s.peer_id: s for s in online}
                for peer, (start, end) in assignments.items():
                    planned[start:end] += by_peer[peer].throughput
                protocol.publish_plan(dht, ctx.run_id, assignments, float(planned.min()),
                                      ttl=3 * spec.balancer.replan_seconds)
                ctx.metrics.plans.inc()
                log.info("published a span plan", extra={"fields": {
                    "current_min": worst, "planned_min": float(planned.min()),
                    "assignments": {by_peer[p].name: list(span) for p, span in assignments.items()}}})
            ctx.status.update(coverage_figures(blocks, held, worst))
    finally:
        dht.shutdown()
    return 0
