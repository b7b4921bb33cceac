"""Top-k expert selection by beam search over DHT prefixes (Learning@home 3.2, appendix B), for a
whole batch at once.

A server announces expert PREFIX.u0.u1...u(d-1) under every prefix: key PREFIX.u0. holds subkey
u1 (and an example expert), ..., key PREFIX.u0...u(d-2). holds subkey u(d-1) with the expert
itself (hivemind's `declare_experts`). The search keeps each example's k best live prefixes,
one grid dimension at a time, scoring a prefix by the sum of its coordinates' gating scores.

hivemind's MoEBeamSearcher runs this per example, each with its own DHT requests (and its batch
variant passes `num_workers` as `cache_expiration`). Here each step asks the DHT once for the
union of the prefixes the batch needs: same result, a handful of requests a batch. A step scores
the whole batch at once (numpy: each beam prefix's announced coordinates in one padded table),
with the order a sequential search over Python tuples gives, ties included.

Where a warm search's time goes is decoding, not the DHT (every prefix comes from the node's
cache): hivemind's get deserializes each cached prefix's subkeys anew (a msgpack dumps and loads
per subkey), and parsing a record's peer id (`PeerID.from_base58` re-encodes base58) costs more
still. So `fetch_from_dht` reads prefixes that are fresh in the node's storage or cache
directly, as hivemind's get would (expired subkeys dropped, the cache refresh scheduled), and
decodes each record's bytes once; only the others go through the DHT, one lookup per prefix
shared by concurrent searches."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Awaitable, Callable, Sequence

import numpy as np
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator
from hivemind.moe.expert_uid import ExpertInfo, is_valid_uid
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer, get_dht_time

from hivekeeper.experts.grid import UID_DELIMITER

log = logging.getLogger("hivekeeper.experts.beam")
# prefixes -> {prefix: {next coordinate: an expert under prefix+coordinate}} (empty if none is announced)
Fetch = Callable[[list[str]], Awaitable[dict[str, dict[int, ExpertInfo]]]]


async def batch_beam_search(uid_prefix: str, grid_scores: Sequence[Sequence[Sequence[float]]], k: int,
                            fetch: Fetch) -> list[list[ExpertInfo]]:
    """Each example's (up to) k best announced experts, best first.

    `grid_scores[i][j]` are example i's gating scores for grid dimension j."""
    if not len(grid_scores):
        return []
    dims = len(grid_scores[0])
    return await beam_search(uid_prefix, [np.array([example[d] for example in grid_scores], dtype=np.float64)
                                          for d in range(dims)], k, fetch)


async def beam_search(uid_prefix: str, scores: Sequence[np.ndarray], k: int, fetch: Fetch) -> list[list[ExpertInfo]]:
    """`batch_beam_search` with the scores by dimension: `scores[j]` is [batch, size of dimension j].

    The order is that of a search over (score, prefix) tuples: a first-dimension prefix's score is
    its gating score, equal scores ranked by the greater prefix string; after that a candidate's
    score is its prefix's plus its coordinate's, equal scores ranked in beam order, then in the
    order the DHT entry lists its subkeys. Scores add left to right in float64."""
    scores = [np.asarray(s, dtype=np.float64) for s in scores]
    batch = scores[0].shape[0]
    if batch == 0:
        return []
    k = max(0, k)
    root = uid_prefix + UID_DELIMITER
    first = scores[0].shape[1]
    prefixes = [f"{root}{c}{UID_DELIMITER}" for c in range(first)]
    level = await fetch(prefixes)
    live = np.array([c for c in range(first) if level.get(prefixes[c])], dtype=np.intp)
    by_name = np.empty(len(live), dtype=np.intp)
    by_name[sorted(range(len(live)), key=lambda i: prefixes[live[i]])] = np.arange(len(live))
    first_scores = scores[0][:, live]
    order = np.lexsort((np.broadcast_to(-by_name, first_scores.shape), -first_scores), axis=-1)[:, :k]
    beam_ids = live[order]  # [batch, width]: indices into `prefixes`
    beam_scores = np.take_along_axis(first_scores, order, axis=1)
    if len(scores) == 1:  # the experts are PREFIX.u0 themselves (hivemind stores them under FLAT_EXPERT)
        return [[next(iter(level[prefixes[p]].values())) for p in row] for row in beam_ids.tolist()]
    for dim in range(1, len(scores)):
        best = _extend(prefixes, level, beam_ids, beam_scores, scores[dim], k)
        if dim == len(scores) - 1:
            return [[expert for _, name, expert in row if expert.uid == name] for row in best]
        wanted = sorted({name + UID_DELIMITER for row in best for _, name, _ in row})
        level = await fetch(wanted) if wanted else {}
        index = {prefix: i for i, prefix in enumerate(wanted)}
        rows = [[(score, index[name + UID_DELIMITER]) for score, name, _ in row if level.get(name + UID_DELIMITER)]
                for row in best]
        width = max(map(len, rows), default=0)
        beam_ids = np.full((batch, width), -1, dtype=np.intp)
        beam_scores = np.zeros((batch, width))
        for i, row in enumerate(rows):
            if row:
                beam_scores[i, :len(row)], beam_ids[i, :len(row)] = zip(*row)
        prefixes = wanted
    raise AssertionError("unreachable")


def _extend(prefixes: list[str], level: dict[str, dict[int, ExpertInfo]], beam_ids: np.ndarray,
            beam_scores: np.ndarray, scores: np.ndarray, k: int) -> list[list[tuple[float, str, ExpertInfo]]]:
    """Each example's k best (score, name, expert) one coordinate below its beam's prefixes."""
    batch, size = scores.shape
    used = np.unique(beam_ids[beam_ids >= 0])
    table_row = np.full(len(prefixes), len(used), dtype=np.intp)  # row len(used): no candidates (padding)
    table_row[used] = np.arange(len(used))
    announced = [[(c, e) for c, e in level.get(prefixes[p], {}).items() if 0 <= c < size] for p in used.tolist()]
    columns = max(1, max(map(len, announced), default=0))
    coords = np.zeros((len(used) + 1, columns), dtype=np.intp)
    valid = np.zeros((len(used) + 1, columns), dtype=bool)
    for row, entries in enumerate(announced):
        if entries:
            coords[row, :len(entries)] = [c for c, _ in entries]
            valid[row, :len(entries)] = True
    rows = table_row[np.maximum(beam_ids, 0)]
    rows[beam_ids < 0] = len(used)
    candidate_coords = coords[rows]  # [batch, width, columns]
    candidate_valid = valid[rows].reshape(batch, -1)
    candidates = (beam_scores[:, :, None] + np.take_along_axis(
        scores, candidate_coords.reshape(batch, -1), axis=1).reshape(candidate_coords.shape)).reshape(batch, -1)
    # stable sort by descending score; padding sorts among real candidates only where they are -inf
    # and is dropped after sorting, which leaves the real candidates in the order they would have alone
    order = np.argsort(-np.where(candidate_valid, candidates, -np.inf), axis=1, kind="stable")
    sorted_valid = np.take_along_axis(candidate_valid, order, axis=1)
    keep = sorted_valid & (np.cumsum(sorted_valid, axis=1) <= k)
    best = []
    for i in range(batch):
        chosen = []
        for position in order[i][keep[i]].tolist():
            slot, column = divmod(position, columns)
            row = int(rows[i, slot])
            coord, expert = announced[row][column]
            chosen.append((float(candidates[i, position]), f"{prefixes[beam_ids[i, slot]]}{coord}", expert))
        best.append(chosen)
    return best


# ---------------------------------------------------------------------------------------------
# Reading the prefixes from the DHT node (in the DHT process)

_DECODED: dict[bytes, ExpertInfo | None] = {}  # a record's value bytes -> its expert (None: skipped)
_DECODED_MAX = 1 << 16
_INFLIGHT: dict[str, asyncio.Future] = {}  # prefix -> the DHT lookup under way for it


def clear_decoded() -> None:
    """Forget every decoded record (benchmarks: a cold search decodes everything again)."""
    _DECODED.clear()
    _peer_id.cache_clear()
    _key_id.cache_clear()


async def fetch_from_dht(node, prefixes: list[str]) -> dict[str, dict[int, ExpertInfo]]:
    """The prefixes' entries: those fresh in the node's storage or cache read from there, as
    hivemind's get would (storage first; subkeys past their expiration dropped; a cache entry read
    is scheduled for refresh before it expires), the rest in one DHT request, which caches them."""
    protocol = node.protocol
    local = _reads_verbatim(protocol.record_validator)
    found: dict[str, dict[int, ExpertInfo]] = {}
    missing = []
    for prefix in prefixes:
        entry = None
        if local:
            key_id = _key_id(prefix)
            now = get_dht_time()
            for storage in (protocol.storage, protocol.cache):
                candidate = storage.get(key_id)
                if candidate is not None and candidate.expiration_time >= now:
                    entry = candidate
                    break
        if entry is None:
            missing.append(prefix)
            continue
        refresh_before = getattr(node, "cache_refresh_before_expiry", 0)
        if refresh_before and hasattr(node, "_schedule_for_refresh") and key_id in protocol.cache:
            node._schedule_for_refresh(key_id, entry.expiration_time - refresh_before)
        found[prefix] = _decode(entry.value) if isinstance(entry.value, DictionaryDHTValue) else {}
    if missing:
        looked_up = await _lookup(node, missing)
        for prefix in missing:
            found[prefix] = successors(looked_up.get(prefix))
    return {prefix: found[prefix] for prefix in prefixes}


async def _lookup(node, prefixes: list[str]) -> dict[str, Any]:
    """node.get_many for the prefixes; a prefix another search is already looking up waits for that lookup."""
    loop = asyncio.get_running_loop()
    new = [prefix for prefix in prefixes if prefix not in _INFLIGHT or _INFLIGHT[prefix].get_loop() is not loop]
    if new:
        task = asyncio.ensure_future(node.get_many(new, num_workers=max(1, min(len(new), 16))))
        for prefix in new:
            _INFLIGHT[prefix] = task

        def done(_, new=new, task=task):
            for prefix in new:
                if _INFLIGHT.get(prefix) is task:
                    del _INFLIGHT[prefix]
        task.add_done_callback(done)
    waiting = {prefix: _INFLIGHT[prefix] for prefix in prefixes}
    results: dict[str, Any] = {}
    for task in {id(t): t for t in waiting.values()}.values():
        answer = await asyncio.shield(task)  # a cancelled search leaves the others' lookup running
        results.update({prefix: answer.get(prefix) for prefix, t in waiting.items() if t is task})
    return results


def _reads_verbatim(validator) -> bool:
    """Whether stored values are what hivemind's get returns (no validator strips anything from them)."""
    return validator is None or (type(validator) is CompositeValidator and not validator._validators)


@functools.lru_cache(maxsize=4096)
def _key_id(prefix: str) -> DHTID:
    return DHTID.generate(prefix)


@functools.lru_cache(maxsize=4096)
def _peer_id(base58: str) -> PeerID:
    return PeerID.from_base58(base58)  # decodes, then encodes base58 again: slow, and a handful of peers


def _decode(dictionary: DictionaryDHTValue) -> dict[int, ExpertInfo]:
    """{coordinate: expert} of a stored prefix entry, each record's bytes parsed once."""
    found: dict[int, ExpertInfo] = {}
    for coord, (value_bytes, _) in dictionary.items():
        expert = _DECODED.get(value_bytes, _decode)
        if expert is _decode:
            try:
                expert = _expert(MSGPackSerializer.loads(value_bytes), coord)
            except Exception as e:
                _reject(f"{coord!r:.40}: {value_bytes!r:.80}: {e}")
                expert = None
            if type(coord) is int:  # the expert does not depend on the coordinate, the check does
                if len(_DECODED) >= _DECODED_MAX:
                    _DECODED.clear()
                _DECODED[value_bytes] = expert
        elif expert is not None and type(coord) is not int:
            _reject(f"{coord!r:.40}: expected an integer coordinate")
            expert = None
        if expert is not None:
            found[coord] = expert
    return found


def _expert(record: Any, coord: Any) -> ExpertInfo | None:
    """The expert of one subkey's record; None for hivemind's negative-caching marker; raises if malformed."""
    if record is None:
        return None
    if type(coord) is not int or not isinstance(record, (tuple, list)) or len(record) < 2 \
            or not isinstance(record[0], str) or not is_valid_uid(record[0]) or not isinstance(record[1], str):
        raise ValueError("expected (uid, peer id)")
    return ExpertInfo(uid=record[0], peer_id=_peer_id(record[1]))


def successors(entry: Any) -> dict[int, ExpertInfo]:
    """{coordinate: expert} of one prefix's DHT entry, as hivemind's `declare_experts` writes it
    (subkey coordinate, value (uid, peer id)). Items after those two are ignored (a newer writer
    may add some); an entry that does not parse is skipped and logged once at debug, so one bad
    record never fails a search. (hivemind's own reader raises on a malformed peer id.)"""
    value = getattr(entry, "value", None)
    found: dict[int, ExpertInfo] = {}
    for coord, match in value.items() if isinstance(value, dict) else ():
        try:
            expert = _expert(getattr(match, "value", None), coord)
        except Exception as e:  # base58 and multihash decoding raise their own errors
            _reject(f"{coord!r:.40}: {getattr(match, 'value', None)!r:.80}: {e}")
            continue
        if expert is not None:
            found[coord] = expert
    return found


_rejected: set[str] = set()


def _reject(reason: str) -> None:
    if reason not in _rejected and len(_rejected) < 1000:
        _rejected.add(reason)
        log.debug("ignoring an expert record", extra={"fields": {"reason": reason}})
