"""Where a collaborative step's time goes, as one peer sees it.

A synchronous Swarm step is, at each peer: accumulate (compute batches until the collaboration
has its global batch), wait (from this peer's trigger until its all-reduce begins: the group
forming, groupmates still finishing their batch), all-reduce (the vector on the wire, plus its
round trips), and after (the optimizer step and whatever else the step does in the foreground).
The averaging planner models compute and transfer from rates; the rest does not scale with the
vector, so the peers measure it and the planner adds it (`planning/step_time.py`).

Pure bookkeeping: times are passed in, nothing here reads a clock or imports hivemind.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

PHASES = ("accumulate", "wait", "allreduce", "after", "step")


@dataclass(frozen=True)
class StepPhases:
    """Seconds of one step, or the median of recent steps, by phase; `step` is the whole
    period from one step's end to the next one's."""

    accumulate: float
    wait: float
    allreduce: float
    after: float
    step: float

    def to_json(self) -> dict[str, float]:
        return {name: round(value, 4) for name, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: object) -> Optional["StepPhases"]:
        """A peer's report of its phases, or None when absent or malformed (it is only a hint)."""
        if not isinstance(data, dict):
            return None
        values = [data.get(name) for name in PHASES]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e6 for v in values):
            return None
        return cls(*map(float, values))


class StepClock:
    """Times the phases of a peer's steps and keeps the median of the last `window`."""

    def __init__(self, now: float, window: int = 16):
        self._began = now  # the current step's accumulation began (the previous step ended)
        self._trigger: Optional[float] = None
        self._recent: deque[StepPhases] = deque(maxlen=window)

    def restart(self, now: float) -> None:
        """The peer's steps start over (a state load): the time since is not accumulation."""
        self._began, self._trigger = now, None

    def accumulating_for(self, now: float) -> float:
        """Seconds the current step has been accumulating."""
        return now - self._began

    def triggered(self, now: float) -> float:
        """The peer has its share of the global batch and begins the step; returns how long it
        accumulated."""
        self._trigger = now
        return now - self._began

    def ended(self, now: float, allreduce: Optional[tuple[float, float]]) -> Optional[StepPhases]:
        """The step ended at `now`; `allreduce` is when its all-reduce began and ended (None if it
        had none: alone, or failed). Returns the step's phases, or None without a trigger."""
        trigger, began = self._trigger, self._began
        self._began, self._trigger = now, None
        if trigger is None:
            return None
        if allreduce is not None and trigger <= allreduce[0] <= allreduce[1] <= now:
            start, end = allreduce
        else:  # no all-reduce of this step: the wait is the whole round
            start = end = now
        phases = StepPhases(accumulate=trigger - began, wait=start - trigger, allreduce=end - start,
                            after=now - end, step=now - began)
        self._recent.append(phases)
        return phases

    @property
    def median(self) -> Optional[StepPhases]:
        if not self._recent:
            return None
        return StepPhases(*(statistics.median(getattr(p, name) for p in self._recent) for name in PHASES))
