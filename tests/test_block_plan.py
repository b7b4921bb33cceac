"""Petals block selection (greedy join, should_move) and the global span planner behind
`hivekeeper plan blocks`."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import yaml

from hivekeeper.cli import main
from hivekeeper.planning.blocks import (
    ServedSpan,
    Server,
    block_throughput,
    choose_best_start,
    greedy_join,
    plan_blocks,
    rebalance,
    should_move,
)


def random_servers(rng: np.random.Generator, count: int, num_blocks: int) -> list[Server]:
    """Heterogeneous GPUs: throughput log-uniform over 16x, spans of 1/10 to 1/2 of the model."""
    return [
        Server(
            f"s{k:02d}",
            float(np.exp(rng.uniform(np.log(0.5), np.log(8)))),
            int(rng.integers(max(1, num_blocks // 10), num_blocks // 2 + 1)),
        )
        for k in range(count)
    ]


def greedy_min(num_blocks: int, servers: list[Server]) -> float:
    spans = greedy_join(num_blocks, servers)
    return float(block_throughput(num_blocks, servers, [span.start for span in spans]).min())


def brute_force_min(num_blocks: int, servers: list[Server]) -> float:
    options = [range(num_blocks - min(s.span_length, num_blocks) + 1) for s in servers]
    return max(float(block_throughput(num_blocks, servers, starts).min()) for starts in itertools.product(*options))


def served(num_blocks: int, servers: list[Server], starts: list[int]) -> list[ServedSpan]:
    return [
        ServedSpan(s.name, start, start + min(s.span_length, num_blocks), s.throughput)
        for s, start in zip(servers, starts)
    ]


# --- Petals' greedy rule ---------------------------------------------------------------


def test_greedy_rule_picks_the_span_holding_the_weakest_blocks():
    # Start 3 has the smallest total, but start 0 holds the one uncovered block: Petals fills it.
    assert choose_best_start(np.array([0.0, 5, 5, 1, 1, 1]), 3) == 0
    # Then the next weakest: both windows hold a 1, only [1, 1] has two of them.
    assert choose_best_start(np.array([3.0, 1, 3, 1, 1, 3]), 2) == 3
    # Ties go to the lowest start.
    assert choose_best_start(np.zeros(8), 3) == 0
    assert choose_best_start(np.array([2.0, 1, 2, 2, 1, 2]), 1) == 1


def test_joining_servers_fill_uncovered_blocks_first():
    servers = [Server(f"s{k}", 1.0, 3) for k in range(4)]
    spans = greedy_join(12, servers)
    assert [(span.start, span.end) for span in spans] == [(0, 3), (3, 6), (6, 9), (9, 12)]


# --- should_move (Petals' should_choose_other_blocks) -----------------------------------


def test_balanced_swarm_stays_put():
    servers = [Server(f"s{k}", 1.0, 4) for k in range(4)]
    spans = served(8, servers, [0, 4, 0, 4])
    assert not any(should_move(8, spans, s.name) for s in servers)


def test_server_moves_to_close_a_gap():
    # Blocks 6 and 7 are uncovered; a or c (both on 0-3) can take 4-7 without uncovering anything.
    servers = [Server("a", 1.0, 4), Server("b", 1.0, 2), Server("c", 1.0, 4)]
    spans = served(8, servers, [0, 4, 0])
    assert should_move(8, spans, "c")
    assert should_move(8, spans, "a")


def test_server_that_alone_covers_blocks_never_leaves():
    # Moving b, c or d onto blocks 0-1 doubles the minimum; moving a would uncover them.
    servers = [Server("a", 1.0, 2), Server("b", 1.0, 2), Server("c", 1.0, 2), Server("d", 1.0, 2)]
    spans = served(4, servers, [0, 2, 2, 2])
    assert not should_move(4, spans, "a")
    assert should_move(4, spans, "b")


def test_balance_quality_is_the_threshold_on_old_over_new_minimum():
    # z moving from block 1 to block 0 lifts the minimum from 4 to 5: quality 0.8.
    servers = [Server("x", 4.0, 1), Server("y", 5.0, 1), Server("z", 1.0, 1)]
    spans = served(2, servers, [0, 1, 1])
    assert not should_move(2, spans, "z", balance_quality=0.75)
    assert should_move(2, spans, "z", balance_quality=0.9)
    assert not should_move(2, spans, "x", balance_quality=0.9)  # x is at its best place already
    assert should_move(2, spans, "x", balance_quality=1.5)  # > 1 forces a move, as in Petals
    with pytest.raises(ValueError, match="holds no span"):
        should_move(2, spans, "nobody")


# --- the global planner -----------------------------------------------------------------


def test_plan_is_never_below_the_greedy_rule_on_random_swarms():
    ratios = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        num_blocks = int(rng.integers(4, 41))
        servers = random_servers(rng, int(rng.integers(2, 15)), num_blocks)
        # Smaller search budgets than the defaults keep the test fast; the guarantee does not depend on them.
        plan = plan_blocks(num_blocks, servers, iterations=4000, node_limit=4000)
        baseline = greedy_min(num_blocks, servers)

        assert plan.min_throughput >= baseline * (1 - 1e-9)
        assert plan.upper_bound >= plan.min_throughput
        assert [a.name for a in plan.assignments] == [s.name for s in servers]
        for server, a in zip(servers, plan.assignments):
            assert 0 <= a.start and a.end <= num_blocks and a.end - a.start == min(server.span_length, num_blocks)
        load = block_throughput(num_blocks, servers, [a.start for a in plan.assignments])
        assert np.allclose(plan.block_throughput, load) and plan.min_throughput == pytest.approx(load.min())
        if baseline > 0:
            ratios.append(plan.min_throughput / baseline)
    assert np.median(ratios) > 1.05  # and usually clearly better


def test_plan_is_exact_on_small_swarms():
    rng = np.random.default_rng(2024)
    for _ in range(30):
        num_blocks = int(rng.integers(1, 8))
        count = int(rng.integers(1, 5))
        servers = [
            Server(f"s{k}", float(rng.choice([1.0, 2.0, rng.uniform(0.5, 4)])), int(rng.integers(1, num_blocks + 2)))
            for k in range(count)
        ]
        plan = plan_blocks(num_blocks, servers)
        assert plan.min_throughput == pytest.approx(brute_force_min(num_blocks, servers), rel=1e-9)
        assert plan.optimal and plan.upper_bound == plan.min_throughput


def test_after_the_worst_block_the_next_worst_is_raised():
    # One full-length server, two one-block servers: some block keeps 1 whatever happens,
    # but spreading the small servers leaves [1, 2, 2] rather than [1, 1, 3].
    servers = [Server("full", 1.0, 3), Server("b", 1.0, 1), Server("c", 1.0, 1)]
    plan = plan_blocks(3, servers)
    assert sorted(plan.block_throughput) == [1.0, 2.0, 2.0]


def test_plans_are_deterministic():
    rng = np.random.default_rng(7)
    servers = random_servers(rng, 16, 40)
    assert plan_blocks(40, servers, iterations=3000) == plan_blocks(40, servers, iterations=3000)


def test_swarm_heals_after_servers_leave():
    num_blocks = 24
    servers = [Server(f"s{k:02d}", 1.0 + k % 3, 6) for k in range(12)]
    plan = plan_blocks(num_blocks, servers)
    assert plan.min_throughput > 0 and plan.optimal  # homogeneous enough to meet the linear bound

    # Everyone holding block 0 leaves: the survivors' spans leave a gap ...
    gone = {a.name for a in plan.assignments if a.start == 0}
    survivors = [s for s in servers if s.name not in gone]
    starts = [a.start for a in plan.assignments if a.name not in gone]
    assert block_throughput(num_blocks, survivors, starts).min() == 0
    assert sum(s.span_length for s in survivors) >= num_blocks  # ... that their capacity can cover

    # The planner covers every block again, and so does Petals' rule, server by server.
    assert plan_blocks(num_blocks, survivors).min_throughput > 0
    healed = rebalance(num_blocks, served(num_blocks, survivors, starts))
    assert block_throughput(num_blocks, survivors, [span.start for span in healed]).min() > 0


def test_planner_rejects_impossible_input():
    with pytest.raises(ValueError):
        plan_blocks(0, [Server("a", 1.0, 1)])
    with pytest.raises(ValueError):
        plan_blocks(4, [Server("a", 1.0, 0)])


# --- `hivekeeper plan blocks` -----------------------------------------------------------


def test_cli_prints_the_plan_as_json(tmp_path, capsys):
    source = {
        "numBlocks": 24,
        "servers": [
            {"name": "a100-1", "throughput": 8, "spanLength": 12},
            {"name": "a100-2", "throughput": 8, "spanLength": 12},
            {"name": "3090-1", "throughput": 5, "spanLength": 10},
            {"name": "3090-2", "throughput": 5, "spanLength": 10},
            {"name": "t4-1", "throughput": 2, "spanLength": 6},
            {"name": "t4-2", "throughput": 2, "spanLength": 30},  # clipped to 24
        ],
    }
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump(source))

    assert main(["plan", "blocks", "--input", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    assert [a["name"] for a in report["assignments"]] == [s["name"] for s in source["servers"]]
    for server, a in zip(source["servers"], report["assignments"]):
        assert a["end"] - a["start"] == min(server["spanLength"], 24) and 0 <= a["start"] and a["end"] <= 24
    expected = np.zeros(24)
    for server, a in zip(source["servers"], report["assignments"]):
        expected[a["start"] : a["end"]] += server["throughput"]
    assert report["blockThroughput"] == pytest.approx(expected.tolist())
    assert report["minThroughput"] == pytest.approx(expected.min())
    assert report["minThroughput"] >= report["baselines"]["greedyJoin"]["minThroughput"]
    assert report["optimal"] and report["upperBound"] == report["minThroughput"]


def test_cli_prints_a_table(tmp_path, capsys):
    path = tmp_path / "servers.json"
    path.write_text(json.dumps({"numBlocks": 4, "servers": [{"name": "only", "throughput": 3, "spanLength": 4}]}))
    assert main(["plan", "blocks", "--input", str(path)]) == 0
    out = capsys.readouterr().out
    assert "only" in out and "0-3" in out and "optimal" in out


@pytest.mark.parametrize(
    ("servers", "message"),
    [
        ([{"name": "a", "throughput": 1, "spanLength": 0}], "servers.0.spanLength"),
        ([{"name": "a", "throughput": 1, "spanLength": 2, "gpu": "A100"}], "servers.0.gpu: unknown field"),
        ([{"name": "a", "throughput": 1, "spanLength": 2}] * 2, "servers.1.name: duplicate server name 'a'"),
        ([], "servers"),
    ],
)
def test_cli_rejects_bad_input_with_one_line_and_exit_2(tmp_path, capsys, servers, message):
    path = tmp_path / "servers.yaml"
    path.write_text(yaml.safe_dump({"numBlocks": 8, "servers": servers}))
    assert main(["plan", "blocks", "--input", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1
