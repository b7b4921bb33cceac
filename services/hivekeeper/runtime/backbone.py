"""The one backbone lifecycle every kind shares: a DHT peer with a stable identity (its key
file) that every other peer bootstraps from. It computes nothing; every couple of seconds the
kind's `tick` sums up what the DHT shows (peers alive, blocks covered, experts announced) into
metrics and /status."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from hivekeeper.runtime.context import RoleContext

log = logging.getLogger("hivekeeper.backbone")
TICK_SECONDS = 2.0


def run_backbone(ctx: RoleContext, tick: Callable[[Any], None],
                 on_start: Optional[Callable[[Any], None]] = None) -> int:
    """Run until stopped: `on_start(dht)` once the DHT is up (a Swarm's backbone answers the
    bandwidth probes of joining peers), then `tick(dht)` every TICK_SECONDS."""
    ctx.start_endpoint()
    dht = ctx.make_dht()
    if on_start is not None:
        on_start(dht)
    log.info("backbone up", extra={"fields": {"peer_id": str(dht.peer_id),
                                              "maddrs": [str(a) for a in dht.get_visible_maddrs()]}})
    assert ctx.endpoint is not None
    ctx.endpoint.ready.set()
    try:
        while not ctx.stop.wait(TICK_SECONDS):
            tick(dht)
    finally:
        dht.shutdown()
    return 0
