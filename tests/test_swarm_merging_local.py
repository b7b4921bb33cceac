"""`hivekeeper up` with replicas that train alone (averaging.mode ties, diloco): it trains, the
replicas merge (or take outer steps), a crashed trainer comes back from the merged (outer)
state, and the monitor evaluates the merged (outer) model."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import wait_for, write_manifest
from test_swarm_local import crash_trainer, global_step, processes_of, start_up

MERGING = {"spec": {
    "trainers": {"replicas": 2, "batchSize": 32},
    "averaging": {"mode": "ties", "mergeEverySteps": 10, "matchmakingSeconds": 2.0, "timeoutSeconds": 20},
    "monitor": {"evalEverySteps": 10, "checkpointEverySteps": 100},
    "stopping": {"targetSteps": 100, "targetMetric": None},
}}


def log_records(run_dir: Path, name: str) -> list[dict]:
    records = []
    for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    return records


DILOCO = {"mode": "diloco", "innerSteps": 10, "compression": "float16", "mergeEverySteps": None}


@pytest.mark.swarm
@pytest.mark.timeout(300)
@pytest.mark.parametrize("averaging", [{}, DILOCO], ids=["ties", "diloco"])
def test_up_merges_replicas_and_a_restarted_one_joins_from_the_merged_state(tmp_path, no_leaked_p2pd, averaging):
    run_dir = tmp_path / "run"
    manifest = {"spec": {**MERGING["spec"], "averaging": {**MERGING["spec"]["averaging"], **averaging}}}
    runner = start_up(write_manifest(tmp_path, manifest, base="swarm-digits-ties.yaml"), run_dir)
    try:
        wait_for(lambda: global_step(run_dir) >= 20, 150, "twenty local steps")
        crash_trainer(run_dir, 1)

        def rejoined() -> list[dict]:
            starts = [r for r in log_records(run_dir, "trainer-1") if r["msg"] == "merging trainer started"]
            return starts if len(starts) >= 2 else []

        starts = wait_for(rejoined, 120, "trainer-1 to come back")
        out, err = runner.communicate(timeout=240)
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(30)
    assert runner.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary["state"] == "completed" and summary["reason"] == "reached targetSteps=100"
    assert summary["globalStep"] >= 40  # the step of the last merged model, which the monitor evaluated
    assert summary["processes"]["trainer-1"]["restarts"] >= 1
    assert summary["metrics"]["accuracy"] > 0.8, summary["metrics"]
    assert starts[-1]["joined_at_step"] >= 5, starts  # back from a merged state, not from scratch
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    merges = [e["lastRound"] for e in history if e.get("lastRound")]
    assert any(m["outcome"] == "success" and m["groupSize"] == 2 for m in merges)
    assert history[-1]["outerSteps"] >= 4  # merges, or outer steps: one every 10 local steps
    assert history[-1]["averagingBytesSentPerTrainer"] > 0
    assert not processes_of(run_dir)
