"""How the monitor ends a run: the evaluation that met targetMetric is the run's result (its model is
the final checkpoint), while a run that stops for another reason is evaluated once more on the
swarm's latest state. Seen in the cluster tier: a run stopped at accuracy 0.96, evaluated again a
step later, and reported 0.953 under a target it said it had reached."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLES
from hivekeeper.cli import build_parser
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.runtime.context import RoleContext
from hivekeeper.spec import parse_manifest
from hivekeeper.swarm.monitor import Monitor


class StoredKeys:
    """Stands in for the DHT: the monitor only stores the stop key when it finishes."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, Any]] = []

    def store(self, key: str, value: Any, expiration_time: float) -> bool:
        self.stored.append((key, value))
        return True


def monitor(tmp_path: Path, stopping: dict[str, Any], evaluations: list[tuple[int, float]]) -> Monitor:
    """A monitor of the digits example whose evaluations return `evaluations` in turn (step, accuracy)."""
    document = yaml.safe_load((EXAMPLES / "swarm-digits.yaml").read_text())
    document["spec"]["stopping"] = stopping
    document["spec"]["monitor"] = {**document["spec"].get("monitor", {}), "checkpointDir": str(tmp_path / "ckpt")}
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(document))
    args = build_parser().parse_args(["run", "monitor", "--manifest", str(path), "--run-dir", str(tmp_path)])
    made = Monitor(RoleContext("monitor", args, parse_manifest(document), metrics=SwarmMetrics()))
    made.dht = StoredKeys()
    pending = list(evaluations)

    def evaluate() -> dict[str, float]:
        made.eval_step, accuracy = pending.pop(0)
        made.eval_metrics = {"accuracy": accuracy}
        return made.eval_metrics

    made.evaluate = evaluate
    return made


def finish_at(made: Monitor, step: int) -> dict[str, Any]:
    """The monitor's loop from one evaluation at `step` to the end of the run: the result it wrote."""
    made.evaluate()
    reason = made.stopping_reason(step)
    assert reason, "the run should stop here"
    made.finish(reason)
    made.history.close()
    return json.loads((made.run_dir / "result.json").read_text())


def test_a_run_that_met_its_target_reports_the_evaluation_that_met_it(tmp_path: Path):
    made = monitor(tmp_path, {"targetMetric": {"name": "accuracy", "value": 0.96}},
                   evaluations=[(64, 0.962), (65, 0.953)])  # a second evaluation would land under it
    result = finish_at(made, 64)
    assert result["globalStep"] == 64 and result["metrics"] == {"accuracy": 0.962}, result
    assert result["reason"].startswith("accuracy=0.9620 reached target 0.96")
    assert made.dht.stored[0][1]["step"] == 64


@pytest.mark.parametrize("stopping", [{"targetSteps": 60},
                                      {"targetSteps": 60, "targetMetric": {"name": "accuracy", "value": 0.99}}])
def test_a_run_stopped_by_its_steps_reports_the_swarms_latest_state(tmp_path: Path, stopping: dict[str, Any]):
    made = monitor(tmp_path, stopping, evaluations=[(50, 0.93), (61, 0.95)])
    result = finish_at(made, 61)
    assert result["globalStep"] == 61 and result["metrics"] == {"accuracy": 0.95}, result
    assert result["reason"] == "reached targetSteps=60"
