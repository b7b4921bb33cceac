"""`hivekeeper plan blocks --input FILE [--json]`: one contiguous span of transformer
blocks per server, maximizing the worst block's throughput, against Petals' greedy join."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field
from rich.console import Console
from rich.table import Table

from hivekeeper.errors import UserError
from hivekeeper.inputs import load_input
from hivekeeper.planning.blocks import BlockPlan, Server, block_throughput, greedy_join, plan_blocks
from hivekeeper.spec.base import SpecModel

# Real models have a few hundred blocks at most; the caps keep a typo from hanging the planner.
MAX_BLOCKS = 1000
MAX_SERVERS = 1000


class ServerInput(SpecModel):
    name: str = Field(min_length=1)
    throughput: float = Field(ge=0, allow_inf_nan=False)  # e.g. tokens/s or requests/s; one unit for all
    span_length: int = Field(ge=1)  # blocks the server can hold; clipped to numBlocks


class BlocksInput(SpecModel):
    num_blocks: int = Field(ge=1, le=MAX_BLOCKS)
    servers: list[ServerInput] = Field(min_length=1, max_length=MAX_SERVERS)


def _read(path: str) -> BlocksInput:
    spec = load_input(path, BlocksInput)
    seen: set[str] = set()
    for k, server in enumerate(spec.servers):
        if server.name in seen:
            raise UserError(f"{path}: servers.{k}.name: duplicate server name {server.name!r}")
        seen.add(server.name)
    return spec


def _report(spec: BlocksInput, servers: list[Server], plan: BlockPlan) -> dict[str, Any]:
    greedy = greedy_join(spec.num_blocks, servers)
    greedy_load = block_throughput(spec.num_blocks, servers, [span.start for span in greedy])
    return {"assignments": [{"name": a.name, "start": a.start, "end": a.end} for a in plan.assignments],
            "blockThroughput": list(plan.block_throughput), "minThroughput": plan.min_throughput,
            "upperBound": plan.upper_bound, "optimal": plan.optimal,
            "baselines": {"greedyJoin": {"minThroughput": float(greedy_load.min())}}}


def _runs(values: list[float]) -> list[tuple[int, int, float]]:
    """(first, last, value) for each run of equal consecutive values."""
    runs: list[tuple[int, int, float]] = []
    for block, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], block, value)
        else:
            runs.append((block, block, value))
    return runs


def _print_tables(spec: BlocksInput, report: dict[str, Any]) -> None:
    console = Console()
    spans = Table(title=f"Block spans ({spec.num_blocks} blocks)")
    for column in ("server", "throughput", "span length", "blocks"):
        spans.add_column(column, justify="left" if column == "server" else "right")
    for server, a in zip(spec.servers, report["assignments"]):
        spans.add_row(a["name"], f"{server.throughput:g}", str(a["end"] - a["start"]), f"{a['start']}-{a['end'] - 1}")
    console.print(spans)

    blocks = Table("blocks", title="Throughput per block")
    blocks.add_column("throughput", justify="right")
    for first, last, value in _runs(report["blockThroughput"]):
        blocks.add_row(str(first) if first == last else f"{first}-{last}", f"{value:.4g}")
    console.print(blocks)

    ours, greedy = report["minThroughput"], report["baselines"]["greedyJoin"]["minThroughput"]
    versus = f"{ours / greedy:.2f}x" if greedy > 0 else "greedy leaves a block uncovered"
    proof = "optimal" if report["optimal"] else f"upper bound {report['upperBound']:.4g}"
    console.print(f"worst block {ours:.4g} ({proof}); Petals' greedy join {greedy:.4g} ({versus})")


def run_plan_blocks(input_path: str, as_json: bool) -> int:
    spec = _read(input_path)
    servers = [Server(s.name, s.throughput, s.span_length) for s in spec.servers]
    report = _report(spec, servers, plan_blocks(spec.num_blocks, servers))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_tables(spec, report)
    return 0
