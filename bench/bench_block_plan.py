"""Block span planner: the worst block's throughput against Petals' own rule, and plan time.

Anchor: Petals' block_selection rule (src/petals/server/block_selection.py) run side by
side on the same swarms: servers join one by one in the swarm's order, each taking the
span whose blocks are worst off (choose_best_blocks), and then, as Petals' servers do,
each checks should_choose_other_blocks (balance_quality 0.75, Petals' default) and
rejoins greedily while told to move. The planner sees every server at once; by
construction it is never below the greedy join, and it reports an upper bound (the
linear relaxation) or a proof of optimality, so the gap to the best possible is known.

Swarms: two families of heterogeneous servers, several sizes, fixed seeds.
  random:  throughput log-uniform over 0.5-8, span length uniform over 1/10-1/2 of the model
  gpu-mix: four GPU kinds (span length follows memory, throughput follows speed, +-15% noise)
Times are per plan, wall clock and CPU (the machine is shared; see the load average).

    PYTHONPATH=services python bench/bench_block_plan.py
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
from bench_results import write_results

from hivekeeper.planning.blocks import (
    DEFAULT_BALANCE_QUALITY,
    DEFAULT_ITERATIONS,
    DEFAULT_NODE_LIMIT,
    ServedSpan,
    Server,
    block_throughput,
    greedy_join,
    plan_blocks,
    rebalance,
)

SIZES = ((8, 24), (16, 48), (32, 80), (64, 100))  # (servers, blocks)
SWARMS = 8  # per family and size
# (throughput, share of the model's blocks that fit in memory) per GPU kind
GPU_KINDS = ((8.0, 0.5), (6.0, 0.25), (3.0, 0.15), (1.0, 0.1))


def random_swarm(rng: np.random.Generator, count: int, num_blocks: int) -> list[Server]:
    return [
        Server(
            f"s{k:02d}",
            float(np.exp(rng.uniform(np.log(0.5), np.log(8)))),
            int(rng.integers(max(1, num_blocks // 10), num_blocks // 2 + 1)),
        )
        for k in range(count)
    ]


def gpu_mix_swarm(rng: np.random.Generator, count: int, num_blocks: int) -> list[Server]:
    servers = []
    for k in range(count):
        throughput, share = GPU_KINDS[int(rng.integers(len(GPU_KINDS)))]
        noisy = throughput * float(rng.uniform(0.85, 1.15))
        servers.append(Server(f"s{k:02d}", noisy, max(1, round(share * num_blocks))))
    return servers


FAMILIES = {"random": random_swarm, "gpu-mix": gpu_mix_swarm}


def worst_block(num_blocks: int, servers: list[Server], starts: list[int]) -> float:
    return float(block_throughput(num_blocks, servers, starts).min())


def run(family: str, count: int, num_blocks: int, seed: int) -> dict:
    servers = FAMILIES[family](np.random.default_rng(seed), count, num_blocks)
    joined = greedy_join(num_blocks, servers)
    greedy = worst_block(num_blocks, servers, [span.start for span in joined])
    moved = rebalance(
        num_blocks, [ServedSpan(s.name, span.start, span.end, s.throughput) for s, span in zip(servers, joined)]
    )
    rebalanced = worst_block(num_blocks, servers, [span.start for span in moved])

    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_blocks(num_blocks, servers)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "family": family,
        "servers": count,
        "blocks": num_blocks,
        "seed": seed,
        "greedy_min": greedy,
        "rebalanced_min": rebalanced,
        "plan_min": plan.min_throughput,
        "upper_bound": plan.upper_bound,
        "optimal": plan.optimal,
        "plan_ms": wall * 1e3,
        "plan_cpu_ms": cpu * 1e3,
    }


def ratios(runs: list[dict], key: str) -> list[float]:
    """plan_min / runs[key], where the baseline covers every block."""
    return [r["plan_min"] / r[key] for r in runs if r[key] > 0]


def summarize(runs: list[dict]) -> list[dict]:
    summary = []
    for family in FAMILIES:
        for count, num_blocks in SIZES:
            at = [r for r in runs if (r["family"], r["servers"], r["blocks"]) == (family, count, num_blocks)]
            vs_greedy, vs_rebalanced = ratios(at, "greedy_min"), ratios(at, "rebalanced_min")
            of_bound = [r["plan_min"] / r["upper_bound"] for r in at if r["upper_bound"] > 0]
            summary.append({
                "family": family,
                "servers": count,
                "blocks": num_blocks,
                "swarms": len(at),
                "greedy_uncovered": sum(r["greedy_min"] <= 0 < r["plan_min"] for r in at),
                "vs_greedy_median": statistics.median(vs_greedy),
                "vs_greedy_worst": min(vs_greedy),
                "vs_rebalanced_median": statistics.median(vs_rebalanced),
                "vs_rebalanced_worst": min(vs_rebalanced),
                "of_bound_median": statistics.median(of_bound),
                "of_bound_worst": min(of_bound),
                "optimal": sum(r["optimal"] for r in at),
                "plan_ms_median": statistics.median(r["plan_ms"] for r in at),
                "plan_ms_max": max(r["plan_ms"] for r in at),
                "plan_cpu_ms_median": statistics.median(r["plan_cpu_ms"] for r in at),
            })
    return summary


def print_table(summary: list[dict]) -> None:
    header = (f"{'family':>8} {'servers':>7} {'blocks':>6} {'swarms':>6} | {'vs greedy':>9} {'worst':>6} | "
              f"{'vs rebal.':>9} {'worst':>6} | {'of bound':>8} {'worst':>6} {'optimal':>7} | "
              f"{'ms med':>7} {'ms max':>7} {'cpu ms':>7}")
    print(header)
    print("-" * len(header))
    for s in summary:
        print(f"{s['family']:>8} {s['servers']:>7} {s['blocks']:>6} {s['swarms']:>6} | "
              f"{s['vs_greedy_median']:>8.3f}x {s['vs_greedy_worst']:>5.3f}x | "
              f"{s['vs_rebalanced_median']:>8.3f}x {s['vs_rebalanced_worst']:>5.3f}x | "
              f"{s['of_bound_median']:>8.1%} {s['of_bound_worst']:>6.1%} {s['optimal']:>4}/{s['swarms']:<2} | "
              f"{s['plan_ms_median']:>7.0f} {s['plan_ms_max']:>7.0f} {s['plan_cpu_ms_median']:>7.0f}")


def main() -> None:
    load = os.getloadavg()
    runs = [
        run(family, count, num_blocks, seed)
        for family in FAMILIES
        for count, num_blocks in SIZES
        for seed in range(SWARMS)
    ]
    summary = summarize(runs)
    print_table(summary)
    worst = min(s["vs_greedy_worst"] for s in summary)
    print(f"\nanchor: Petals' greedy block_selection rule on the same swarms (join order = swarm order; "
          f"rebalanced with balance_quality {DEFAULT_BALANCE_QUALITY}); worst plan/greedy ratio {worst:.3f}; "
          f"'of bound' = plan / linear upper bound; load average {load[0]:.1f} on {os.cpu_count()} cores")
    write_results(
        "block_plan",
        "Petals' block_selection rule (greedy join, then should_choose_other_blocks with "
        f"balance_quality {DEFAULT_BALANCE_QUALITY}) on the same swarms",
        planner={"iterations": DEFAULT_ITERATIONS, "node_limit": DEFAULT_NODE_LIMIT},
        summary=summary,
        runs=runs,
    )


if __name__ == "__main__":
    main()
