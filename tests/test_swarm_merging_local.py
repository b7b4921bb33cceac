"""`hivekeeper up` with replicas that train alone (averaging.mode ties, diloco): it trains, the
replicas merge (or take outer steps), a crashed trainer comes back from the merged (outer)
state, and the monitor evaluates the merged (outer) model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import interrupt_run, kill_leftover, wait_for, write_manifest
from test_swarm_local import crash_trainer, global_step, processes_of, role_status, start_up

MERGING = {"spec": {
    "trainers": {"replicas": 2, "batchSize": 32},
    "averaging": {"mode": "ties", "mergeEverySteps": 10, "matchmakingSeconds": 2.0, "timeoutSeconds": 20},
    "monitor": {"evalEverySteps": 10, "checkpointEverySteps": 100},
    "stopping": {"targetSteps": 10_000_000, "targetMetric": None},  # the test ends the run
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
    """The run goes on until the test has seen the restarted trainer merge again and the monitor
    evaluate a merged model from after it: how many steps that takes depends on the machine (the
    digits MLP takes hundreds of local steps a second on an idle one, a restart takes seconds)."""
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
        back_at = starts[-1]["ts"]

        def merged_and_evaluated_after_rejoin() -> dict | None:
            status = role_status(run_dir, "monitor-0")
            last_round = status.get("lastRound") or {}
            merged = last_round.get("outcome") == "success" and last_round.get("groupSize") == 2 \
                and last_round.get("time", 0) > back_at
            evaluated = status.get("evalStep", -1) >= starts[-1]["joined_at_step"] + 10
            outer_steps = (status.get("outerSteps") or 0) >= 4  # merges, or outer steps: one every 10 local steps
            return status if merged and evaluated and outer_steps else None

        status = wait_for(merged_and_evaluated_after_rejoin, 90, "a merge of both trainers after the restart")
        summary = interrupt_run(runner)
    finally:
        kill_leftover(runner)
    assert summary["state"] == "interrupted"
    assert summary["processes"]["trainer-1"]["restarts"] >= 1
    assert status["evalMetrics"]["accuracy"] > 0.8, status  # the merged model the monitor evaluated
    assert starts[-1]["joined_at_step"] >= 5, starts  # back from a merged state, not from scratch
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    assert history[-1]["averagingBytesSentPerTrainer"] > 0
    assert not processes_of(run_dir)
