"""DeDLOC's averaging plan (section 3.2, appendix B): which peers compute gradients and
which share of the gradient vector each peer aggregates.

Model. Peer i computes s_i samples/s and moves u_i up, d_i down; a link i->j may be
capped at t_ij. A step needs B samples; the vector has P parameters. A computing peer
(c_i = 1) sends every aggregator j its part (a_ij); aggregator i returns the averaged
part (g_ij) to every computing peer. Steps/s = min(sum_i s_i c_i / B, aggregation rate).
Transfers within a peer are free; client-mode peers accept no connections, so they
aggregate nothing. Averaged parts go back to the senders only: a hivemind auxiliary
peer neither sends nor receives, and only so do bandwidth-only peers become BytePS
summation servers. Eq. 5 asks every peer to receive; here peer i's receive row carries
a big-M (1 - c_i) X, X an upper bound of steps/s.

Units. Rates are whole gradient vectors per second (Mbps * 1e6 / (8 * P * bytes)) and
steps/s, divided by one reference rate (the smaller of the total compute rate and the
total bandwidth, itself an upper bound of the optimum), so coefficients are of order one.

Eq. 5, compact (`relaxation_lp`). The literal form has n^3 rows
``g_ij <= a_ki + (1 - c_k) d_i``. The compact form adds r_i, the rate at which aggregator
i collects every computing sender's part, and keeps 2 n^2 rows: ``g_ij <= r_i`` for all j
and ``r_i <= a_ki + (1 - c_k) d_i`` for k != i. Eliminating r_i (Fourier-Motzkin) pairs
each of its lower bounds with each of its upper bounds and yields exactly the literal
rows with k != i, plus 0 <= a_ki + (1 - c_k) d_i, which the bounds imply; the rows with
k = i are vacuous because a_ii is a free, unbounded self-transfer. So both forms have the
same feasible set in (a, g, c, xi) and the same optimum (`literal_relaxation_lp` builds
the literal one for the test).

Realizable plans (`plan_averaging`). Eq. 5 is not a plan: a fractional c_k counts part of
k's compute and drops k from the aggregation rows, and g_ij may differ per receiver,
whereas an aggregator owning a fraction of the vector returns all of it to every
receiver. It is also slow (2 n^2 variables: seconds at 64 peers), so it serves as a bound.
A plan has c in {0, 1} and one rate r_i per aggregator, R = sum r, shares r_i / R (eq. 6
with min_j g_ij = r_i). Every byte a computing peer sends comes back, so peer i's
traffic is the same each way: c_i (R - r_i) + (K - c_i) r_i <= w_i = min(u_i, d_i) with
K = sum c, and a link carries c_i r_j + c_j r_i. With the roles fixed and no link caps
this LP has a closed form (`_closed_form`): each computing peer carries R, so R <= w_i;
a computing aggregator's row gives r_i <= (w_i - R) / (K - 2), another aggregator's
r_i <= w_i / K, and summing them bounds R. Choosing the roles is a mixed-integer program;
`_milp_program` linearizes the products c_i R, c_i r_i and K r_i (K in binary digits)
exactly with O(n log n) variables. It is solved exactly up to `EXACT_MAX_PEERS` peers;
above that, its LP relaxation is rounded and improved by single-peer flips ranked by the
closed form (link caps aside). Either way the roles are then fixed and the shares
re-solved, link caps included, to maximize the aggregation rate, so the plan's averaging
time is the best one for its roles; without link caps, among the splits reaching that rate,
the one that levels the links' load (`_levelled_rates`), so bottleneck links get no
sliver. A lone non-client trainer exchanges nothing; that plan is always a candidate, and
so are all-reduce's roles (everyone computes).
A client-mode peer with samples/s computes in every plan (c_i = 1 in the MILP, its
rounding and the candidates): hivemind cannot make it an auxiliary, so it keeps sending
its gradients whatever a plan says, and a plan that counted it out would report figures
of roles nobody follows. Eq. 5 leaves its c_i free: the relaxation stays an upper bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_array, csr_array

__all__ = ["EXACT_MAX_PEERS", "AveragingPlan", "AveragingProblem", "LinearProgram", "PeerCapacity", "PeerRole",
           "Relaxation", "Throughput", "all_reduce_baseline", "literal_relaxation_lp", "parameter_server_baseline",
           "plan_averaging", "plan_for_roles", "relaxation_lp", "solve_lp", "solve_relaxation", "throughput_of"]

EXACT_MAX_PEERS = 16  # exact MILP: ~20 ms at 16 peers, ~50 ms at 32, ~110 ms at 64 (bench)
MILP_NODE_LIMIT = 5_000  # a node limit, unlike a time limit, keeps plans deterministic
_MBPS = 1e6 / 8  # bytes per second in one Mbps


# --- inputs and results --------------------------------------------------------------


@dataclass(frozen=True)
class PeerCapacity:
    name: str
    samples_per_second: float
    upload_mbps: float
    download_mbps: float
    client_mode: bool = False


@dataclass(frozen=True, kw_only=True)
class AveragingProblem:
    target_batch_size: float
    num_parameters: int
    peers: Sequence[PeerCapacity]
    bytes_per_parameter: float = 4.0
    links: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # src -> dst -> Mbps

    def __post_init__(self) -> None:
        names = [peer.name for peer in self.peers]
        if len(set(names)) != len(names):
            raise ValueError("peer names must be unique")
        if not any(peer.samples_per_second > 0 for peer in self.peers):
            raise ValueError("at least one peer must compute samples")
        if all(peer.client_mode for peer in self.peers):
            raise ValueError("at least one peer must accept connections to aggregate")
        for src, row in self.links.items():
            if src not in names or any(dst not in names or dst == src for dst in row):
                raise ValueError(f"links of {src!r} name an unknown peer or the peer itself")


@dataclass(frozen=True)
class Throughput:
    compute_bound: float  # steps/s that the computing peers' samples allow
    aggregation_bound: float  # whole vectors averaged per second; inf when nothing is exchanged

    @property
    def steps_per_second(self) -> float:
        return min(self.compute_bound, self.aggregation_bound)

    @property
    def averaging_seconds(self) -> float:
        """P * bytes over the slowest receiver's return rate; in a plan every receiver
        gets every aggregator's rate, so that is the aggregation rate."""
        return 1.0 / self.aggregation_bound


@dataclass(frozen=True)
class PeerRole:
    name: str
    computes_gradients: bool
    aggregation_share: float


Method = Literal["milp", "rounding", "fixed"]  # exact; rounded and improved; roles given


@dataclass(frozen=True)
class AveragingPlan(Throughput):
    peers: tuple[PeerRole, ...]  # sorted by name
    solve_seconds: float
    method: Method


@dataclass(frozen=True)
class Relaxation:
    steps_per_second: float  # eq. 5's optimum: no plan but a lone trainer's exceeds it
    computes: np.ndarray  # fractional c, peers sorted by name


@dataclass(frozen=True)
class LinearProgram:
    """minimize cost @ x  s.t.  matrix @ x <= rhs,  lower <= x <= upper."""

    cost: np.ndarray
    matrix: csr_array
    rhs: np.ndarray
    lower: np.ndarray
    upper: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.matrix.shape[0]


# --- scaling -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scaled:
    names: tuple[str, ...]  # sorted
    compute: np.ndarray  # steps/s each peer's samples give alone
    upload: np.ndarray
    download: np.ndarray
    aggregates: np.ndarray  # bool: accepts connections
    forced: np.ndarray  # bool: computes in every realizable plan (a client-mode peer with samples)
    links: np.ndarray  # directed caps, inf where none
    pair_caps: np.ndarray  # the smaller cap of each pair's two directions: both carry the same plan traffic
    unit: float  # vectors (or steps) per second in one model unit

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def capacity(self) -> np.ndarray:
        """w_i: a plan's traffic is the same each way, so the smaller direction caps it."""
        return np.minimum(self.upload, self.download)


def _scale(problem: AveragingProblem) -> _Scaled:
    peers = sorted(problem.peers, key=lambda peer: peer.name)
    names = tuple(peer.name for peer in peers)
    vectors_per_mbps = _MBPS / (problem.num_parameters * problem.bytes_per_parameter)
    compute = np.array([peer.samples_per_second for peer in peers]) / problem.target_batch_size
    upload = np.array([peer.upload_mbps for peer in peers]) * vectors_per_mbps
    download = np.array([peer.download_mbps for peer in peers]) * vectors_per_mbps
    unit = float(min(compute.sum(), np.minimum(upload, download).sum()))
    links = np.full((len(peers), len(peers)), np.inf)
    pair_caps = links.copy()  # from the listed links only: min(links, links.T) is slow at thousands of peers
    index = {name: i for i, name in enumerate(names)}
    for src, row in problem.links.items():
        for dst, mbps in row.items():
            i, j = index[src], index[dst]
            links[i, j] = mbps * vectors_per_mbps / unit
            pair_caps[i, j] = pair_caps[j, i] = min(pair_caps[i, j], links[i, j])
    return _Scaled(names=names, compute=compute / unit, upload=upload / unit, download=download / unit,
                   aggregates=np.array([not peer.client_mode for peer in peers]),
                   forced=np.array([peer.client_mode and peer.samples_per_second > 0 for peer in peers]),
                   links=links, pair_caps=pair_caps, unit=unit)


# --- sparse programs -----------------------------------------------------------------


class _Rows:
    """Collects blocks of `<=` rows; each block has the same number of entries per row."""

    def __init__(self, size: int) -> None:
        self.size, self.count = size, 0
        self._rows, self._cols, self._vals, self._rhs = [], [], [], []  # blocks of np.ndarray

    def add(self, cols: np.ndarray, vals: np.ndarray | float, rhs: np.ndarray | float) -> None:
        cols = np.atleast_2d(cols)
        if cols.size == 0:
            return
        self._rows.append(np.repeat(np.arange(self.count, self.count + cols.shape[0]), cols.shape[1]))
        self._cols.append(cols.ravel())
        self._vals.append(np.broadcast_to(vals, cols.shape).ravel())
        self._rhs.append(np.broadcast_to(np.asarray(rhs, dtype=float), (cols.shape[0],)))
        self.count += cols.shape[0]

    def add_when(self, plus: np.ndarray, minus: np.ndarray, switch: np.ndarray, big: np.ndarray | float) -> None:
        """Rows `plus <= minus + big (1 - switch)`: plus <= minus where the switch is 1."""
        plus, minus, switch = (a.ravel() for a in np.broadcast_arrays(plus, minus, switch))
        big = np.broadcast_to(np.asarray(big, dtype=float), plus.shape)
        ones = np.ones(plus.size)
        self.add(np.column_stack([plus, minus, switch]), np.column_stack([ones, -ones, big]), big)

    def program(self, objective_index: int, lower: np.ndarray, upper: np.ndarray) -> LinearProgram:
        """Maximizes the variable at `objective_index`."""
        cost = np.zeros(self.size)
        cost[objective_index] = -1.0
        entries = (np.concatenate(self._vals), (np.concatenate(self._rows), np.concatenate(self._cols)))
        matrix = coo_array(entries, shape=(self.count, self.size)).tocsr()
        return LinearProgram(cost, matrix, np.concatenate(self._rhs), lower, upper)


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ordered pair (i, j) with i != j, row-major."""
    return np.nonzero(~np.eye(n, dtype=bool))


def solve_lp(program: LinearProgram) -> np.ndarray:
    """HiGHS' dual simplex: a vertex, the same one for the same input."""
    result = linprog(program.cost, A_ub=program.matrix, b_ub=program.rhs,
                     bounds=np.column_stack([program.lower, program.upper]), method="highs-ds")
    if result.status != 0:
        raise RuntimeError(f"averaging LP failed: {result.message}")
    return result.x


# --- eq. 5 ---------------------------------------------------------------------------


class _Eq5Index:
    """Variables: xi, c (n), r (n), a (n x n, a[i, j]: i sends to j), g (n x n)."""

    def __init__(self, n: int) -> None:
        self.xi = 0
        self.c = 1 + np.arange(n)
        self.r = 1 + n + np.arange(n)
        self.a = 1 + 2 * n + np.arange(n * n).reshape(n, n)
        self.g = 1 + 2 * n + n * n + np.arange(n * n).reshape(n, n)
        self.size = 1 + 2 * n + 2 * n * n


def _eq5(m: _Scaled, literal: bool) -> LinearProgram:
    n, ix = m.n, _Eq5Index(m.n)
    rows = _Rows(ix.size)
    ones = np.ones(n)
    big_m = m.download  # the paper's M_i = d_i
    rows.add(np.concatenate(([ix.xi], ix.c)), np.concatenate(([1.0], -m.compute)), 0.0)
    # a computing peer gets the whole vector back: xi <= sum_j g_ji + (1 - c_i) X, where
    # X = 1 unit bounds every plan's steps/s (see _scale)
    rows.add(np.column_stack([np.full(n, ix.xi), ix.c, ix.g.T]), np.concatenate(([1.0, 1.0], -ones)), 1.0)
    if literal:  # g_ij <= a_ki + (1 - c_k) M_i for all i, j, k
        i, j, k = (axis.ravel() for axis in np.indices((n, n, n)))
        rows.add_when(ix.g[i, j], ix.a[k, i], ix.c[k], big_m[i])
    else:
        agg = np.flatnonzero(m.aggregates)
        i, j = np.repeat(agg, n), np.tile(np.arange(n), agg.size)
        rows.add(np.column_stack([ix.g[i, j], ix.r[i]]), np.array([1.0, -1.0]), 0.0)  # g_ij <= r_i
        k, i = _pairs(n)
        k, i = k[m.aggregates[i]], i[m.aggregates[i]]  # r_i <= a_ki + (1 - c_k) M_i, k != i
        rows.add_when(ix.r[i], ix.a[k, i], ix.c[k], big_m[i])
    off = ~np.eye(n, dtype=bool)
    rows.add(np.column_stack([ix.a.T[off].reshape(n, n - 1), ix.g.T[off].reshape(n, n - 1)]), 1.0, m.download)
    rows.add(np.column_stack([ix.a[off].reshape(n, n - 1), ix.g[off].reshape(n, n - 1)]), 1.0, m.upload)
    i, j = _pairs(n)
    capped = np.isfinite(m.links[i, j])
    i, j = i[capped], j[capped]
    rows.add(np.column_stack([ix.a[i, j], ix.g[i, j]]), 1.0, m.links[i, j])

    lower, upper = np.zeros(ix.size), np.full(ix.size, np.inf)
    upper[ix.c] = 1.0
    clients = ~m.aggregates
    upper[ix.r[clients]] = 0.0
    upper[ix.g[clients].ravel()] = 0.0
    upper[ix.a[:, clients].ravel()] = 0.0
    if not literal:
        upper[np.diag(ix.a)] = 0.0  # a_ii appears only in the literal k = i rows
    return rows.program(ix.xi, lower, upper)


def relaxation_lp(problem: AveragingProblem) -> LinearProgram:
    """Eq. 5 in the compact form: 2 n^2 + O(n) rows (fewer with client-mode peers)."""
    return _eq5(_scale(problem), literal=False)


def literal_relaxation_lp(problem: AveragingProblem) -> LinearProgram:
    """Eq. 5 with the n^3 rows as the paper writes them (receive rows as in
    `relaxation_lp`): only for tests and benchmarks."""
    return _eq5(_scale(problem), literal=True)


def solve_relaxation(problem: AveragingProblem) -> Relaxation:
    """Eq. 5's optimum in steps/s and its fractional roles."""
    m = _scale(problem)
    x = solve_lp(_eq5(m, literal=False))
    ix = _Eq5Index(m.n)
    return Relaxation(steps_per_second=float(x[ix.xi]) * m.unit, computes=x[ix.c])


# --- realizable plans ----------------------------------------------------------------


def _closed_form(m: _Scaled, roles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps/s and aggregation rate of each row of `roles` (bool, sets x n) with optimal
    shares, ignoring link caps (module docstring)."""
    computing_aggs = roles & m.aggregates
    return _closed_form_of(m, computing=roles.sum(axis=1), computing_aggs=computing_aggs.sum(axis=1),
                           computing_aggs_w=computing_aggs @ m.capacity,
                           slowest=np.where(roles, m.capacity, np.inf).min(axis=1), compute=roles @ m.compute)


def _closed_form_of(m: _Scaled, computing: np.ndarray, computing_aggs: np.ndarray, computing_aggs_w: np.ndarray,
                    slowest: np.ndarray, compute: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_closed_form` from what it needs of each role set: K, the number of computing aggregators,
    the sum of their w, the smallest w of a computing peer, and the computing peers' steps/s."""
    k, k_agg, w_all = computing, computing_aggs, m.capacity[m.aggregates].sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = np.where(k_agg == 0,
                          w_all / k,  # only client-mode peers compute: aggregators each take in w_i / K
                          (2 * computing_aggs_w + (k - 2) * w_all) / (k * (k - 2 + k_agg)))
    rate = np.minimum(slowest, spread)  # each sender carries R
    rate = np.where((k == 1) & (k_agg == 1), np.inf, rate)  # a lone non-client trainer
    rate = np.where(k == 0, 0.0, rate)
    return np.minimum(compute, rate), rate


def _min_of_others(values: np.ndarray) -> np.ndarray:
    """min_{j != i} values_j for every i (inf for a lone value), in O(n log n)."""
    order = np.argsort(values, kind="stable")
    others = np.full(values.size, values[order[0]])
    others[order[0]] = values[order[1]] if values.size > 1 else np.inf
    return others


def _single_flips(m: _Scaled, roles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_closed_form` of every role set that flips one peer of `roles` (row i flips peer i),
    in O(n) rather than O(n^2): each of its sums moves by that peer's term."""
    sign = np.where(roles, -1, 1)
    computing_aggs = roles & m.aggregates
    flipped_agg = sign * m.aggregates
    # the smallest w of the other computing peers: what is left when peer i stops computing,
    # and what peer i's own w is held against when it starts
    others = _min_of_others(np.where(roles, m.capacity, np.inf))
    return _closed_form_of(m, computing=roles.sum() + sign, computing_aggs=computing_aggs.sum() + flipped_agg,
                           computing_aggs_w=computing_aggs @ m.capacity + flipped_agg * m.capacity,
                           slowest=np.where(roles, others, np.minimum(others, m.capacity)),
                           compute=roles @ m.compute + sign * m.compute)


def _better(steps: float, rate: float, than: tuple[float, float]) -> bool:
    return steps > than[0] or (steps == than[0] and rate > than[1])


def _local_search(m: _Scaled, roles: np.ndarray) -> np.ndarray:
    """Flips one peer's role at a time while that raises (steps/s, aggregation rate); a
    forced peer keeps computing. O(n) per flip (`_single_flips`)."""
    free = np.flatnonzero(~m.forced)
    steps, rate = _closed_form(m, roles[None])
    current = (float(steps[0]), float(rate[0]))
    while True:  # some peer accepts connections, so some can flip
        steps, rate = (values[free] for values in _single_flips(m, roles))
        best = max(range(free.size), key=lambda k: (steps[k], rate[k], -k))
        if not _better(steps[best], rate[best], current):
            return roles
        roles = roles.copy()
        roles[free[best]] ^= True
        current = (float(steps[best]), float(rate[best]))


def _levelled_rates(m: _Scaled, roles: np.ndarray, rate: float) -> np.ndarray:
    """Aggregator rates summing to `rate` (the link-free optimum for these roles) that level the
    load of the links they add to (water-filling): every aggregator ends at the same share
    s of its capacity, and a peer whose own traffic already loads its link beyond s aggregates
    nothing. Peer i's traffic is base_i + coef_i r_i: R + (K - 2) r_i if it computes, K r_i if
    not. Any split summing to the optimum predicts the same time, but one that hands a
    bottleneck peer the sliver its link has left (proportional splits do) fills that link to
    the brim and makes it a part round-trip everyone waits for; levelled, slow links keep their
    slack. With K <= 2 computing peers carry R whatever they aggregate: the split is by capacity."""
    w, k = m.capacity, roles.sum()
    if k <= 2:
        weights = np.where(m.aggregates, np.where(roles, w, w / k), 0.0)
        return weights * (rate / weights.sum())
    base = np.where(roles, rate, 0.0)
    coef = np.where(roles, k - 2.0, float(k))
    usable = m.aggregates & (w > 0)
    order = np.flatnonzero(usable)[np.argsort(base[usable] / w[usable], kind="stable")]
    # sum over active i of (s w_i - base_i) / coef_i = rate, active: those with base_i / w_i < s
    slope = offset = 0.0
    level = np.inf
    for position, i in enumerate(order):
        slope += w[i] / coef[i]
        offset += base[i] / coef[i]
        level = (rate + offset) / slope
        following = order[position + 1] if position + 1 < order.size else None
        if following is None or level <= base[following] / w[following]:
            break
    return np.where(usable, np.maximum(level * w - base, 0.0) / coef, 0.0)


def _share_rates(m: _Scaled, roles: np.ndarray) -> np.ndarray:
    """Aggregator rates r (units) maximizing R = sum r with the roles fixed: in closed
    form without link caps, else by LP (r_i <= w_i is implied but for a lone trainer)."""
    n, c = m.n, roles.astype(float)
    if roles.sum() == 1 and m.aggregates[roles].all():
        return np.where(roles, np.inf, 0.0)
    if not np.isfinite(m.links).any():
        return _levelled_rates(m, roles, float(_closed_form(m, roles[None])[1][0]))
    traffic = np.outer(c, np.ones(n)) * (1 - np.eye(n)) + np.diag(c.sum() - c)
    i, j = np.nonzero(np.isfinite(m.pair_caps))  # the diagonal is inf
    keep = (i < j) & (c[i] + c[j] > 0)
    i, j = i[keep], j[keep]
    caps = m.pair_caps[i, j]
    links = np.zeros((i.size, n))
    np.add.at(links, (np.arange(i.size), j), c[i])  # i's part to aggregator j
    np.add.at(links, (np.arange(i.size), i), c[j])  # aggregator i's average back to j
    return solve_lp(LinearProgram(cost=-np.ones(n), matrix=csr_array(np.vstack([traffic, links])),
                                  rhs=np.concatenate([m.capacity, caps]), lower=np.zeros(n),
                                  upper=np.where(m.aggregates, m.capacity, 0.0)))


class _MilpIndex:
    """Variables: xi, R, c (n), r (n), digits of K (b), z = c R (n), y = c r (n),
    h = digit * r (n x b), v[i, j] = c_i r_j for capped pairs (flat)."""

    def __init__(self, n: int, num_linked: int) -> None:
        self.bits = int(n).bit_length()
        self.xi, self.total = 0, 1
        self.c = 2 + np.arange(n)
        self.r = self.c + n
        self.digit = 2 + 2 * n + np.arange(self.bits)
        self.z = 2 + 2 * n + self.bits + np.arange(n)
        self.y = self.z + n
        self.h = 2 + 4 * n + self.bits + np.arange(n * self.bits).reshape(n, self.bits)
        self.v = 2 + 4 * n + self.bits + n * self.bits + np.arange(num_linked)
        self.size = int(self.v[-1]) + 1 if num_linked else int(self.h.ravel()[-1]) + 1


def _milp_program(m: _Scaled) -> tuple[LinearProgram, _MilpIndex]:
    """The role choice as a MILP whose binaries are c and the digits of K.

    Every product appears on the side where only one bound of its McCormick envelope is
    needed, and with binary factors that bound is exact:
    traffic_i = c_i R + K r_i - 2 c_i r_i <= w_i with z_i >= R - R_max (1 - c_i),
    h_ib >= r_i - w_i (1 - digit_b), y_i <= r_i and y_i <= w_i c_i.
    R_max = max w: every computing peer carries R when another one computes, and the
    lone-trainer plan, the exception, is handled outside.
    """
    n, w = m.n, m.capacity
    li, lj = np.nonzero(np.isfinite(m.pair_caps))  # both orders of every capped pair (the diagonal is inf)
    ix = _MilpIndex(n, li.size)
    r_max = w.max()
    rows = _Rows(ix.size)
    ones = np.ones(n)
    rows.add(np.concatenate(([ix.xi], ix.c)), np.concatenate(([1.0], -m.compute)), 0.0)
    rows.add([ix.xi, ix.total], [1.0, -1.0], 0.0)
    rows.add(np.concatenate(([ix.total], ix.r)), np.concatenate(([1.0], -ones)), 0.0)
    weights = 2.0 ** np.arange(ix.bits)
    k_minus_digits = np.concatenate((ix.c, ix.digit))
    rows.add(k_minus_digits, np.concatenate((ones, -weights)), 0.0)  # sum c = K
    rows.add(k_minus_digits, np.concatenate((-ones, weights)), 0.0)
    rows.add(np.column_stack([ix.z, ix.y, ix.h]), np.concatenate(([1.0, -2.0], weights)), w)
    rows.add_when(ix.total, ix.z, ix.c, r_max)
    rows.add(np.column_stack([ix.y, ix.r]), np.array([1.0, -1.0]), 0.0)
    rows.add(np.column_stack([ix.y, ix.c]), np.column_stack([ones, -w]), 0.0)
    hi, hb = np.indices((n, ix.bits)).reshape(2, -1)
    rows.add_when(ix.r[hi], ix.h[hi, hb], ix.digit[hb], w[hi])
    # valid cut: a computing peer carries xi <= R each way (tightens the relaxation)
    rows.add(np.column_stack([np.full(n, ix.xi), ix.c]), np.column_stack([ones, np.full(n, r_max)]), w + r_max)
    # capped pair: c_i r_j + c_j r_i <= t_ij, with v_ij >= r_j - w_j (1 - c_i)
    forward = li < lj
    partner = np.flatnonzero(~forward)[np.lexsort((li[~forward], lj[~forward]))]
    rows.add(np.column_stack([ix.v[forward], ix.v[partner]]), 1.0, m.pair_caps[li[forward], lj[forward]])
    rows.add_when(ix.r[lj], ix.v, ix.c[li], w[lj])

    lower, upper = np.zeros(ix.size), np.full(ix.size, np.inf)
    lower[ix.c[m.forced]] = 1.0
    upper[ix.c] = upper[ix.digit] = 1.0
    upper[ix.r] = np.where(m.aggregates, w, 0.0)
    upper[ix.total] = r_max
    return rows.program(ix.xi, lower, upper), ix


def _milp_roles(m: _Scaled) -> tuple[np.ndarray, bool]:
    """The exact roles, and whether HiGHS proved them optimal within the node limit."""
    program, ix = _milp_program(m)
    integrality = np.zeros(ix.size)
    integrality[ix.c] = integrality[ix.digit] = 1
    result = milp(program.cost, integrality=integrality, bounds=Bounds(program.lower, program.upper),
                  constraints=LinearConstraint(program.matrix, -np.inf, program.rhs),
                  options={"node_limit": MILP_NODE_LIMIT, "mip_rel_gap": 1e-7})
    if result.x is None:
        raise RuntimeError(f"averaging MILP failed: {result.message}")
    return result.x[ix.c] > 0.5, result.status == 0


def _rounded_roles(m: _Scaled) -> list[np.ndarray]:
    """The MILP's relaxation rounded at 1/2, and every peer with samples; each improved
    by local search."""
    program, ix = _milp_program(m)
    rounded = solve_lp(program)[ix.c] >= 0.5
    return [_local_search(m, start) for start in (rounded, m.compute > 0) if start.any()]


def _evaluate(m: _Scaled, roles: np.ndarray) -> tuple[Throughput, np.ndarray]:
    rates = _share_rates(m, roles)
    return Throughput(float(roles @ m.compute) * m.unit, float(rates.sum()) * m.unit), rates


def _plan(m: _Scaled, roles: np.ndarray, evaluated: tuple[Throughput, np.ndarray], started: float,
          method: Method) -> AveragingPlan:
    throughput, rates = evaluated
    shares = np.isinf(rates).astype(float) if np.isinf(rates).any() else rates / rates.sum()  # eq. 6
    return AveragingPlan(
        compute_bound=throughput.compute_bound, aggregation_bound=throughput.aggregation_bound,
        peers=tuple(PeerRole(name, bool(roles[k]), float(shares[k])) for k, name in enumerate(m.names)),
        solve_seconds=time.perf_counter() - started, method=method)


def plan_averaging(problem: AveragingProblem, exact: bool | None = None) -> AveragingPlan:
    """The best plan with binary roles: exact (MILP) up to `EXACT_MAX_PEERS` peers unless
    `exact` says otherwise, else rounded and improved; same input, same plan."""
    started = time.perf_counter()
    m = _scale(problem)
    use_milp = m.n <= EXACT_MAX_PEERS if exact is None else exact
    candidates: list[np.ndarray] = []
    proven = False
    if use_milp:
        roles, proven = _milp_roles(m)
        candidates.append(roles)
    if not proven:
        candidates += _rounded_roles(m)
    solo_speed = np.where(m.aggregates, m.compute, 0.0)
    if solo_speed.max() > 0:  # the fastest non-client trainer, alone but for the forced peers
        candidates.append((np.arange(m.n) == int(np.argmax(solo_speed))) | m.forced)
    candidates.append(np.ones(m.n, dtype=bool))  # all-reduce's roles: never worse than the baselines
    scored = [_evaluate(m, roles) for roles in candidates]
    best = max(range(len(scored)), key=lambda k: (scored[k][0].steps_per_second, scored[k][0].aggregation_bound, -k))
    return _plan(m, candidates[best], scored[best], started, "milp" if proven else "rounding")


def plan_for_roles(problem: AveragingProblem, computes: Mapping[str, bool]) -> AveragingPlan:
    """The shares that maximize the aggregation rate for given roles (for example the
    ones peers follow now, to see how far they are from `plan_averaging`'s)."""
    started = time.perf_counter()
    m = _scale(problem)
    roles = np.array([computes[name] for name in m.names], dtype=bool)
    if not roles.any():
        raise ValueError("at least one peer must compute gradients")
    return _plan(m, roles, _evaluate(m, roles), started, "fixed")


# --- baselines under the same bandwidths ---------------------------------------------


def _fixed_shares(m: _Scaled, shares: np.ndarray, roles: np.ndarray | None = None) -> Throughput:
    """Each peer's and link's traffic per vector is fixed by the roles (default: everyone
    computes) and the shares, and the tightest one sets the rate. Only capped links can be
    the tightest, so only they are loaded (not all n^2 pairs)."""
    c = np.ones(m.n) if roles is None else roles.astype(float)
    per_peer = c * (1 - shares) + (c.sum() - c) * shares
    i, j = np.nonzero(np.isfinite(m.links))
    per_link = c[i] * shares[j] + c[j] * shares[i]  # i's part to j, and j's average back to i
    load = np.concatenate([per_peer, per_link])
    limit = np.concatenate([m.capacity, m.links[i, j]])
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = float(np.where(load > 1e-12, limit / load, np.inf).min())
    return Throughput(compute_bound=float(c @ m.compute) * m.unit, aggregation_bound=rate * m.unit)


def throughput_of(problem: AveragingProblem, computes: Mapping[str, bool], shares: Mapping[str, float]) -> Throughput:
    """What given roles and shares achieve under `problem`'s rates: how the plan peers follow
    now fares under new measurements, to hold against a fresh plan. Peers left out of the
    mappings neither compute nor aggregate."""
    m = _scale(problem)
    roles = np.array([bool(computes.get(name, False)) for name in m.names])
    share = np.array([max(0.0, float(shares.get(name, 0.0))) for name in m.names]) * m.aggregates
    if not roles.any() or share.sum() <= 0:
        return Throughput(compute_bound=float(roles @ m.compute) * m.unit, aggregation_bound=0.0)
    return _fixed_shares(m, share / share.sum(), roles)


def all_reduce_baseline(problem: AveragingProblem) -> Throughput:
    """Equal shares over the peers that accept connections: with none in client mode,
    each peer moves 2(n-1)/n of the vector each way."""
    m = _scale(problem)
    return _fixed_shares(m, m.aggregates / m.aggregates.sum())


def parameter_server_baseline(problem: AveragingProblem) -> Throughput:
    """The best single non-client peer aggregates the whole vector; every other peer
    sends and receives it once.

    `_fixed_shares` with shares e_s for every candidate server s would cost O(n^2) each. In
    closed form, for all s at once: s moves n - 1 vectors each way, every other peer and each
    of s's links one, and nothing else is loaded, so s's rate is the smallest of w_s / (n - 1),
    the other peers' w_i and the caps of s's links (the same divisions `_fixed_shares` does);
    as w_s / (n - 1) <= w_s, the smallest w_i over all peers does for the other peers'."""
    m = _scale(problem)
    w = m.capacity
    if m.n == 1:  # a lone server exchanges nothing
        rate = np.inf
    else:  # the diagonal of pair_caps is inf: no peer links to itself
        rate = np.minimum(np.minimum(w / (m.n - 1), w.min()), m.pair_caps.min(axis=1))[m.aggregates].max()
    return Throughput(compute_bound=float(np.ones(m.n) @ m.compute) * m.unit, aggregation_bound=float(rate) * m.unit)
