"""What one collaborative step costs: the averaging LP's compute and transfer, plus what does
not scale with the vector.

DeDLOC's LP (`averaging_lp`) maximizes min(compute rate, aggregation rate): it assumes a step's
computing and averaging overlap fully and that moving the vector is all an averaging round
costs. On a small model the rest dominates: a peer first learns that the collaboration has
its batch, the round waits for the group and for its last member, the all-reduce pays round
trips on top of its bytes, and the optimizer step follows. Peers measure those parts
(`planning/step_clock.py`); this module adds them to the LP's figures:

    step = compute + transfer + fixed                    (hivemind's default: a step averages,
                                                          then steps, then computes again)
    step = max(compute + lag, transfer + wait + round trips) + after
                                                         (delayed parameter updates: the round
                                                          runs while the next batch computes)

with compute = B / (sum of the computing peers' samples/s), transfer = the plan's averaging
time (of the gradients), and fixed = lag + wait + round trips + after, each the median over the computing peers:

- lag: accumulation beyond B / S, the time until a peer sees that the global batch is complete;
- wait: from a peer's trigger to its all-reduce (the group forming, groupmates' last batches);
- round trips: the all-reduce's time beyond its bytes at the measured rates, with the parameter
  round that follows the gradient round on its group (`averageStateEvery`). The LP's vector is
  the gradients' alone: counting the parameters as a second vector makes the plans that leave
  one trainer computing alone, and need no round, look faster, and every role switch costs a
  state reload;
- after: the rest of the step (the optimizer step).

Roles. The LP's objective, min(compute rate, aggregation rate), assumes a step's compute and
averaging overlap, and among its ties it may take a computing peer out to aggregate only (on the
demo, two of three trainers), so that steps wait for fewer samples, and every switch back costs
a state reload. A step without delayed updates does
one after the other, so once the fixed costs are measured `plan_whole_steps` keeps the LP's
plan only if it makes clearly more whole steps (by the balancer's `drift`) than the plan in which
every peer with samples computes (shares re-solved for those roles); the LP itself is unchanged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from hivekeeper.planning.averaging_lp import AveragingPlan, AveragingProblem, Throughput, plan_averaging, plan_for_roles
from hivekeeper.planning.step_clock import StepPhases

__all__ = ["FixedCosts", "StepTime", "fixed_costs", "plan_whole_steps", "predict_step", "whole_steps_per_second"]

FIXED_PARTS = ("lag", "wait", "roundTrips", "after")


@dataclass(frozen=True)
class FixedCosts:
    lag: float = 0.0
    wait: float = 0.0
    round_trips: float = 0.0
    after: float = 0.0

    @property
    def total(self) -> float:
        return self.lag + self.wait + self.round_trips + self.after

    def to_json(self) -> dict[str, float]:
        return dict(zip(FIXED_PARTS, (round(v, 4) for v in asdict(self).values())))

    @classmethod
    def from_json(cls, data: object) -> "FixedCosts":
        if not isinstance(data, dict):
            return cls()
        values = [data.get(name, 0.0) for name in FIXED_PARTS]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                   for v in values):
            raise ValueError(f"fixed step costs must be seconds >= 0: {data!r}")
        return cls(*map(float, values))


@dataclass(frozen=True)
class StepTime:
    compute: float  # B / total samples/s of the computing peers (inf: none computes)
    transfer: float  # the plan's averaging time (0: nothing to exchange)
    fixed: FixedCosts
    overlap: bool  # delayed parameter updates: averaging runs while the next batch computes

    @property
    def seconds(self) -> float:
        if self.overlap:
            f = self.fixed
            return max(self.compute + f.lag, self.transfer + f.wait + f.round_trips) + f.after
        return self.compute + self.transfer + self.fixed.total

    @property
    def steps_per_second(self) -> float:
        return 1.0 / self.seconds if self.seconds > 0 else math.inf

    def parts(self) -> dict[str, float]:
        """Seconds per step by cost: compute, transfer and each fixed part (what a person reads
        to see where the time goes)."""
        return {"compute": self.compute, "transfer": self.transfer, **self.fixed.to_json()}

    def largest_cost(self) -> tuple[str, float]:
        return max(self.parts().items(), key=lambda item: item[1])

    def to_json(self) -> dict[str, object]:
        return {"compute": _finite(self.compute), "transfer": _finite(self.transfer), "fixed": self.fixed.to_json(),
                "overlap": self.overlap, "seconds": _finite(self.seconds)}


def _finite(x: float) -> float:
    return round(x, 4) if math.isfinite(x) else 0.0


def predict_step(compute_bound: float, aggregation_bound: float, fixed: FixedCosts, overlap: bool) -> StepTime:
    """A plan's step from its LP figures (steps/s the computing peers allow, vectors/s its
    aggregators average) and the measured fixed costs."""
    compute = 1.0 / compute_bound if compute_bound > 0 else math.inf
    transfer = 1.0 / aggregation_bound if math.isfinite(aggregation_bound) and aggregation_bound > 0 else 0.0
    return StepTime(compute=compute, transfer=transfer, fixed=fixed, overlap=overlap)


def fixed_costs(phases: Sequence[StepPhases], compute: float, transfer: float) -> Optional[FixedCosts]:
    """The fixed costs from the computing peers' measured phases (medians of their recent
    steps), given the plan's modelled compute and transfer times; None without measurements."""
    if not phases:
        return None

    def median(values) -> float:
        return max(0.0, statistics.median(values))

    return FixedCosts(
        lag=median(p.accumulate - compute for p in phases) if math.isfinite(compute) else 0.0,
        wait=median(p.wait for p in phases),
        round_trips=median(p.allreduce - transfer for p in phases),
        after=median(p.after for p in phases),
    )


def whole_steps_per_second(throughput: Throughput, fixed: FixedCosts, overlap: bool) -> float:
    return predict_step(throughput.compute_bound, throughput.aggregation_bound, fixed, overlap).steps_per_second


def everyone_computes(problem: AveragingProblem) -> AveragingPlan:
    """The best shares when every peer with samples computes."""
    return plan_for_roles(problem, {peer.name: peer.samples_per_second > 0 for peer in problem.peers})


def plan_whole_steps(problem: AveragingProblem, fixed: Optional[FixedCosts], overlap: bool,
                     margin: float = 0.0) -> AveragingPlan:
    """The plan where every peer with samples computes, unless the LP's makes more than `margin`
    more whole steps per second (a peer left out of computing wastes its samples, and moving it
    back costs it a state reload); the LP's alone without fixed costs."""
    lp = plan_averaging(problem)
    if fixed is None:
        return lp
    everyone = everyone_computes(problem)
    if whole_steps_per_second(lp, fixed, overlap) > (1 + margin) * whole_steps_per_second(everyone, fixed, overlap):
        return lp
    return everyone
