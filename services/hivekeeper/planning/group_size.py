"""All-reduce group size under peer failures (DeDLOC appendix C).

Model. n peers average in groups of m (Moshpit / group all-reduce): the peers sit on an
m-ary grid, each round averages within ceil(n / m) groups along one axis, and
ceil(log_m n) rounds give every peer the global average. Each peer fails an attempt
independently with probability p, so a group's attempt succeeds with q = (1 - p)^m; a
failed group restarts, and a round ends when its last group succeeds. One attempt takes
one unit of time whatever m is (each peer of a butterfly all-reduce moves 2(m-1)/m of
the vector), so the expected time to the global average is

    T(m) = ceil(log_m n) * E[max of ceil(n / m) independent Geometric(q)],
    E[max of G Geometric(q)] = sum_{t >= 0} (1 - (1 - (1 - q)^t)^G).

Groups that come out smaller than m when m does not divide n are counted as size m,
which errs towards larger groups never looking better than they are. With p = 0 the
answer is m = n (one global all-reduce, DeDLOC's setting); as p grows, smaller groups win.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["expected_averaging_time", "optimal_group_size"]

_TAIL = 1e-12  # stop summing once P(max > t) falls below this
_CHUNK = 4096


def _rounds(n: int, m: int) -> int:
    """ceil(log_m n) in integers: the smallest d with m^d >= n."""
    rounds, reach = 0, 1
    while reach < n:
        reach *= m
        rounds += 1
    return rounds


def _expected_max_geometric(groups: int, q: float) -> float:
    """E[max of `groups` i.i.d. attempt counts, each attempt succeeding with probability q]:
    1 (every count is at least 1) plus P(max > t) summed over t >= 1."""
    log_miss = math.log1p(-q) if q < 1 else -math.inf
    total, start = 1.0, 1
    while True:
        miss = np.exp(np.arange(start, start + _CHUNK) * log_miss)  # (1 - q)^t
        tail = -np.expm1(groups * np.log1p(-miss))  # 1 - (1 - (1 - q)^t)^G
        total += float(tail.sum())
        if tail[-1] < _TAIL:
            return total
        start += _CHUNK


def expected_averaging_time(n: int, m: int, p: float) -> float:
    """Expected attempts until all n peers hold the global average with groups of m."""
    if n <= 1:
        return 0.0
    q = (1 - p) ** m
    if q == 0:
        return math.inf
    return _rounds(n, m) * _expected_max_geometric(math.ceil(n / m), q)


def optimal_group_size(n: int, p: float) -> int:
    """The m in 2..n minimizing `expected_averaging_time`; ties go to the larger m (fewer
    rounds). T(m) >= ceil(log_m n) / q, which skips hopeless sizes before summing."""
    if not 0 <= p < 1:
        raise ValueError(f"failure probability must be in [0, 1), got {p}")
    if n <= 2:
        return max(n, 1)
    best_m, best_time = 2, math.inf
    for m in range(2, n + 1):
        q = (1 - p) ** m
        if q == 0 or _rounds(n, m) / q > best_time:
            continue
        time = expected_averaging_time(n, m, p)
        if time <= best_time:
            best_m, best_time = m, time
    return best_m
