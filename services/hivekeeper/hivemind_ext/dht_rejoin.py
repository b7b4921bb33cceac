"""Keeps every peer known to the swarm's bootstrap peers.

A hivemind DHT node adds a peer to its routing table when that peer contacts it, and a node
that restarts (a backbone killed and started again: same identity, same address, empty
tables) is contacted only by peers whose requests happen to route through it. After its
backbone restarted, the demo's restarted trainer bootstrapped from a backbone that knew nobody,
found no collaboration and trained alone from step 0 while the others went on without it. So
every peer pings its bootstrap peers every `REJOIN_SECONDS` (a few hundred bytes each): a
restarted one knows the swarm again within that time.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Sequence

from hivemind.p2p import PeerID

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)

log = logging.getLogger("hivekeeper.dht_rejoin")

REJOIN_SECONDS = 10.0
_pinging: list[asyncio.Task] = []  # in the DHT's process


def keep_bootstrap_peers(peer_ids: Sequence[str], period: float = REJOIN_SECONDS):
    """For `DHT.run_coroutine`: from now on, ping these peers every `period` seconds."""
    return partial(_start, peer_ids=tuple(peer_ids), period=period)


async def _start(_dht, node, peer_ids: tuple[str, ...], period: float) -> None:
    peers = [PeerID.from_base58(p) for p in peer_ids]
    peers = [p for p in peers if p != node.peer_id]
    if peers and not _pinging:
        _pinging.append(asyncio.create_task(_ping_forever(node, peers, period)))


async def _ping_forever(node, peers: list[PeerID], period: float) -> None:
    while True:
        await asyncio.sleep(period)
        for peer in peers:
            try:
                await node.protocol.call_ping(peer)
            except Exception as e:  # the DHT is going away, or the peer is down: try again later
                log.debug("ping of bootstrap peer %s failed: %r", peer, e)
