"""Petals block spans: the per-server greedy rule and a global max-min planner.

A swarm serves ``num_blocks`` transformer blocks; each server holds one contiguous span
and adds its throughput to every block of it. A chain through the swarm runs at the pace
of its weakest block, so the quantity to raise is the minimum block throughput.

Petals' own rule (``src/petals/server/block_selection.py``) is local: a joining server
takes the span whose blocks are worst off (`choose_best_start`), and online servers
periodically simulate a rebalance and move when it would raise the minimum enough
(`should_move`). A balancer that sees every server at once can do better: `plan_blocks`
bisects on the worst block's throughput with an exact branch-and-bound feasibility
search, then improves the rest of the sorted block throughputs by local search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_array

__all__ = [
    "BlockPlan",
    "ServedSpan",
    "Server",
    "Span",
    "block_throughput",
    "choose_best_start",
    "greedy_join",
    "plan_blocks",
    "should_move",
]

DEFAULT_BALANCE_QUALITY = 0.75  # Petals' server default
DEFAULT_NODE_LIMIT = 20_000  # search nodes per plan, all bisection probes together
_UNIT_SCALE = 2**40  # integer units per the largest throughput: exact sums, 1e-12 resolution


@dataclass(frozen=True)
class Server:
    name: str
    throughput: float
    span_length: int


@dataclass(frozen=True)
class Span:
    name: str
    start: int
    end: int  # exclusive


@dataclass(frozen=True)
class ServedSpan(Span):
    throughput: float


@dataclass(frozen=True)
class BlockPlan:
    assignments: tuple[Span, ...]
    block_throughput: tuple[float, ...]
    min_throughput: float
    upper_bound: float  # no placement has a higher minimum; equals min_throughput when optimal
    optimal: bool


# --- Petals' greedy rule -------------------------------------------------------------


def choose_best_start(throughputs: np.ndarray, length: int) -> int:
    """Start of the span (of `length` blocks) that is worst off.

    Petals' order: compare each window's block throughputs sorted ascending,
    lexicographically, so the span holding the weakest block wins, then the one whose
    next-weakest block is weakest, and so on; ties go to the lowest start.
    """
    windows = np.sort(np.lib.stride_tricks.sliding_window_view(throughputs, length), axis=1)
    return int(_lex_extreme(-windows)[0])


def greedy_join(num_blocks: int, servers: Sequence[Server]) -> list[Span]:
    """Servers join one by one in the given order, each taking `choose_best_start`."""
    throughputs = np.zeros(num_blocks)
    spans = []
    for server in servers:
        length = _clip(server.span_length, num_blocks)
        start = choose_best_start(throughputs, length)
        throughputs[start : start + length] += server.throughput
        spans.append(Span(server.name, start, start + length))
    return spans


def should_move(
    num_blocks: int,
    spans: Sequence[ServedSpan],
    local_name: str,
    balance_quality: float = DEFAULT_BALANCE_QUALITY,
) -> bool:
    """Whether the server `local_name` should leave its span and rejoin elsewhere.

    Petals' semantics: take the local server out, put it at its greedy best start, then
    let every server in turn re-choose greedily until none moves; move only if that
    raises the minimum block throughput so that old/new < balance_quality. Never move
    when leaving would uncover a block (the swarm would fall apart meanwhile).
    `balance_quality` > 1 forces a move, as in Petals.
    """
    if balance_quality > 1.0:
        return True
    names = [span.name for span in spans]
    if local_name not in names:
        raise ValueError(f"server {local_name!r} holds no span")
    # Integer units make "stay on ties" exact; Petals needs an epsilon for the same.
    units = _to_units(np.array([span.throughput for span in spans], dtype=float))
    lengths = np.array([span.end - span.start for span in spans], dtype=np.int64)
    starts = np.array([span.start for span in spans], dtype=np.int64)
    load = _load(num_blocks, starts, lengths, units)
    initial = load.min()

    local = names.index(local_name)
    start = starts[local]
    rest = load.copy()
    rest[start : start + lengths[local]] -= units[local]
    if initial > 0 and rest.min() <= 0:
        return False
    if _greedy_restart(load, starts, lengths, units, local) == start:
        return False
    _settle(load, starts, lengths, units)

    new = load.min()
    if new <= initial:
        return False
    return initial / new < balance_quality


# --- the global planner --------------------------------------------------------------


def plan_blocks(num_blocks: int, servers: Sequence[Server], node_limit: int = DEFAULT_NODE_LIMIT) -> BlockPlan:
    """One contiguous span per server maximizing the worst block's throughput, then the
    next worst, and so on (lexicographic max-min of the sorted block throughputs).

    1. Incumbents: Petals' greedy join in the given order and in order of decreasing
       throughput, each improved by local search (step 3). The plan is therefore never
       worse than the greedy rule.
    2. Bottleneck: bisection on the target minimum between the incumbent's and the
       linear-relaxation bound, each probe an exact branch-and-bound feasibility search
       (`_Sweep`). Probes that finish prove a target impossible; with the node limit
       they always finish on small swarms, so small plans are optimal. On large ones
       the search may stop early: `upper_bound` is then the best proven bound (at
       worst the linear one) and `optimal` is False.
    3. Refinement: each server in turn moves to the start that makes the whole sorted
       load vector lexicographically largest; a move is taken only on strict
       improvement, so the minimum never drops and the search terminates.

    Loads are compared in integer units (throughput scaled to 2**40 per the largest
    server), so sums are exact and the plan does not depend on summation order. Node
    limits (not time limits) keep the result deterministic.
    """
    _check(num_blocks, servers)
    lengths = np.array([_clip(server.span_length, num_blocks) for server in servers], dtype=np.int64)
    weights = np.array([server.throughput for server in servers], dtype=float)
    units = _to_units(weights)

    def rank(starts: np.ndarray) -> tuple[int, ...]:
        return tuple(np.sort(_load(num_blocks, starts, lengths, units)).tolist())

    greedy = np.array([span.start for span in greedy_join(num_blocks, servers)])
    by_speed = sorted(range(len(servers)), key=lambda i: (-weights[i], i))
    fast_first = _greedy_starts(num_blocks, lengths, units, by_speed)
    incumbent = max((_refine(num_blocks, c, lengths, units) for c in (greedy, fast_first)), key=rank)
    found, impossible = _bisect(num_blocks, lengths, units, incumbent, node_limit)
    starts = max((incumbent, _refine(num_blocks, found, lengths, units)), key=rank)

    load = block_throughput(num_blocks, servers, starts)
    optimal = rank(starts)[0] >= impossible - 1
    bound = float(load.min()) if optimal else (impossible - 1) * float(weights.max()) / _UNIT_SCALE
    return BlockPlan(
        assignments=tuple(Span(s.name, int(b), int(b + n)) for s, b, n in zip(servers, starts, lengths)),
        block_throughput=tuple(float(x) for x in load),
        min_throughput=float(load.min()),
        upper_bound=max(bound, float(load.min())),
        optimal=optimal,
    )


def block_throughput(num_blocks: int, servers: Sequence[Server], starts: Sequence[int]) -> np.ndarray:
    """Per-block total throughput when server i holds the span starting at starts[i]."""
    lengths = np.array([_clip(server.span_length, num_blocks) for server in servers], dtype=np.int64)
    weights = np.array([server.throughput for server in servers], dtype=float)
    return _load(num_blocks, np.asarray(starts, dtype=np.int64), lengths, weights)


# --- internals -----------------------------------------------------------------------


def _check(num_blocks: int, servers: Sequence[Server]) -> None:
    if num_blocks < 1:
        raise ValueError("num_blocks must be at least 1")
    if not servers:
        raise ValueError("at least one server is needed")
    for server in servers:
        if server.span_length < 1 or server.throughput < 0:
            raise ValueError(f"server {server.name!r}: span_length >= 1 and throughput >= 0 are required")


def _clip(length: int, num_blocks: int) -> int:
    return min(length, num_blocks)


def _to_units(weights: np.ndarray) -> np.ndarray:
    top = weights.max()
    if top <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    return np.rint(weights / top * _UNIT_SCALE).astype(np.int64)


def _load(num_blocks: int, starts: np.ndarray, lengths: np.ndarray, weights: np.ndarray) -> np.ndarray:
    # Difference array: +w at start, -w at end; summed in server order.
    diff = np.zeros(num_blocks + 1, dtype=weights.dtype)
    np.add.at(diff, starts, weights)
    np.add.at(diff, starts + lengths, -weights)
    return np.cumsum(diff[:-1])


def _lex_extreme(rows: np.ndarray) -> np.ndarray:
    """Indices of the lexicographically largest rows, ascending."""
    candidates = np.arange(len(rows))
    for column in rows.T:
        values = column[candidates]
        candidates = candidates[values == values.max()]
        if len(candidates) == 1:
            break
    return candidates


def _greedy_starts(num_blocks: int, lengths: np.ndarray, weights: np.ndarray, order: Sequence[int]) -> np.ndarray:
    load = np.zeros(num_blocks, dtype=weights.dtype)
    starts = np.zeros(len(lengths), dtype=np.int64)
    for i in order:
        starts[i] = choose_best_start(load, lengths[i])
        load[starts[i] : starts[i] + lengths[i]] += weights[i]
    return starts


def _greedy_restart(load: np.ndarray, starts: np.ndarray, lengths: np.ndarray, weights: np.ndarray, i: int) -> int:
    """Server i leaves and rejoins at its greedy best start; `load` and `starts` are
    updated in place. Staying wins ties (Petals: subtract its throughput times 1 + eps)."""
    start, length = starts[i], lengths[i]
    load[start : start + length] -= weights[i]
    windows = np.sort(np.lib.stride_tricks.sliding_window_view(load, length), axis=1)
    best = _lex_extreme(-windows)
    new = start if start in best else int(best[0])
    load[new : new + length] += weights[i]
    starts[i] = new
    return new


def _settle(load: np.ndarray, starts: np.ndarray, lengths: np.ndarray, weights: np.ndarray) -> None:
    """Every server re-chooses greedily, in index order, until none moves. Petals
    shuffles the order at random; a fixed order keeps the answer deterministic. The
    round cap guards against a cycle, which greedy moves do not rule out."""
    for _ in range(4 * len(starts) + 4):
        moved = False
        for i in range(len(starts)):
            before = starts[i]
            moved |= _greedy_restart(load, starts, lengths, weights, i) != before
        if not moved:
            return


def _refine(num_blocks: int, starts: np.ndarray, lengths: np.ndarray, units: np.ndarray) -> np.ndarray:
    """Lexicographic local search on the sorted load vector (see `plan_blocks`)."""
    starts = starts.astype(np.int64)
    load = _load(num_blocks, starts, lengths, units)
    blocks = np.arange(num_blocks)
    improved = True
    while improved:
        improved = False
        for i in range(len(starts)):
            length = lengths[i]
            load[starts[i] : starts[i] + length] -= units[i]
            options = np.arange(num_blocks - length + 1)
            inside = (blocks >= options[:, None]) & (blocks < options[:, None] + length)
            rows = np.sort(load + units[i] * inside, axis=1)
            best = _lex_extreme(rows)
            if starts[i] not in best:
                starts[i] = best[0]
                improved = True
            load[starts[i] : starts[i] + length] += units[i]
    return starts


def _lp_bound(num_blocks: int, lengths: np.ndarray, units: np.ndarray) -> float:
    """Upper bound on the best minimum (in units): the linear relaxation where a server
    may be split across starts. Identical servers share columns (fewer variables)."""
    classes: dict[tuple[int, int], int] = {}
    for key in zip(lengths.tolist(), units.tolist()):
        classes[key] = classes.get(key, 0) + 1
    keys = sorted(classes)
    scale = float(units.max()) or 1.0  # solve with throughputs in [0, 1] for conditioning

    rows, cols, vals, owner = [], [], [], []
    for k, (length, unit) in enumerate(keys):
        for start in range(num_blocks - length + 1):
            rows += range(start, start + length)
            cols += [len(owner)] * length
            vals += [-unit / scale] * length
            owner.append(k)
    t_col = len(owner)  # the bottleneck T is the last variable: T - load(b) <= 0
    rows += range(num_blocks)
    cols += [t_col] * num_blocks
    vals += [1.0] * num_blocks
    cover = coo_array((vals, (rows, cols)), shape=(num_blocks, t_col + 1))
    count = coo_array(([1.0] * t_col, (owner, range(t_col))), shape=(len(keys), t_col + 1))
    objective = np.zeros(t_col + 1)
    objective[t_col] = -1.0
    result = linprog(
        objective,
        A_ub=cover,
        b_ub=np.zeros(num_blocks),
        A_eq=count,
        b_eq=[classes[key] for key in keys],
        method="highs",
    )
    return -result.fun * scale * (1 + 1e-9)


class _OutOfNodes(Exception):
    pass


class _Sweep:
    """Decision search: is there a placement where every block's load is >= target?

    Exact by a shifting argument: in any feasible placement, a server whose first
    block would stay >= target without it can move one block right without harm. So
    some feasible placement has every server either *needed* at its first block or at
    its rightmost start. The search sweeps left to right and, at the leftmost block
    short of the target, branches on which unplaced server starts there (clamped to
    its rightmost start); servers placed at one block are chosen in a fixed order,
    and of identical servers only the first is tried. A node limit bounds the work.
    """

    def __init__(self, num_blocks: int, lengths: np.ndarray, units: np.ndarray):
        # Fixed order: most capacity first, so the first solutions found are good ones.
        self.order = sorted(range(len(units)), key=lambda i: (-int(units[i]) * int(lengths[i]), -int(units[i]), i))
        self.n = num_blocks
        self.lengths = [int(lengths[i]) for i in self.order]
        self.units = [int(units[i]) for i in self.order]
        kinds: dict[tuple[int, int], int] = {}
        self.kind = [kinds.setdefault(key, len(kinds)) for key in zip(self.lengths, self.units)]

    def solve(self, target: int, node_limit: int) -> tuple[np.ndarray | None, bool, int]:
        """(starts or None, whether the answer is proven, nodes used)."""
        self.target, self.node_limit, self.nodes = target, node_limit, 0
        self.load = [0] * self.n
        self.starts = [-1] * len(self.order)
        self.shortfall = target * self.n  # sum over blocks of max(0, target - load)
        try:
            found = self._search(0, 0)
        except _OutOfNodes:
            return None, False, self.nodes
        if not found:
            return None, True, self.nodes
        starts = np.zeros(len(self.order), dtype=np.int64)
        starts[self.order] = self.starts
        return starts, True, self.nodes

    def _search(self, block: int, first: int) -> bool:
        if self.load[block] >= self.target:
            while block < self.n and self.load[block] >= self.target:
                block += 1
            if block == self.n:
                return True
            first = 0  # a new block: any server may start here
        self.nodes += 1
        if self.nodes > self.node_limit:
            raise _OutOfNodes
        if not self._may_cover(block, first):
            return False
        tried = set()
        for k in range(first, len(self.order)):
            if self.starts[k] >= 0 or self.kind[k] in tried:
                continue
            tried.add(self.kind[k])
            start = min(block, self.n - self.lengths[k])
            self._add(k, start, +1)
            if self._search(block, k + 1):
                return True
            self._add(k, start, -1)
        return False

    def _may_cover(self, block: int, first: int) -> bool:
        """Cheap necessary conditions: enough throughput left for this block, and
        enough block-throughput area left for the total shortfall from here on."""
        reach = self.n - block
        free = [k for k, start in enumerate(self.starts) if start < 0]
        here = sum(self.units[k] for k in free if k >= first)
        area = sum(self.units[k] * min(self.lengths[k], reach) for k in free)
        return here >= self.target - self.load[block] and area >= self.shortfall

    def _add(self, k: int, start: int, sign: int) -> None:
        load, target, unit = self.load, self.target, self.units[k]
        for b in range(start, start + self.lengths[k]):
            before = max(0, target - load[b])
            load[b] += sign * unit
            self.shortfall += max(0, target - load[b]) - before
        self.starts[k] = start if sign > 0 else -1


def _bisect(
    num_blocks: int, lengths: np.ndarray, units: np.ndarray, best: np.ndarray, node_limit: int
) -> tuple[np.ndarray, int]:
    """Bisection on the bottleneck with `_Sweep` as the feasibility check, starting
    between the incumbent's minimum and the linear bound. Returns the best starts
    found and the smallest minimum (in units) known to be impossible."""
    low = int(_load(num_blocks, best, lengths, units).min())
    impossible = int(_lp_bound(num_blocks, lengths, units)) + 1
    high = impossible  # also narrowed by searches that ran out of nodes
    sweep = _Sweep(num_blocks, lengths, units)
    left = node_limit
    while high - low > 1 and left > 0:
        target = (low + high) // 2
        found, proven, used = sweep.solve(target, min(left, max(node_limit // 8, 1)))
        left -= used
        if found is not None:
            best, low = found, int(_load(num_blocks, found, lengths, units).min())
        else:
            high = target
            if proven:
                impossible = target
    return best, impossible
