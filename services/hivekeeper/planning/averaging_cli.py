"""`hivekeeper plan averaging --input FILE [--json]`: the averaging plan of a swarm
described in a YAML or JSON file, against all-reduce and a parameter server."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

from pydantic import Field

from hivekeeper.errors import UserError
from hivekeeper.inputs import InputModel, load_input
from hivekeeper.planning.averaging_lp import (AveragingPlan, AveragingProblem, PeerCapacity, Throughput,
                                              all_reduce_baseline, parameter_server_baseline, plan_averaging)
from hivekeeper.planning.group_size import optimal_group_size
from hivekeeper.planning.step_time import FixedCosts, predict_step

Mbps = Annotated[float, Field(gt=0)]
RICH_MAX_ROWS = 200  # rich lays a table out at about 1 ms a row; larger swarms get plain columns


class PeerInput(InputModel):
    name: str = Field(min_length=1)
    samples_per_second: float = Field(ge=0)
    upload_mbps: Mbps
    download_mbps: Mbps
    client_mode: bool = False


class DilocoInput(InputModel):
    """Replicas that take DiLoCo outer steps (averaging.mode diloco) instead of gradient rounds."""

    inner_steps: int = Field(ge=1, description="H: local steps between outer rounds")
    batch_size: int = Field(ge=1, description="each replica's local batch")
    overlap: bool = Field(False, description="the outer all-reduce runs during the next inner steps")


class FixedSecondsInput(InputModel):
    """What a step costs beyond compute and transfer, in seconds (a running swarm's balancer
    measures these: `hivekeeper_plan_step_seconds`)."""

    lag: float = Field(0.0, ge=0, description="until peers see that the global batch is complete")
    wait: float = Field(0.0, ge=0, description="from a peer's trigger to its all-reduce")
    round_trips: float = Field(0.0, ge=0, description="the all-reduce's time beyond its bytes")
    after: float = Field(0.0, ge=0, description="the optimizer step and the rest of a step")


class AveragingInput(InputModel):
    target_batch_size: int = Field(gt=0)
    num_parameters: int = Field(gt=0)
    bytes_per_parameter: float = Field(default=4.0, gt=0)
    failure_probability: float = Field(default=0.0, ge=0, lt=1)  # per peer and attempt (group size)
    peers: list[PeerInput] = Field(min_length=1)
    links: dict[str, dict[str, Mbps]] = Field(default_factory=dict)
    diloco: Optional[DilocoInput] = None  # also predict DiLoCo's outer rounds on these peers
    fixed_seconds: Optional[FixedSecondsInput] = None  # predict whole steps (planning/step_time.py)
    overlap: bool = False  # delayed parameter updates: a round runs while the next batch computes


def _load(path: str) -> AveragingInput:
    """The input, with what pydantic cannot see field by field checked too (one line naming the field, like it)."""
    spec = load_input(path, AveragingInput)
    seen: set[str] = set()
    for k, peer in enumerate(spec.peers):
        if peer.name in seen:
            raise UserError(f"{path}: peers.{k}.name: duplicate peer name {peer.name!r}")
        seen.add(peer.name)
    if not any(peer.samples_per_second > 0 for peer in spec.peers):
        raise UserError(f"{path}: peers: no peer has samplesPerSecond > 0")
    if all(peer.client_mode for peer in spec.peers):
        raise UserError(f"{path}: peers: every peer is in clientMode, so none can aggregate")
    for src, row in spec.links.items():
        for name in (src, *row):
            if name not in seen:
                raise UserError(f"{path}: links.{src}: unknown peer {name!r}")
        if src in row:
            raise UserError(f"{path}: links.{src}.{src}: a peer has no link to itself")
    return spec


def _rates(throughput: Throughput, fixed: Optional[FixedCosts] = None, overlap: bool = False) -> dict[str, Any]:
    """The LP's steps/s and averaging time; with fixed costs, also the whole step's prediction."""
    rates: dict[str, Any] = {"stepsPerSecond": throughput.steps_per_second,
                             "averagingSeconds": throughput.averaging_seconds}
    if fixed is not None:
        step = predict_step(throughput.compute_bound, throughput.aggregation_bound, fixed, overlap)
        rates.update(predictedStepsPerSecond=step.steps_per_second, step=step.to_json())
    return rates


def _fixed(spec: AveragingInput) -> Optional[FixedCosts]:
    f = spec.fixed_seconds
    return None if f is None else FixedCosts(lag=f.lag, wait=f.wait, round_trips=f.round_trips, after=f.after)


def _report(spec: AveragingInput, plan: AveragingPlan, group_size: int,
            baselines: dict[str, Throughput]) -> dict[str, Any]:
    roles = {role.name: role for role in plan.peers}
    fixed = _fixed(spec)
    return {
        **_rates(plan, fixed, spec.overlap),
        "peers": [{"name": peer.name, "computesGradients": roles[peer.name].computes_gradients,
                   "aggregationShare": roles[peer.name].aggregation_share} for peer in spec.peers],  # the input's order
        "groupSize": group_size,
        "solveSeconds": plan.solve_seconds,
        "method": plan.method,
        "baselines": {name: _rates(throughput, fixed, spec.overlap) for name, throughput in baselines.items()},
    }


def _plain_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Aligned columns, the first to the left: what rich draws, without its per-cell layout."""
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows)]
    lines = ["  ".join(cell.ljust(width) if k == 0 else cell.rjust(width)
                       for k, (cell, width) in enumerate(zip(line, widths))) for line in (columns, *rows)]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join([title, *lines])


def _print_table(spec: AveragingInput, report: dict[str, Any]) -> None:
    from rich.console import Console  # not for --json
    from rich.table import Table

    console = Console()
    columns = ("peer", "samples/s", "up Mbps", "down Mbps", "computes", "share")
    rows = [(f"{peer.name} (client)" if peer.client_mode else peer.name, f"{peer.samples_per_second:g}",
             f"{peer.upload_mbps:g}", f"{peer.download_mbps:g}", "yes" if role["computesGradients"] else "no",
             f"{role['aggregationShare']:.1%}") for peer, role in zip(spec.peers, report["peers"])]
    if len(rows) > RICH_MAX_ROWS:
        console.out(_plain_table(f"Averaging plan ({len(rows)} peers)", columns, rows), highlight=False)
    else:
        table = Table(title="Averaging plan")
        for column in columns:
            table.add_column(column, justify="left" if column == "peer" else "right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    strategies = Table(show_header=True)
    for column in ("strategy", "steps/s", "averaging s", "plan speedup"):
        strategies.add_column(column, justify="left" if column == "strategy" else "right")
    key = "predictedStepsPerSecond" if "step" in report else "stepsPerSecond"  # with fixed costs: whole steps
    ours = report[key]
    rows = [("this plan", report), *((name, rates) for name, rates in report["baselines"].items())]
    for name, rates in rows:
        steps, seconds = rates[key], rates["averagingSeconds"]
        strategies.add_row(name, f"{steps:.4g}", f"{seconds:.3g}", f"{ours / steps:.2f}x")
    console.print(strategies)
    if "step" in report:
        step = report["step"]
        console.print(f"a step {step['seconds']:.4g} s: compute {step['compute']:.4g} + transfer "
                      f"{step['transfer']:.4g} + fixed {sum(step['fixed'].values()):.4g} s "
                      f"({', '.join(f'{k} {v:.3g}' for k, v in step['fixed'].items())})"
                      + (", the round overlapping the next batch" if step["overlap"] else ""), highlight=False,
                      soft_wrap=True)
    console.print(f"group size {report['groupSize']} of {len(spec.peers)} peers; "
                  f"solved by {report['method']} in {report['solveSeconds'] * 1e3:.1f} ms")


def outer_rounds(spec: AveragingInput, problem: AveragingProblem, plan: AveragingPlan) -> dict[str, Any]:
    """DiLoCo on the same peers: every computing peer is a replica; at each boundary the replicas
    wait for the slowest one's H steps, then all-reduce one vector (hivemind's split, about equal
    shares: the all-reduce baseline's time), after the inner steps or, with overlap, during them."""
    diloco = spec.diloco
    rates = [peer.samples_per_second for peer in spec.peers if peer.samples_per_second > 0]
    compute = diloco.inner_steps * diloco.batch_size / min(rates)
    all_reduce = all_reduce_baseline(problem)
    averaging = 0.0 if len(rates) == 1 else all_reduce.averaging_seconds
    seconds = max(compute, averaging) if diloco.overlap else compute + averaging
    samples = len(rates) * diloco.inner_steps * diloco.batch_size / seconds
    n = len(spec.peers)
    return {"innerSteps": diloco.inner_steps, "replicas": len(rates), "computeSeconds": compute,
            "averagingSeconds": averaging, "secondsPerOuterRound": seconds, "samplesPerSecond": samples,
            "gradientModeSamplesPerSecond": plan.steps_per_second * spec.target_batch_size,
            "bytesPerReplicaPerRound": 2 * (n - 1) / n * spec.num_parameters * spec.bytes_per_parameter}


def _print_outer_rounds(rounds: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(
        f"DiLoCo: {rounds['replicas']} replicas, an outer round every {rounds['innerSteps']} inner steps: "
        f"{rounds['computeSeconds']:.3g} s computing + {rounds['averagingSeconds']:.3g} s averaging "
        f"-> {rounds['secondsPerOuterRound']:.3g} s a round, {rounds['samplesPerSecond']:.4g} samples/s "
        f"(gradient averaging under this plan: {rounds['gradientModeSamplesPerSecond']:.4g}); "
        f"{rounds['bytesPerReplicaPerRound'] / 1e6:.3g} MB sent per replica a round", highlight=False)


def run_plan_averaging(input_path: str, as_json: bool) -> int:
    spec = _load(input_path)
    problem = AveragingProblem(
        target_batch_size=spec.target_batch_size, num_parameters=spec.num_parameters,
        bytes_per_parameter=spec.bytes_per_parameter, links=spec.links,
        peers=[PeerCapacity(p.name, p.samples_per_second, p.upload_mbps, p.download_mbps, p.client_mode)
               for p in spec.peers])
    plan = plan_averaging(problem)
    baselines = {"allReduce": all_reduce_baseline(problem), "parameterServer": parameter_server_baseline(problem)}
    group_size = optimal_group_size(len(spec.peers), spec.failure_probability)
    report = _report(spec, plan, group_size, baselines)
    if spec.diloco is not None:
        report["outerRounds"] = outer_rounds(spec, problem, plan)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(spec, report)
        if spec.diloco is not None:
            _print_outer_rounds(report["outerRounds"])
    return 0
