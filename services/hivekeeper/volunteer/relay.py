"""Relay role: the swarm's door for volunteers. A DHT peer with a stable identity and a public
address that serves as a libp2p circuit relay (v2) for peers behind NAT, as their DHT entry
point, and as the checker of the dial-back reachability test `hivekeeper join` runs. It trains
nothing; like a backbone it reports who is alive and answers bandwidth probes."""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from typing import Any

from hivekeeper.runtime.bandwidth import serve_probes
from hivekeeper.runtime.lifecycle import load_context
from hivekeeper.runtime.reports import read_peer_reports
from hivekeeper.volunteer.metrics import RelayMetrics
from hivekeeper.volunteer.reachability import ReachabilityService

log = logging.getLogger("hivekeeper.relay")
_service: ReachabilityService | None = None  # in the DHT's process


async def _serve_checks(_dht, node) -> None:
    global _service
    _service = ReachabilityService()
    await _service.serve(node.p2p)


async def _stop_checks(_dht, node) -> None:
    if _service is not None:
        await _service.close()


async def _snapshot(_dht, node) -> dict[str, Any]:
    """Runs in the DHT's process: open connections and the checks answered so far."""
    peers = await node.p2p.list_peers()  # one entry per connection, with its remote address
    # p2pd does not list the circuits it relays (both ends are direct connections here)
    return {"peers": len({p.peer_id for p in peers}), "checks": dict(_service.outcomes) if _service else {}}


def run(args: argparse.Namespace) -> int:
    ctx = load_context("relay", args, None, RelayMetrics())  # any kind: a relay does not care what peers compute
    metrics: RelayMetrics = ctx.metrics
    ctx.start_endpoint()
    # relay service on (the default); AutoNAT cannot vouch for private or NATed cluster addresses
    # and the relay service starts only on a public node, so the relay declares itself public
    dht = ctx.make_dht(use_relay=True, force_reachability="public")
    dht.run_coroutine(_serve_checks)
    serve_probes(dht)  # volunteers bootstrap from us: their bandwidth probe at join comes here
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    log.info("relay up", extra={"fields": {"peer_id": str(dht.peer_id), "maddrs": maddrs}})
    ctx.endpoint.ready.set()
    seen: set[str] = {"relay"}
    counted: Counter = Counter()  # checks already added to the metric (the DHT process keeps totals)
    try:
        while not ctx.stop.wait(2.0):
            snapshot = dht.run_coroutine(_snapshot)
            metrics.connected_peers.set(snapshot["peers"])
            for outcome, count in snapshot["checks"].items():
                metrics.reachability_checks.labels(outcome).inc(count - counted[outcome])
                counted[outcome] = count
            alive = Counter(report["role"] for report in read_peer_reports(dht, ctx.run_id))
            seen.update(alive)
            for role in seen:  # a role gone silent drops to 0, not out of the metric
                metrics.peers_alive.labels(role).set(alive.get(role, 0))
            ctx.status.update(peersAlive=dict(alive), connectedPeers=snapshot["peers"],
                              reachabilityChecks=snapshot["checks"], maddrs=maddrs)
            ctx.publish_report(dht, {"connectedPeers": snapshot["peers"], "maddrs": maddrs})
    finally:
        dht.run_coroutine(_stop_checks)
        dht.shutdown()
    return 0
