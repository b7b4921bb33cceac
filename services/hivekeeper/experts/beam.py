"""Top-k expert selection by beam search over DHT prefixes (Learning@home 3.2, appendix B), for a
whole batch at once.

A server announces expert PREFIX.u0.u1...u(d-1) under every prefix: key PREFIX.u0. holds subkey
u1 (and an example expert), ..., key PREFIX.u0...u(d-2). holds subkey u(d-1) with the expert
itself (hivemind's `declare_experts`). The search keeps each example's k best live prefixes,
one grid dimension at a time, scoring a prefix by the sum of its coordinates' gating scores.

hivemind's MoEBeamSearcher runs this per example, each with its own DHT requests (and its batch
variant passes `num_workers` as `cache_expiration`). Here each step asks the DHT once for the
union of the prefixes the batch needs: same result, a handful of requests a batch."""

from __future__ import annotations

import heapq
import logging
from typing import Any, Awaitable, Callable, Sequence

from hivemind.moe.expert_uid import ExpertInfo, is_valid_uid
from hivemind.p2p import PeerID

from hivekeeper.experts.grid import UID_DELIMITER

log = logging.getLogger("hivekeeper.experts.beam")
# prefixes -> {prefix: {next coordinate: an expert under prefix+coordinate}} (empty if none is announced)
Fetch = Callable[[list[str]], Awaitable[dict[str, dict[int, ExpertInfo]]]]


async def batch_beam_search(uid_prefix: str, grid_scores: Sequence[Sequence[Sequence[float]]], k: int,
                            fetch: Fetch) -> list[list[ExpertInfo]]:
    """Each example's (up to) k best announced experts, best first.

    `grid_scores[i][j]` are example i's gating scores for grid dimension j."""
    if not grid_scores:
        return []
    dims = len(grid_scores[0])
    root = uid_prefix + UID_DELIMITER
    first = len(grid_scores[0][0])
    # the first dimension's prefixes: few (M0), fetched once for the batch
    level = await fetch([f"{root}{c}{UID_DELIMITER}" for c in range(first)])
    beams: list[list[tuple[float, str]]] = []
    for scores in grid_scores:
        live = ((scores[0][c], f"{root}{c}{UID_DELIMITER}") for c in range(first))
        beams.append(heapq.nlargest(k, ((s, p) for s, p in live if level.get(p))))
    for dim in range(1, dims):
        candidates: list[list[tuple[float, str, ExpertInfo]]] = []
        for scores, beam in zip(grid_scores, beams):
            extended = []
            for score, prefix in beam:
                for coord, expert in level.get(prefix, {}).items():
                    if 0 <= coord < len(scores[dim]):
                        extended.append((score + scores[dim][coord], f"{prefix}{coord}", expert))
            candidates.append(heapq.nlargest(k, extended, key=lambda c: c[0]))
        if dim == dims - 1:
            return [[expert for _, name, expert in best if expert.uid == name] for best in candidates]
        wanted = sorted({name + UID_DELIMITER for best in candidates for _, name, _ in best})
        level = await fetch(wanted)
        beams = [[(s, name + UID_DELIMITER) for s, name, _ in best if level.get(name + UID_DELIMITER)]
                 for best in candidates]
    # a one-dimensional grid: the experts are PREFIX.u0 themselves (hivemind stores them under FLAT_EXPERT)
    return [[next(iter(level[prefix].values())) for _, prefix in beam] for beam in beams]


async def fetch_from_dht(node, prefixes: list[str]) -> dict[str, dict[int, ExpertInfo]]:
    """One DHT request for many prefixes (answered from the node's cache while entries are fresh)."""
    found = await node.get_many(prefixes, num_workers=max(1, min(len(prefixes), 16)))
    return {prefix: successors(found.get(prefix)) for prefix in prefixes}


def successors(entry: Any) -> dict[int, ExpertInfo]:
    """{coordinate: expert} of one prefix's DHT entry, as hivemind's `declare_experts` writes it
    (subkey coordinate, value (uid, peer id)). Items after those two are ignored (a newer writer
    may add some); an entry that does not parse is skipped and logged once at debug, so one bad
    record never fails a search. (hivemind's own reader raises on a malformed peer id.)"""
    value = getattr(entry, "value", None)
    found: dict[int, ExpertInfo] = {}
    for coord, match in value.items() if isinstance(value, dict) else ():
        record = getattr(match, "value", None)
        if record is None:  # hivemind's negative-caching marker: no such prefix
            continue
        try:
            if type(coord) is not int or not isinstance(record, (tuple, list)) or len(record) < 2 \
                    or not isinstance(record[0], str) or not is_valid_uid(record[0]) or not isinstance(record[1], str):
                raise ValueError("expected (uid, peer id)")
            found[coord] = ExpertInfo(uid=record[0], peer_id=PeerID.from_base58(record[1]))
        except Exception as e:  # base58 and multihash decoding raise their own errors
            _reject(f"{coord!r:.40}: {record!r:.80}: {e}")
    return found


_rejected: set[str] = set()


def _reject(reason: str) -> None:
    if reason not in _rejected and len(_rejected) < 1000:
        _rejected.add(reason)
        log.debug("ignoring an expert record", extra={"fields": {"reason": reason}})
