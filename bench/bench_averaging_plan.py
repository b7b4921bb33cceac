"""Averaging planner: solve time against the number of peers, and what rounding loses.

Anchor: DeDLOC (section 3.2, footnote) solves its LP in under 50 ms, about twice a
minute. Aim here: a plan for n = 64 well under 50 ms and for n = 256 under 1 s on 2 cores.

Timing: for each n, a few random heterogeneous swarms (log-normal compute and
bandwidth, a quarter of the peers without an accelerator, a fifth in client mode) are
planned with the default method (exact MILP up to EXACT_MAX_PEERS peers, else rounding),
and for comparison with the exact MILP (up to 64 peers), with rounding, and with eq. 5,
the paper's relaxation (compact O(n^2) form up to 64 peers, literal O(n^3) form up to 32).
Medians over the swarms, wall clock and CPU (the machine is shared).

Gap: more swarms, half of them with random link caps, planned exactly and by rounding;
steps/s lost by rounding, and how far eq. 5's bound lies above the best realizable plan.

    PYTHONPATH=services python bench/bench_averaging_plan.py
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, TypeVar

import numpy as np
from bench_results import write_results

from hivekeeper.planning.averaging_lp import (
    EXACT_MAX_PEERS,
    AveragingProblem,
    PeerCapacity,
    all_reduce_baseline,
    literal_relaxation_lp,
    parameter_server_baseline,
    plan_averaging,
    relaxation_lp,
    solve_lp,
    solve_relaxation,
)

SIZES = (8, 16, 32, 64, 128, 256)
REPEATS = 3
MILP_MAX = 64
EQ5_MAX = 64  # eq. 5 has 2 n^2 variables: seconds at 64 peers, tens of seconds at 128
LITERAL_MAX = 32
GAP_SIZES = (8, 16, 32)
GAP_SWARMS = 10

T = TypeVar("T")


def swarm(n: int, seed: int, link_share: float = 0.0) -> AveragingProblem:
    rng = np.random.default_rng(seed)
    peers = []
    for k in range(n):
        samples = float(rng.lognormal(3, 1)) if k == 0 or rng.random() < 0.75 else 0.0
        upload = float(rng.lognormal(4.5, 1.2))  # median ~90 Mbps
        download = upload * float(rng.uniform(1, 4))
        peers.append(PeerCapacity(f"peer-{k:03d}", samples, upload, download, bool(k > 0 and rng.random() < 0.2)))
    links: dict[str, dict[str, float]] = {}
    for a in peers:
        for b in peers:
            if a is not b and rng.random() < link_share:
                links.setdefault(a.name, {})[b.name] = float(rng.uniform(5, 100))
    return AveragingProblem(target_batch_size=4096, num_parameters=20_000_000, peers=peers, links=links)


def timed(run: Callable[[], T]) -> tuple[T, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def timing_run(n: int, seed: int) -> dict:
    problem = swarm(n, seed)
    plan, plan_ms, plan_cpu_ms = timed(lambda: plan_averaging(problem))
    _, rounding_ms, _ = timed(lambda: plan_averaging(problem, exact=False))
    run = {
        "n": n,
        "seed": seed,
        "method": plan.method,
        "plan_ms": plan_ms,
        "plan_cpu_ms": plan_cpu_ms,
        "rounding_ms": rounding_ms,
        "steps_per_second": plan.steps_per_second,
        "vs_all_reduce": plan.steps_per_second / all_reduce_baseline(problem).steps_per_second,
        "vs_parameter_server": plan.steps_per_second / parameter_server_baseline(problem).steps_per_second,
    }
    if n <= MILP_MAX:
        _, run["milp_ms"], _ = timed(lambda: plan_averaging(problem, exact=True))
    if n <= EQ5_MAX:
        _, run["eq5_ms"], _ = timed(lambda: solve_relaxation(problem))
    if n <= LITERAL_MAX:
        literal = literal_relaxation_lp(problem)
        _, run["literal_ms"], _ = timed(lambda: solve_lp(literal))
        run["literal_rows"], run["compact_rows"] = literal.num_rows, relaxation_lp(problem).num_rows
    return run


def gap_run(n: int, seed: int) -> dict:
    problem = swarm(n, 1000 + seed, link_share=0.1 if seed % 2 else 0.0)
    exact, rounded = plan_averaging(problem, exact=True), plan_averaging(problem, exact=False)
    return {
        "n": n,
        "seed": seed,
        "links": bool(problem.links),
        "milp_proven": exact.method == "milp",
        "rounding_gap": 1 - rounded.steps_per_second / exact.steps_per_second,
        "eq5_over_exact": solve_relaxation(problem).steps_per_second / exact.steps_per_second,
    }


def median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if key in run]
    return statistics.median(values) if values else None


def timing_summary(runs: list[dict]) -> list[dict]:
    keys = ("plan_ms", "plan_cpu_ms", "rounding_ms", "milp_ms", "eq5_ms", "literal_ms", "literal_rows",
            "compact_rows", "vs_all_reduce", "vs_parameter_server")
    return [
        {"n": n, "method": at_n[0]["method"], **{key: median(at_n, key) for key in keys}}
        for n in SIZES
        for at_n in [[run for run in runs if run["n"] == n]]
    ]


def gap_summary(runs: list[dict]) -> list[dict]:
    summary = []
    for n in GAP_SIZES:
        at_n = [run for run in runs if run["n"] == n]
        gaps = [run["rounding_gap"] for run in at_n]
        ratios = [run["eq5_over_exact"] for run in at_n]
        summary.append({
            "n": n,
            "swarms": len(at_n),
            "all_proven": all(run["milp_proven"] for run in at_n),
            "rounding_gap_mean": statistics.mean(gaps),
            "rounding_gap_max": max(gaps),
            "rounding_matches": sum(abs(gap) < 1e-9 for gap in gaps),
            "eq5_over_exact_median": statistics.median(ratios),
            "eq5_over_exact_max": max(ratios),
        })
    return summary


def cell(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{fmt}}"


def percent(value: float) -> str:
    return f"{round(value, 9) + 0.0:.2%}"  # -4e-16 prints as 0.00%


def print_tables(timing: list[dict], gaps: list[dict]) -> None:
    header = (f"{'n':>4} {'method':>8} {'plan ms':>8} {'cpu ms':>7} {'round ms':>8} {'milp ms':>8} "
              f"{'eq5 ms':>8} {'lit ms':>8} {'rows lit/cmp':>13} {'vs AR':>6} {'vs PS':>6}")
    print(header)
    print("-" * len(header))
    for s in timing:
        rows = "-" if s["literal_rows"] is None else f"{s['literal_rows']:.0f}/{s['compact_rows']:.0f}"
        print(f"{s['n']:>4} {s['method']:>8} {cell(s['plan_ms'], '.1f', 8)} {cell(s['plan_cpu_ms'], '.1f', 7)} "
              f"{cell(s['rounding_ms'], '.1f', 8)} {cell(s['milp_ms'], '.1f', 8)} {cell(s['eq5_ms'], '.1f', 8)} "
              f"{cell(s['literal_ms'], '.1f', 8)} {rows:>13} {cell(s['vs_all_reduce'], '.2f', 6)} "
              f"{cell(s['vs_parameter_server'], '.2f', 6)}")
    print()
    header = (f"{'n':>4} {'swarms':>6} {'rounding = MILP':>15} {'gap mean':>9} {'gap max':>8} "
              f"{'eq5/exact med':>13} {'max':>6}")
    print(header)
    print("-" * len(header))
    for s in gaps:
        print(f"{s['n']:>4} {s['swarms']:>6} {s['rounding_matches']:>15} {percent(s['rounding_gap_mean']):>9} "
              f"{percent(s['rounding_gap_max']):>8} {s['eq5_over_exact_median']:>13.2f} "
              f"{s['eq5_over_exact_max']:>6.2f}")


def main() -> None:
    load = os.getloadavg()
    timing_runs = [timing_run(n, seed) for n in SIZES for seed in range(REPEATS)]
    gap_runs = [gap_run(n, seed) for n in GAP_SIZES for seed in range(GAP_SWARMS)]
    timing, gaps = timing_summary(timing_runs), gap_summary(gap_runs)
    print_tables(timing, gaps)
    at = {s["n"]: s["plan_ms"] for s in timing}
    print(f"\nanchor: DeDLOC solves in < 50 ms; plan here: n=64 {at[64]:.1f} ms, n=256 {at[256]:.1f} ms "
          f"(exact MILP up to {EXACT_MAX_PEERS} peers); load average {load[0]:.1f} on {os.cpu_count()} cores")
    write_results(
        "averaging_plan",
        "DeDLOC: LP solved in under 50 ms, about twice a minute; aim n=64 well under 50 ms, n=256 under 1 s",
        exact_max_peers=EXACT_MAX_PEERS,
        timing=timing,
        gap=gaps,
        timing_runs=timing_runs,
        gap_runs=gap_runs,
    )


if __name__ == "__main__":
    main()
