"""BlockServer backbone role: a DHT peer with a stable identity that servers and clients
bootstrap from. It serves no blocks; it reports which blocks the online servers cover."""

from __future__ import annotations

import argparse
from typing import Any

from hivekeeper.blocks import protocol
from hivekeeper.blocks.checkpoint import num_blocks
from hivekeeper.blocks.kind import BACKBONE
from hivekeeper.blocks.role import load_block_context
from hivekeeper.blocks.selection import coverage, servers_per_block
from hivekeeper.runtime.backbone import run_backbone


def coverage_figures(blocks: int, held: int, worst: float) -> dict[str, Any]:
    """The coverage part of /status (backbone and balancer), as the BlockServer status model has
    it: the operator copies it into the resource's status (its Blocks and Throughput columns)."""
    return {"numBlocks": blocks, "servedBlocks": f"{held}/{blocks}", "minBlockThroughput": worst}


def run(args: argparse.Namespace) -> int:
    ctx = load_block_context(BACKBONE, args)
    blocks = num_blocks(ctx.spec.model)

    def tick(dht) -> None:
        servers = protocol.read_servers(dht, ctx.run_id)
        held, worst = coverage(servers, blocks)
        for block, count in enumerate(servers_per_block(servers, blocks)):
            ctx.metrics.block_servers.labels(str(block)).set(count)
        ctx.metrics.served_blocks.set(held)
        ctx.metrics.min_block_throughput.set(worst)
        ctx.status.update(coverage_figures(blocks, held, worst),
                          spans={s.name: f"{s.start}-{s.end - 1}" for s in servers if s.state == protocol.ONLINE})

    return run_backbone(ctx, tick)
