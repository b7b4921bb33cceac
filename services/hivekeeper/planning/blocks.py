"""Petals block spans: the per-server greedy rule and a global max-min planner.

A swarm serves ``num_blocks`` transformer blocks; each server holds one contiguous span
and adds its throughput to every block of it. A chain through the swarm runs at the pace
of its weakest block, so the quantity to raise is the minimum block throughput.

Petals' own rule (``src/petals/server/block_selection.py``) is local: a joining server
takes the span whose blocks are worst off (`choose_best_start`), and online servers
periodically simulate a rebalance and move when it would raise the minimum enough
(`should_move`). A balancer that sees every server at once can do better: `plan_blocks`
searches on the worst block's throughput, certifies the result against an upper bound,
and then raises the rest of the sorted block throughputs.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import csc_array

__all__ = ["BlockPlan", "ServedSpan", "Server", "Span", "block_throughput", "choose_best_start", "greedy_join",
           "plan_blocks", "rebalance", "should_move"]

DEFAULT_BALANCE_QUALITY = 0.75  # Petals' server default
DEFAULT_ITERATIONS = 40_000  # annealing moves per plan
DEFAULT_NODE_LIMIT = 20_000  # exact-search nodes per plan, all probes together
_TEMPERATURE = 0.03  # starting annealing temperature, per largest server throughput
_PATIENCE = 0.05  # fraction of the annealing moves a target may resist before it is lowered
_EXACT_MAX_SERVERS = 8  # beyond this the exact search rarely completes within the node limit
_MIN_STEP = 1e-4  # smallest relative raise annealing aims for
_SWAP, _RELOCATE = 0.3, 0.3  # annealing move mix; the rest shift a span by 1-2 blocks
_DISCREPANCIES = (0, 1, 2, 1 << 30)  # limited discrepancy passes of the exact search; the last is unlimited
_LP_TOLERANCE = 1e-7  # relative; HiGHS solves to about this accuracy
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
    return int(_worst_windows(throughputs, length)[0])


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


def should_move(num_blocks: int, spans: Sequence[ServedSpan], local_name: str,
                balance_quality: float = DEFAULT_BALANCE_QUALITY) -> bool:
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
    return new > initial and initial / new < balance_quality


def rebalance(num_blocks: int, spans: Sequence[ServedSpan],
              balance_quality: float = DEFAULT_BALANCE_QUALITY) -> list[ServedSpan]:
    """Petals' swarm over time: each server in turn checks `should_move` and, if told
    to, rejoins at its greedy best start; until a round moves nobody (or a round cap)."""
    spans = list(spans)
    for _ in range(2 * len(spans) + 2):
        moved = False
        for k, span in enumerate(spans):
            if should_move(num_blocks, spans, span.name, balance_quality):
                others = np.zeros(num_blocks)
                for other in spans[:k] + spans[k + 1 :]:
                    others[other.start : other.end] += other.throughput
                length = span.end - span.start
                start = choose_best_start(others, length)
                moved |= start != span.start
                spans[k] = ServedSpan(span.name, start, start + length, span.throughput)
        if not moved:
            break
    return spans


# --- the global planner --------------------------------------------------------------


def plan_blocks(num_blocks: int, servers: Sequence[Server], iterations: int = DEFAULT_ITERATIONS,
                node_limit: int = DEFAULT_NODE_LIMIT) -> BlockPlan:
    """One contiguous span per server maximizing the worst block's throughput, then the
    next worst, and so on (lexicographic max-min of the sorted block throughputs).

    The bottleneck problem is NP-hard (with one-block spans it is bin covering), so
    the planner searches parametrically on the target minimum T and certifies what it
    finds:

    1. Start from Petals' greedy join in the given order: the plan is never worse.
    2. Upper bound: the linear relaxation (a server's throughput may be split across
       starts). No plan beats it; a plan that meets it (to solver accuracy, 1e-7) is
       optimal. It also caps the targets annealing aims at.
    3. Exact probes: is T = best minimum + one unit feasible? A branch-and-bound
       search (`_Sweep`) answers; a find raises the minimum and probes again, and a
       completed search proves the plan optimal (`optimal`). On small swarms (up to
       about 8 heterogeneous servers) it completes within the node limit.
    4. Otherwise, simulated annealing on the shortfall sum(max(0, T - load)) with
       moves that shift, relocate or swap spans. Zero shortfall shows T reachable; T
       then rises halfway to the bound, and falls halfway back when it resists for a
       while. `upper_bound` is then the linear bound, so the gap is certified.
    5. Tie-break: each server in turn moves to the start that makes the sorted load
       vector lexicographically largest, only on strict improvement, so the minimum
       never drops and the loop ends.

    Loads are compared in integer units (throughput scaled to 2**40 per the largest
    server), so sums are exact and independent of summation order. A seeded generator
    and iteration/node limits (never time limits) make the plan deterministic.
    """
    _check(num_blocks, servers)
    lengths = np.array([_clip(server.span_length, num_blocks) for server in servers], dtype=np.int64)
    weights = np.array([server.throughput for server in servers], dtype=float)
    units = _to_units(weights)

    greedy = np.array([span.start for span in greedy_join(num_blocks, servers)], dtype=np.int64)
    bound = _lp_bound(num_blocks, lengths, units) * (1 + _LP_TOLERANCE)
    best, optimal = _raise_bottleneck(num_blocks, lengths, units, greedy, bound, iterations, node_limit)
    best = _refine(num_blocks, best, lengths, units)

    load = block_throughput(num_blocks, servers, best)
    upper = float(load.min()) if optimal else bound * float(weights.max()) / _UNIT_SCALE
    return BlockPlan(assignments=tuple(Span(s.name, int(b), int(b + n)) for s, b, n in zip(servers, best, lengths)),
                     block_throughput=tuple(float(x) for x in load), min_throughput=float(load.min()),
                     upper_bound=max(upper, float(load.min())), optimal=optimal)


def _raise_bottleneck(num_blocks: int, lengths: np.ndarray, units: np.ndarray, best: np.ndarray, bound: float,
                      iterations: int, node_limit: int) -> tuple[np.ndarray, bool]:
    """Steps 3 and 4 of `plan_blocks`: the starts with the best minimum found, and
    whether that minimum is proven optimal (exact search, or it meets `bound`)."""
    low = int(_load(num_blocks, best, lengths, units).min())
    if _meets(low, bound):
        return best, True
    if len(lengths) <= _EXACT_MAX_SERVERS:
        best, low, proven = _sweep_ratchet(num_blocks, lengths, units, best, low, node_limit)
        if proven:
            return best, True
    best, low = _anneal(num_blocks, lengths, units, best, low, int(bound) + 1, iterations)
    return best, _meets(low, bound)


def _meets(low: int, bound: float) -> bool:
    """Whether `low` reaches the linear bound to solver accuracy (`bound` already
    includes one tolerance above the solver's value)."""
    return low >= bound * (1 - 2 * _LP_TOLERANCE)


def block_throughput(num_blocks: int, servers: Sequence[Server], starts: Sequence[int]) -> np.ndarray:
    """Per-block total throughput when server i holds the span starting at starts[i]."""
    lengths = np.array([_clip(server.span_length, num_blocks) for server in servers], dtype=np.int64)
    weights = np.array([server.throughput for server in servers], dtype=float)
    return _load(num_blocks, np.asarray(starts, dtype=np.int64), lengths, weights)


# --- shared helpers ------------------------------------------------------------------


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
    # Plain sums in server order (a difference array would leave float residue like -1e-16).
    load = np.zeros(num_blocks, dtype=weights.dtype)
    for start, length, weight in zip(starts.tolist(), lengths.tolist(), weights.tolist()):
        load[start : start + length] += weight
    return load


def _worst_windows(load: np.ndarray, length: int) -> np.ndarray:
    """Starts of the spans of `length` whose sorted block loads are lexicographically smallest."""
    return _lex_extreme(-np.sort(np.lib.stride_tricks.sliding_window_view(load, length), axis=1))


def _shortfall_change(load: list[int], target: int, first: int, last: int, unit: int) -> int:
    """Adds `unit` to blocks [first, last) of `load`; returns the change in shortfall below `target`."""
    change = 0
    for b in range(first, last):
        before = load[b]
        load[b] = after = before + unit
        change += (target - after if after < target else 0) - (target - before if before < target else 0)
    return change


def _lex_extreme(rows: np.ndarray) -> np.ndarray:
    """Indices of the lexicographically largest rows, ascending."""
    candidates = np.arange(len(rows))
    for column in rows.T:
        values = column[candidates]
        candidates = candidates[values == values.max()]
        if len(candidates) == 1:
            break
    return candidates


def _greedy_restart(load: np.ndarray, starts: np.ndarray, lengths: np.ndarray, units: np.ndarray, i: int) -> int:
    """Server i leaves and rejoins at its greedy best start; `load` and `starts` are
    updated in place. Staying wins ties (Petals: subtract its throughput times 1 + eps)."""
    start, length = starts[i], lengths[i]
    load[start : start + length] -= units[i]
    best = _worst_windows(load, length)
    new = start if start in best else int(best[0])
    load[new : new + length] += units[i]
    starts[i] = new
    return new


def _settle(load: np.ndarray, starts: np.ndarray, lengths: np.ndarray, units: np.ndarray) -> None:
    """Every server re-chooses greedily, in index order, until none moves. Petals
    shuffles the order at random; a fixed order keeps the answer deterministic. The
    round cap guards against a cycle, which greedy moves do not rule out."""
    for _ in range(4 * len(starts) + 4):
        moved = False
        for i in range(len(starts)):
            before = starts[i]
            moved |= _greedy_restart(load, starts, lengths, units, i) != before
        if not moved:
            return


# --- planner internals ---------------------------------------------------------------


def _lp_bound(num_blocks: int, lengths: np.ndarray, units: np.ndarray) -> float:
    """Upper bound on the best minimum, in units: the linear relaxation. There a
    server's throughput may be spread over starts, so servers of equal length pool
    into one mass per length, which keeps the program small."""
    mass: dict[int, int] = {}
    for length, unit in zip(lengths.tolist(), units.tolist()):
        mass[length] = mass.get(length, 0) + unit
    scale = float(max(mass.values()))
    if scale <= 0:
        return 0.0
    rows, cols, owner = [], [], []  # variables: the mass starting at each (length, start)
    column = 0
    for k, length in enumerate(sorted(mass)):
        starts = np.arange(num_blocks - length + 1)
        rows.append((starts[:, None] + np.arange(length)).ravel())
        cols.append(np.repeat(starts + column, length))
        owner.append(np.full(len(starts), k))
        column += len(starts)
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    # The last variable is T; one row per block: T - load(b) <= 0.
    entries = (np.concatenate([rows, np.arange(num_blocks)]), np.concatenate([cols, np.full(num_blocks, column)]))
    cover = csc_array((np.concatenate([-np.ones(len(rows)), np.ones(num_blocks)]), entries),
                      shape=(num_blocks, column + 1))
    pools = csc_array((np.ones(column), (np.concatenate(owner), np.arange(column))), shape=(len(mass), column + 1))
    objective = np.zeros(column + 1)
    objective[-1] = -1.0
    result = linprog(objective, A_ub=cover, b_ub=np.zeros(num_blocks), A_eq=pools,
                     b_eq=np.array([mass[length] for length in sorted(mass)]) / scale, method="highs")
    return -result.fun * scale


class _Shortfall:
    """Block loads and their total shortfall below a target, updated move by move."""

    def __init__(self, num_blocks: int, lengths: list[int], units: list[int], starts: list[int], target: int):
        self.lengths, self.units, self.starts = lengths, units, list(starts)
        self.load = _load(num_blocks, np.array(starts), np.array(lengths), np.array(units)).tolist()
        self.retarget(target)

    def retarget(self, target: int) -> None:
        self.target = target
        self.total = sum(target - x for x in self.load if x < target)

    def move(self, i: int, new: int) -> int:
        """Move server i to start `new`; returns the change in total shortfall. Only
        the blocks the span leaves or enters are touched."""
        old, length, unit = self.starts[i], self.lengths[i], self.units[i]
        old_end, new_end = old + length, new + length
        if new >= old:
            change = self._add(old, min(old_end, new), -unit) + self._add(max(old_end, new), new_end, unit)
        else:
            change = self._add(max(new_end, old), old_end, -unit) + self._add(new, min(new_end, old), unit)
        self.starts[i] = new
        self.total += change
        return change

    def _add(self, first: int, last: int, unit: int) -> int:
        return _shortfall_change(self.load, self.target, first, last, unit)


def _anneal(num_blocks: int, lengths: np.ndarray, units: np.ndarray, best: np.ndarray, low: int, high: int,
            iterations: int) -> tuple[np.ndarray, int]:
    """Simulated annealing on the shortfall below a moving target T between `low`
    (reached by `best`) and `high` (a bound). Returns the best starts and their minimum."""
    lengths_, units_ = lengths.tolist(), units.tolist()
    rnd = random.Random(0)
    patience = max(int(iterations * _PATIENCE), 1)
    temperature = _TEMPERATURE * max(units_)
    state = _Shortfall(num_blocks, lengths_, units_, best.tolist(), _aim(low, high))
    stalled = 0
    for step in range(iterations):
        cooling = temperature * (1 - step / iterations)
        change, undo = _random_move(state, num_blocks, rnd)
        if change > 0 and rnd.random() >= math.exp(-change / cooling):
            for i, start in reversed(undo):
                state.move(i, start)
        stalled += 1
        if state.total == 0:
            best, low, stalled = np.array(state.starts), min(state.load), 0
            state.retarget(_aim(low, high))
        elif stalled > patience:  # T resists: aim lower, from the best plan
            high, stalled = state.target, 0
            state = _Shortfall(num_blocks, lengths_, units_, best.tolist(), _aim(low, high))
    return best, low


def _aim(low: int, high: int) -> int:
    """Halfway to `high`, but always at least a small step above `low`."""
    return low + max((high - low) // 2, int(low * _MIN_STEP) + 1)


def _random_move(state: _Shortfall, num_blocks: int, rnd: random.Random) -> tuple[int, list[tuple[int, int]]]:
    """Swap two servers' starts, relocate one anywhere, or shift one by 1-2 blocks.
    Returns the shortfall change and the (server, old start) pairs to undo it."""
    count, kind = len(state.starts), rnd.random()
    if kind < _SWAP and count > 1:
        i, j = rnd.sample(range(count), 2)
        old_i, old_j = state.starts[i], state.starts[j]
        change = state.move(i, min(old_j, num_blocks - state.lengths[i]))
        change += state.move(j, min(old_i, num_blocks - state.lengths[j]))
        return change, [(i, old_i), (j, old_j)]
    i = rnd.randrange(count)
    old, last = state.starts[i], num_blocks - state.lengths[i]
    new = rnd.randint(0, last) if kind < _SWAP + _RELOCATE else min(max(old + rnd.choice((-2, -1, 1, 2)), 0), last)
    return state.move(i, new), [(i, old)]


class _OutOfNodes(Exception):
    pass


class _Sweep:
    """Decision search: is there a placement where every block's load is >= target?

    Exact by a shifting argument: in a feasible placement, a server whose first block
    would stay >= target without it can move one block right without harm. So some
    feasible placement has every server either *needed* at its first block or at its
    rightmost start. The search sweeps left to right and, at the leftmost block short
    of the target, branches on which unplaced server starts there (clamped to its
    rightmost start). Servers starting at one block are taken in a fixed order, and of
    identical servers only the first is tried. Candidates are tried best fit first
    (least throughput-blocks wasted); limited discrepancy search (allow k departures
    from that order, k = 0, 1, ...) finds good placements early, and a pass that never
    had to cut a branch was exhaustive, which proves infeasibility.
    """

    def __init__(self, num_blocks: int, lengths: np.ndarray, units: np.ndarray):
        self.order = sorted(range(len(units)), key=lambda i: (int(units[i]), int(lengths[i]), i))
        self.n = num_blocks
        self.lengths = [int(lengths[i]) for i in self.order]
        self.units = [int(units[i]) for i in self.order]
        kinds: dict[tuple[int, int], int] = {}
        self.kind = [kinds.setdefault(key, len(kinds)) for key in zip(self.lengths, self.units)]

    def solve(self, target: int, node_limit: int) -> tuple[np.ndarray | None, bool, int]:
        """(starts or None, whether the answer is proven, nodes used)."""
        used = 0
        for discrepancies in _DISCREPANCIES:
            self._reset(target, node_limit - used)
            try:
                found = self._search(0, 0, discrepancies)
            except _OutOfNodes:
                return None, False, node_limit
            used += self.nodes
            if found:
                return self._starts(), True, used
            if not self.cut:
                return None, True, used
        return None, False, used

    def _reset(self, target: int, node_limit: int) -> None:
        self.target, self.node_limit, self.nodes, self.cut = target, node_limit, 0, False
        self.load = [0] * self.n
        self.starts = [-1] * len(self.order)
        self.shortfall = target * self.n

    def _search(self, block: int, first: int, discrepancies: int) -> bool:
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
        for rank, k in enumerate(self._candidates(block, first)):
            if rank > discrepancies:
                self.cut = True
                break
            start = min(block, self.n - self.lengths[k])
            self._add(k, start, +1)
            if self._search(block, k + 1, discrepancies - rank):
                return True
            self._add(k, start, -1)
        return False

    def _candidates(self, block: int, first: int) -> list[int]:
        """Unplaced servers that may start here, one per kind, best fit first: those
        that close the gap alone, by throughput-blocks wasted (overshoot plus overlap
        when clamped at the end); then the rest, by throughput-blocks contributed."""
        gap, reach = self.target - self.load[block], self.n - block
        seen, ranked = set(), []
        for k in range(first, len(self.order)):
            if self.starts[k] >= 0 or self.kind[k] in seen:
                continue
            seen.add(self.kind[k])
            unit, length = self.units[k], self.lengths[k]
            clamp = unit * max(0, length - reach)
            if unit >= gap:
                ranked.append(((0, (unit - gap) * min(length, reach) + clamp), k))
            else:
                ranked.append(((1, clamp - unit * min(length, reach)), k))
        ranked.sort()
        return [k for _, k in ranked]

    def _may_cover(self, block: int, first: int) -> bool:
        """Necessary conditions: enough throughput left for this block, and enough
        throughput-blocks left for the total shortfall from here on."""
        reach, here, area = self.n - block, 0, 0
        for k, (start, unit, length) in enumerate(zip(self.starts, self.units, self.lengths)):
            if start < 0:
                here += unit if k >= first else 0
                area += unit * (length if length < reach else reach)
        return here >= self.target - self.load[block] and area >= self.shortfall

    def _add(self, k: int, start: int, sign: int) -> None:
        end = start + self.lengths[k]
        self.shortfall += _shortfall_change(self.load, self.target, start, end, sign * self.units[k])
        self.starts[k] = start if sign > 0 else -1

    def _starts(self) -> np.ndarray:
        """Starts in input order; servers the sweep did not need take greedy spans."""
        load = np.array(self.load)
        for k, start in enumerate(self.starts):
            if start < 0:
                self.starts[k] = start = choose_best_start(load, self.lengths[k])
                load[start : start + self.lengths[k]] += self.units[k]
        starts = np.zeros(len(self.order), dtype=np.int64)
        starts[self.order] = self.starts
        return starts


def _sweep_ratchet(num_blocks: int, lengths: np.ndarray, units: np.ndarray, best: np.ndarray, low: int,
                   node_limit: int) -> tuple[np.ndarray, int, bool]:
    """Exact probes at T = low + 1 (one unit above the best minimum so far): a find
    raises `low` and probes again; a completed search proves `low` optimal. Returns
    the best starts, their minimum, and whether that minimum is proven optimal."""
    sweep = _Sweep(num_blocks, lengths, units)
    left = node_limit
    while left > 0:
        found, proven, used = sweep.solve(low + 1, left)
        left -= used
        if found is None:
            return best, low, proven
        best, low = found, int(_load(num_blocks, found, lengths, units).min())
    return best, low, False


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
            best = _lex_extreme(np.sort(load + units[i] * inside, axis=1))
            if starts[i] not in best:
                starts[i] = best[0]
                improved = True
            load[starts[i] : starts[i] + length] += units[i]
    return starts
