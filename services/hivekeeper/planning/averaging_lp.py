"""DeDLOC's averaging plan (section 3.2, appendix B): who computes gradients and which
share of the gradient vector each peer aggregates.

Model. Peer i computes s_i samples/s, uploads u_i and downloads d_i; a link i->j may be
capped at t_ij. A step needs B samples; the vector has P parameters. Peers with
c_i = 1 compute and send each aggregator j its part (rate a_ij); aggregator i returns
the averaged part (rate g_ij) to every computing peer. Steps/s are
min(sum_i s_i c_i / B, aggregation rate). Transfers within a peer are free; client-mode
peers accept no connections, so they aggregate nothing. Averaged parts go back to the
senders only: in hivemind's all-reduce an auxiliary peer neither sends nor receives, and
only then do bandwidth-only peers act as BytePS summation servers. Eq. 5 asks every peer
to receive; here the receive row of peer i carries a big-M (1 - c_i) * X instead.

Units. Rates are whole gradient vectors per second (Mbps * 1e6 / (8 * P * bytes)) and
steps/s, divided by one reference rate (the smaller of the total compute rate and the
total bandwidth, an upper bound of the optimum), so that coefficients are of order one.

The relaxation (eq. 5, `relaxation_lp`). The literal form has n^3 rows
``g_ij <= a_ki + (1 - c_k) M_i`` for all i, j, k. The compact form adds one variable per
aggregator, r_i (the rate at which i collects every sender's part), and keeps 2 n^2 rows:
``g_ij <= r_i`` for all j and ``r_i <= a_ki + (1 - c_k) M_i`` for all k != i. Eliminating
r_i (Fourier-Motzkin) pairs each of its lower bounds with each of its upper bounds and
gives back exactly the literal rows with k != i (plus 0 <= a_ki + (1 - c_k) M_i, implied
by the bounds); the rows with k = i are vacuous because a_ii is a free, unbounded
self-transfer. Both forms therefore have the same feasible set in (a, g, c, xi) and the
same optimum; `literal_relaxation_lp` builds the literal form to test that.

Realized plans (binary roles, `plan_averaging`). The relaxation is not a plan: a
fractional c_k counts part of k's compute and drops k from the aggregation rows, and g
may differ per receiver, whereas an aggregator that owns a fraction of the vector must
return all of it to every receiver. A realizable plan has c in {0, 1} and one rate r_i per
aggregator, shares r_i / sum r (eq. 6 with min_j g_ij = r_i). Then the return to a
computing peer j equals j's send to i, so one variable a_ji >= c_j r_i carries both, and
peer i's upload and download are both sum_{j != i} (a_ij + a_ji) <= min(u_i, d_i). The
exact mixed-integer version of that (`scipy.optimize.milp`) is solved up to
`EXACT_MAX_PEERS` peers; above that, the relaxation's c is rounded at a few thresholds.
Either way the roles are then fixed and the shares re-solved to maximize the aggregation
rate, so the plan's averaging time is the best one for its roles. A lone non-client
trainer needs no exchange at all; that plan is always a candidate.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_array, csr_array

__all__ = [
    "EXACT_MAX_PEERS",
    "AveragingPlan",
    "AveragingProblem",
    "PeerCapacity",
    "PeerRole",
    "Relaxation",
    "Throughput",
    "all_reduce_baseline",
    "literal_relaxation_lp",
    "parameter_server_baseline",
    "plan_averaging",
    "relaxation_lp",
    "solve_lp",
    "solve_relaxation",
]

EXACT_MAX_PEERS = 64  # the MILP stays well under 50 ms up to here (bench/bench_averaging_plan.py)
ROUNDING_THRESHOLDS = (0.999, 0.75, 0.5, 0.25, 0.001)  # c_k >= threshold -> k computes
MILP_NODE_LIMIT = 10_000  # a node limit, unlike a time limit, keeps the plan deterministic
_MBPS = 1e6 / 8  # bytes per second in one Mbps


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
    aggregation_bound: float  # full vectors averaged per second; inf when nothing is exchanged

    @property
    def steps_per_second(self) -> float:
        return min(self.compute_bound, self.aggregation_bound)

    @property
    def averaging_seconds(self) -> float:
        """Time for every receiver to get the whole averaged vector: the plan is uniform,
        so each one's return rate, and the slowest one's, is the aggregation rate."""
        return 1.0 / self.aggregation_bound


@dataclass(frozen=True)
class PeerRole:
    name: str
    computes_gradients: bool
    aggregation_share: float


@dataclass(frozen=True)
class AveragingPlan(Throughput):
    peers: tuple[PeerRole, ...]
    solve_seconds: float
    method: Literal["milp", "rounding"]


@dataclass(frozen=True)
class Relaxation:
    objective: float  # steps/s of eq. 5, an upper bound of every realizable plan
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
    compute: np.ndarray  # steps/s each peer's samples would give, in units
    upload: np.ndarray
    download: np.ndarray
    aggregates: np.ndarray  # bool: not in client mode
    links: np.ndarray  # directed caps t_ij in units, inf where none
    unit: float  # vectors/s per unit

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def capacity(self) -> np.ndarray:
        """Per-peer cap of a realizable plan, where every byte sent comes back."""
        return np.minimum(self.upload, self.download)


def _scale(problem: AveragingProblem) -> _Scaled:
    peers = sorted(problem.peers, key=lambda peer: peer.name)
    names = tuple(peer.name for peer in peers)
    vector_bytes = problem.num_parameters * problem.bytes_per_parameter
    compute = np.array([peer.samples_per_second for peer in peers]) / problem.target_batch_size
    upload = np.array([peer.upload_mbps for peer in peers]) * _MBPS / vector_bytes
    download = np.array([peer.download_mbps for peer in peers]) * _MBPS / vector_bytes
    links = np.full((len(peers), len(peers)), np.inf)
    index = {name: i for i, name in enumerate(names)}
    for src, row in problem.links.items():
        for dst, mbps in row.items():
            links[index[src], index[dst]] = mbps * _MBPS / vector_bytes
    unit = min(compute.sum(), np.minimum(upload, download).sum())
    return _Scaled(
        names=names,
        compute=compute / unit,
        upload=upload / unit,
        download=download / unit,
        aggregates=np.array([not peer.client_mode for peer in peers]),
        links=links / unit,
        unit=float(unit),
    )


# --- sparse row assembly -------------------------------------------------------------


class _Rows:
    """Collects blocks of rows; each block has the same number of entries per row."""

    def __init__(self) -> None:
        self._rows: list[np.ndarray] = []
        self._cols: list[np.ndarray] = []
        self._vals: list[np.ndarray] = []
        self._rhs: list[np.ndarray] = []
        self.count = 0

    def add(self, cols: np.ndarray, vals: np.ndarray, rhs: np.ndarray) -> None:
        cols = np.atleast_2d(cols)
        vals = np.broadcast_to(vals, cols.shape)
        rhs = np.broadcast_to(np.asarray(rhs, dtype=float), (cols.shape[0],))
        self._rows.append(np.repeat(np.arange(self.count, self.count + cols.shape[0]), cols.shape[1]))
        self._cols.append(cols.ravel())
        self._vals.append(vals.ravel())
        self._rhs.append(rhs)
        self.count += cols.shape[0]

    def program(self, cost: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> LinearProgram:
        shape = (self.count, cost.size)
        matrix = coo_array(
            (np.concatenate(self._vals), (np.concatenate(self._rows), np.concatenate(self._cols))), shape=shape
        )
        return LinearProgram(cost, matrix.tocsr(), np.concatenate(self._rhs), lower, upper)


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ordered pair (i, j) with i != j."""
    i, j = np.nonzero(~np.eye(n, dtype=bool))
    return i, j


# --- the relaxation (eq. 5) ----------------------------------------------------------


class _RelaxationIndex:
    """Variable layout: xi, c (n), r (n), a (n x n, a[i, j]: i sends to j), g (n x n)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.xi = 0
        self.c = 1 + np.arange(n)
        self.r = 1 + n + np.arange(n)
        self.a = 1 + 2 * n + np.arange(n * n).reshape(n, n)
        self.g = 1 + 2 * n + n * n + np.arange(n * n).reshape(n, n)
        self.size = 1 + 2 * n + 2 * n * n


def _relaxation(m: _Scaled, literal: bool) -> LinearProgram:
    n, ix, rows = m.n, _RelaxationIndex(m.n), _Rows()
    receive_big_m = 1.0  # the unit bounds every plan's steps/s
    i, j = _pairs(n)
    rows.add(np.concatenate(([ix.xi], ix.c)), np.concatenate(([1.0], -m.compute)), 0.0)
    # a computing peer receives the whole vector: xi <= sum_j g_ji + (1 - c_i) X
    receivers = np.arange(n)
    rows.add(
        np.column_stack([np.full(n, ix.xi), ix.c, ix.g[:, receivers].T]),
        np.concatenate(([1.0, receive_big_m], -np.ones(n))),
        receive_big_m,
    )
    big_m = m.download  # the paper's M_i = d_i
    if literal:
        ii, jj, kk = (axis.ravel() for axis in np.indices((n, n, n)))
        rows.add(
            np.column_stack([ix.g[ii, jj], ix.a[kk, ii], ix.c[kk]]),
            np.column_stack([np.ones(ii.size), -np.ones(ii.size), big_m[ii]]),
            big_m[ii],
        )
    else:
        agg = np.flatnonzero(m.aggregates)
        ai, aj = np.repeat(agg, n), np.tile(np.arange(n), agg.size)
        rows.add(np.column_stack([ix.g[ai, aj], ix.r[ai]]), np.array([1.0, -1.0]), 0.0)
        senders, aggs = j[np.isin(i, agg)], i[np.isin(i, agg)]  # r_i <= a_ki + (1 - c_k) M_i, k != i
        rows.add(
            np.column_stack([ix.r[aggs], ix.a[senders, aggs], ix.c[senders]]),
            np.column_stack([np.ones(aggs.size), -np.ones(aggs.size), big_m[aggs]]),
            big_m[aggs],
        )
    off = ~np.eye(n, dtype=bool)
    download_cols = np.column_stack([ix.a.T[off].reshape(n, n - 1), ix.g.T[off].reshape(n, n - 1)])
    upload_cols = np.column_stack([ix.a[off].reshape(n, n - 1), ix.g[off].reshape(n, n - 1)])
    rows.add(download_cols, 1.0, m.download)
    rows.add(upload_cols, 1.0, m.upload)
    capped = np.isfinite(m.links[i, j])
    rows.add(np.column_stack([ix.a[i[capped], j[capped]], ix.g[i[capped], j[capped]]]), 1.0, m.links[i, j][capped])

    lower, upper = np.zeros(ix.size), np.full(ix.size, np.inf)
    upper[ix.c] = 1.0
    clients = ~m.aggregates
    upper[ix.r[clients]] = 0.0
    upper[ix.g[clients, :].ravel()] = 0.0
    upper[ix.a[:, clients].ravel()] = 0.0
    if not literal:
        upper[np.diag(ix.a)] = 0.0  # unused: the k = i rows are vacuous (see module docstring)
    cost = np.zeros(ix.size)
    cost[ix.xi] = -1.0
    return rows.program(cost, lower, upper)


def relaxation_lp(problem: AveragingProblem) -> LinearProgram:
    """Eq. 5 in the compact form: 2 n^2 + O(n) rows."""
    return _relaxation(_scale(problem), literal=False)


def literal_relaxation_lp(problem: AveragingProblem) -> LinearProgram:
    """Eq. 5 as written, with its n^3 rows; for tests and benchmarks."""
    return _relaxation(_scale(problem), literal=True)


def solve_lp(program: LinearProgram) -> np.ndarray:
    """Solves with HiGHS' dual simplex: a vertex, the same one for the same input."""
    result = linprog(
        program.cost,
        A_ub=program.matrix,
        b_ub=program.rhs,
        bounds=np.column_stack([program.lower, program.upper]),
        method="highs-ds",
    )
    if result.status != 0:
        raise RuntimeError(f"averaging LP failed: {result.message}")
    return result.x


def solve_relaxation(problem: AveragingProblem) -> Relaxation:
    """Eq. 5's optimum in steps/s and its fractional roles (peers sorted by name)."""
    m = _scale(problem)
    x = solve_lp(_relaxation(m, literal=False))
    ix = _RelaxationIndex(m.n)
    return Relaxation(objective=float(x[ix.xi]) * m.unit, computes=x[ix.c])


# --- realizable plans ----------------------------------------------------------------


def _milp_roles(m: _Scaled) -> np.ndarray:
    """Binary roles of the best realizable plan (module docstring); variables xi, c, r, a."""
    n, rows = m.n, _Rows()
    xi, c, r = 0, 1 + np.arange(n), 1 + n + np.arange(n)
    a = 1 + 2 * n + np.arange(n * n).reshape(n, n)
    size = 1 + 2 * n + n * n
    cap = m.capacity
    i, j = _pairs(n)
    rows.add(np.concatenate(([xi], c)), np.concatenate(([1.0], -m.compute)), 0.0)
    rows.add(np.concatenate(([xi], r)), np.concatenate(([1.0], -np.ones(n))), 0.0)
    # a computing sender k sends aggregator i its part at r_i: r_i <= a_ki + (1 - c_k) cap_i
    to_agg = m.aggregates[j]
    senders, aggs = i[to_agg], j[to_agg]
    rows.add(
        np.column_stack([r[aggs], a[senders, aggs], c[senders]]),
        np.column_stack([np.ones(aggs.size), -np.ones(aggs.size), cap[aggs]]),
        cap[aggs],
    )
    off = ~np.eye(n, dtype=bool)
    rows.add(np.column_stack([a[off].reshape(n, n - 1), a.T[off].reshape(n, n - 1)]), 1.0, cap)
    pair_cap = np.minimum(m.links, m.links.T)
    capped = np.isfinite(pair_cap[i, j]) & (i < j)
    rows.add(np.column_stack([a[i[capped], j[capped]], a[j[capped], i[capped]]]), 1.0, pair_cap[i, j][capped])

    lower, upper = np.zeros(size), np.full(size, np.inf)
    upper[c] = 1.0
    upper[r] = np.where(m.aggregates, cap, 0.0)
    upper[np.diag(a)] = 0.0
    upper[a[:, ~m.aggregates].ravel()] = 0.0
    cost = np.zeros(size)
    cost[xi] = -1.0
    program = rows.program(cost, lower, upper)
    integrality = np.zeros(size)
    integrality[c] = 1
    result = milp(
        program.cost,
        integrality=integrality,
        bounds=Bounds(program.lower, program.upper),
        constraints=LinearConstraint(program.matrix, -np.inf, program.rhs),
        options={"node_limit": MILP_NODE_LIMIT, "mip_rel_gap": 1e-6},
    )
    if result.x is None:
        raise RuntimeError(f"averaging MILP failed: {result.message}")
    return np.round(result.x[c]).astype(bool)


def _rounded_roles(m: _Scaled, relaxed: np.ndarray) -> list[np.ndarray]:
    candidates = [relaxed >= threshold for threshold in ROUNDING_THRESHOLDS]
    unique = {candidate.tobytes(): candidate for candidate in candidates if (candidate & (m.compute > 0)).any()}
    return list(unique.values())


def _solo_roles(m: _Scaled) -> np.ndarray | None:
    """The fastest non-client trainer alone: nothing to exchange."""
    speed = np.where(m.aggregates, m.compute, 0.0)
    if speed.max() <= 0:
        return None
    return np.arange(m.n) == int(np.argmax(speed))


def _best_rates(m: _Scaled, computes: np.ndarray) -> np.ndarray:
    """Aggregator rates r (units) maximizing sum r with the roles fixed: traffic
    c_i sum_{j != i} r_j + (K - c_i) r_i <= min(u_i, d_i), and per pair
    c_i r_j + c_j r_i <= min(t_ij, t_ji). Unbounded only for a lone non-client trainer."""
    n, cf = m.n, computes.astype(float)
    if computes.sum() == 1 and m.aggregates[computes].all():
        return np.where(computes, np.inf, 0.0)
    traffic = np.outer(cf, np.ones(n)) * (1 - np.eye(n)) + np.diag(cf.sum() - cf)
    i, j = _pairs(n)
    pair_cap = np.minimum(m.links, m.links.T)
    capped = np.isfinite(pair_cap[i, j]) & (i < j) & ((cf[i] + cf[j]) > 0)
    link_rows = np.zeros((int(capped.sum()), n))
    link_rows[np.arange(link_rows.shape[0]), j[capped]] = cf[i[capped]]
    link_rows[np.arange(link_rows.shape[0]), i[capped]] += cf[j[capped]]
    program = LinearProgram(
        cost=-np.ones(n),
        matrix=csr_array(np.vstack([traffic, link_rows])),
        rhs=np.concatenate([m.capacity, pair_cap[i, j][capped]]),
        lower=np.zeros(n),
        upper=np.where(m.aggregates, m.capacity, 0.0),
    )
    return solve_lp(program)


def _throughput(m: _Scaled, computes: np.ndarray, rates: np.ndarray) -> Throughput:
    return Throughput(
        compute_bound=float(m.compute[computes].sum()) * m.unit,
        aggregation_bound=float(rates.sum()) * m.unit,
    )


def _shares(rates: np.ndarray) -> np.ndarray:
    """Eq. 6: proportional to each aggregator's return rate."""
    if np.isinf(rates).any():
        return np.isinf(rates).astype(float)
    return rates / rates.sum()


def plan_averaging(problem: AveragingProblem, exact: bool | None = None) -> AveragingPlan:
    """The best plan with binary roles: exact (MILP) up to `EXACT_MAX_PEERS` peers unless
    `exact` says otherwise, else rounded from the relaxation."""
    started = time.perf_counter()
    m = _scale(problem)
    use_milp = m.n <= EXACT_MAX_PEERS if exact is None else exact
    if use_milp:
        candidates = [_milp_roles(m)]
    else:
        ix = _RelaxationIndex(m.n)
        candidates = _rounded_roles(m, solve_lp(_relaxation(m, literal=False))[ix.c])
    solo = _solo_roles(m)
    if solo is not None:
        candidates.append(solo)
    scored = []
    for computes in candidates:
        rates = _best_rates(m, computes)
        throughput = _throughput(m, computes, rates)
        scored.append((throughput.steps_per_second, throughput.aggregation_bound, -len(scored), computes, rates))
    _, _, _, computes, rates = max(scored, key=lambda item: item[:3])
    throughput = _throughput(m, computes, rates)
    shares = _shares(rates)
    roles = tuple(
        PeerRole(name=name, computes_gradients=bool(computes[k]), aggregation_share=float(shares[k]))
        for k, name in enumerate(m.names)
    )
    return AveragingPlan(
        compute_bound=throughput.compute_bound,
        aggregation_bound=throughput.aggregation_bound,
        peers=roles,
        solve_seconds=time.perf_counter() - started,
        method="milp" if use_milp else "rounding",
    )


# --- baselines under the same bandwidths ---------------------------------------------


def _fixed_share_throughput(m: _Scaled, computes: np.ndarray, shares: np.ndarray) -> Throughput:
    """Every peer's traffic per averaged vector is fixed by the shares; the tightest
    peer or link sets the rate."""
    cf = computes.astype(float)
    per_peer = cf * (1 - shares) + (cf.sum() - cf) * shares
    i, j = _pairs(m.n)
    per_link = cf[i] * shares[j] + cf[j] * shares[i]  # i's part to j and i's average back to j
    load = np.concatenate([per_peer, per_link])
    limit = np.concatenate([m.capacity, m.links[i, j]])
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(load > 0, limit / load, np.inf).min()
    return _throughput(m, computes, np.array([rate]))


def all_reduce_baseline(problem: AveragingProblem) -> Throughput:
    """Everyone computes; equal shares over the peers that accept connections, so each
    peer moves 2(n-1)/n of the vector each way when none is in client mode."""
    m = _scale(problem)
    shares = m.aggregates / m.aggregates.sum()
    return _fixed_share_throughput(m, np.ones(m.n, dtype=bool), shares)


def parameter_server_baseline(problem: AveragingProblem) -> Throughput:
    """Everyone computes; the best single non-client peer aggregates the whole vector."""
    m = _scale(problem)
    everyone = np.ones(m.n, dtype=bool)
    options = [
        _fixed_share_throughput(m, everyone, (np.arange(m.n) == server).astype(float))
        for server in np.flatnonzero(m.aggregates)
    ]
    return max(options, key=lambda option: (option.steps_per_second, option.aggregation_bound))
