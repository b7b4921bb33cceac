"""Routing a client through the servers (Petals' sequence manager), as pure functions.

Inference: the lowest-latency chain, where a hop costs its measured round trip plus the
blocks' compute time (blocks / one-token steps/s), found by a shortest path over block
boundaries. Forward and backward of large batches: each part of the batch takes its own chain,
servers drawn in proportion to their throughput, so the load spreads over replicas."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from hivekeeper.blocks.protocol import ONLINE, ServerInfo

DEFAULT_RTT = 0.01  # seconds, for a server not pinged yet


class NoRouteError(RuntimeError):
    """Some block in the range is held by no usable server."""


@dataclass(frozen=True)
class Hop:
    peer_id: str
    start: int
    end: int  # exclusive; a hop may use part of a server's span


def _usable(servers: Sequence[ServerInfo], banned: Collection[str]) -> list[ServerInfo]:
    return sorted((s for s in servers if s.state == ONLINE and s.peer_id not in banned), key=lambda s: s.peer_id)


def _uncovered(servers: Sequence[ServerInfo], start: int, end: int) -> int:
    held = set()
    for s in servers:
        held.update(range(max(s.start, start), min(s.end, end)))
    return next(b for b in range(start, end) if b not in held)


def fastest_chain(servers: Sequence[ServerInfo], start: int, end: int, rtt: Mapping[str, float],
                  banned: Collection[str] = ()) -> list[Hop]:
    """The chain covering [start, end) with the least predicted latency per token."""
    usable = _usable(servers, banned)
    best: dict[int, tuple[float, int, ServerInfo | None]] = {start: (0.0, start, None)}
    for block in range(start, end):
        if block not in best:
            continue
        cost_here = best[block][0]
        for s in usable:
            if not s.start <= block < s.end:
                continue
            step = 1.0 / s.inference_rps if s.inference_rps > 0 else 1.0
            for stop in range(block + 1, min(s.end, end) + 1):
                cost = cost_here + rtt.get(s.peer_id, DEFAULT_RTT) + (stop - block) * step
                if cost < best.get(stop, (math.inf,))[0]:
                    best[stop] = (cost, block, s)
    if end not in best:
        raise NoRouteError(f"no online server holds block {_uncovered(usable, start, end)}")
    hops, stop = [], end
    while stop != start:
        _, begin, server = best[stop]
        hops.append(Hop(server.peer_id, begin, stop))
        stop = begin
    return hops[::-1]


def throughput_chain(servers: Sequence[ServerInfo], start: int, end: int, rng: random.Random,
                     banned: Collection[str] = ()) -> list[Hop]:
    """A chain for one part of a batch: at each boundary, a server holding the next block, drawn
    with probability proportional to its throughput; it serves as far as its span reaches."""
    usable = _usable(servers, banned)
    hops, block = [], start
    while block < end:
        candidates = [s for s in usable if s.start <= block < s.end]
        if not candidates:
            raise NoRouteError(f"no online server holds block {block}")
        weights = [max(s.throughput, 1e-9) for s in candidates]
        server = rng.choices(candidates, weights=weights)[0]
        stop = min(server.end, end)
        hops.append(Hop(server.peer_id, block, stop))
        block = stop
    return hops
