"""Which span a server takes (Petals' block_selection), as pure functions of what the DHT says:
a joining server takes the span whose blocks are worst off; an online one moves when that
lifts the worst block enough; a balancer's plan, when there is one, overrides both."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from hivekeeper.blocks.protocol import JOINING, ONLINE, ServerInfo
from hivekeeper.planning.blocks import ServedSpan, choose_best_start, should_move


def block_loads(servers: Sequence[ServerInfo], num_blocks: int, exclude: str = "") -> np.ndarray:
    """Total throughput per block of the online and joining servers (but `exclude`)."""
    load = np.zeros(num_blocks)
    for s in servers:
        if s.peer_id != exclude and s.state in (ONLINE, JOINING) and s.end <= num_blocks:
            load[s.start : s.end] += s.throughput
    return load


def choose_start(servers: Sequence[ServerInfo], num_blocks: int, length: int, me: str) -> int:
    """A joining server's start. Servers joining at the same moment see each other as joining:
    each counts only those with a smaller peer ID, so repeated choices settle (the smallest never
    changes its mind, the next adapts to it, and so on)."""
    placed = [s for s in servers if s.state == ONLINE or (s.state == JOINING and s.peer_id < me)]
    return choose_best_start(block_loads(placed, num_blocks, exclude=me), length)


def wants_to_move(servers: Sequence[ServerInfo], num_blocks: int, me: str, balance_quality: float) -> bool:
    """Petals' periodic check for an online server (planning.blocks.should_move)."""
    online = [ServedSpan(s.peer_id, s.start, s.end, s.throughput) for s in servers
              if s.state == ONLINE and s.end <= num_blocks]
    if me not in {s.name for s in online}:
        return False
    return should_move(num_blocks, online, me, balance_quality)


def planned_span(plan: Optional[dict[str, Any]], me: str, num_blocks: int) -> Optional[tuple[int, int]]:
    """The span the balancer's plan gives this server, if it names it and the span is valid."""
    if not plan:
        return None
    span = plan["assignments"].get(me)
    if (isinstance(span, list) and len(span) == 2 and all(isinstance(x, int) for x in span)
            and 0 <= span[0] < span[1] <= num_blocks):
        return span[0], span[1]
    return None


def coverage(servers: Sequence[ServerInfo], num_blocks: int) -> tuple[int, float]:
    """(blocks held by an online server, the worst block's online throughput)."""
    online = [s for s in servers if s.state == ONLINE]
    load = block_loads(online, num_blocks)
    held = np.zeros(num_blocks, dtype=bool)
    for s in online:
        held[s.start : min(s.end, num_blocks)] = True
    return int(held.sum()), float(load.min()) if num_blocks else 0.0


def servers_per_block(servers: Sequence[ServerInfo], num_blocks: int) -> list[int]:
    """How many online servers hold each block (0: a gap no chain can cross)."""
    counts = [0] * num_blocks
    for s in servers:
        if s.state == ONLINE:
            for block in range(max(0, s.start), min(s.end, num_blocks)):
                counts[block] += 1
    return counts
