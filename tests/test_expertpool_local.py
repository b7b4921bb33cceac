"""`hivekeeper up` of an ExpertPool with real hivemind peers: a DMoE model trains through 2
expert servers to the stated accuracy while one server is killed; its experts are excluded
meanwhile, and the restarted server serves them again from their checkpoints.

The run is long and the test ends it with Ctrl-C once it has seen all that: how fast the trainer
goes, and how long a restarted server takes to rejoin, depend on the machine's load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import interrupt_run, kill_leftover, print_run_logs, wait_for, write_manifest
from test_swarm_local import processes_of, role_pid, silent_dashboard_panels
from test_swarm_local import role_status as status

TARGET_ACCURACY = 0.9
SMALL = {"metadata": {"name": "moe-local"}, "spec": {
    "grid": {"dimensions": [2, 4]},
    "expert": {"hiddenSize": 32},
    "optimizer": {"name": "adam", "learningRate": 0.001},
    "servers": {"replicas": 2, "announcePeriodSeconds": 1, "announceExpirationSeconds": 3},
    "checkpoint": {"everySeconds": 1},
    "trainers": {"batchSize": 64, "batchesInFlight": 2, "optimizer": {"name": "adam", "learningRate": 0.003},
                 "dmoe": {"layers": 1, "kBest": 2, "forwardTimeoutSeconds": 3, "timeoutAfterKMinSeconds": 1,
                          "backwardTimeoutSeconds": 3},
                 "evalEverySteps": 10},
    "stopping": {"targetMetric": None, "targetSteps": 100_000},
}}


def server_pid(run_dir: Path, index: int) -> int | None:
    """The server's main process (its forked workers have the same command line)."""
    return role_pid(run_dir, "expert-server", index)


@pytest.mark.swarm
@pytest.mark.timeout(480)  # a restarted server takes 20-40 s to rejoin under load
def test_up_trains_to_accuracy_through_a_server_crash(tmp_path, no_leaked_p2pd):
    run_dir = tmp_path / "run"
    manifest = write_manifest(tmp_path, SMALL, base="expertpool.yaml")
    runner = subprocess.Popen([sys.executable, "-m", "hivekeeper", "up", str(manifest), "--run-dir", str(run_dir),
                               "--json", "--prometheus"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # every role starts first: 46 s for the backbone alone in a CI run beside the cluster tier
        wait_for(lambda: status(run_dir, "expert-trainer-0").get("globalStep", 0) >= 10, 240, "ten trainer batches")

        def served_experts() -> dict | None:
            experts = status(run_dir, "expert-server-1").get("experts")
            return experts if experts and all(e["updates"] > 0 for e in experts.values()) else None

        # the trainer finds a newly announced server within a DHT search period: wait until it used all its experts
        before = wait_for(served_experts, 60, "server 1's experts updated")
        time.sleep(2.5)  # a checkpoint (every second) covers these counts
        step_at_kill = status(run_dir, "expert-trainer-0")["globalStep"]
        os.kill(server_pid(run_dir, 1), signal.SIGKILL)

        # training goes on without server 1: requests to its experts fail and they are excluded
        steps_while_down = []

        def back() -> dict | None:
            trainer = status(run_dir, "expert-trainer-0")
            if trainer:
                steps_while_down.append(trainer["globalStep"])
            return status(run_dir, "expert-server-1").get("resumed")

        resumed = wait_for(back, 120, "server 1 restarted")
        trainer = status(run_dir, "expert-trainer-0")
        assert trainer["expertRequests"]["failed"] + trainer["failedBatches"] > 0
        assert max(steps_while_down) > step_at_kill, "the trainer went on while server 1 was down"
        assert set(resumed) == set(before)
        assert all(resumed[uid] >= before[uid]["updates"] > 0 for uid in before), (resumed, before)
        # its experts are served again: backward requests update them past their checkpoints
        wait_for(lambda: any(e["updates"] > resumed[uid]
                             for uid, e in status(run_dir, "expert-server-1").get("experts", {}).items()),
                 60, "server 1's experts updated again")

        def accuracy() -> float:
            return status(run_dir, "expert-trainer-0").get("evalMetrics", {}).get("accuracy", 0.0)

        reached = wait_for(lambda: (a := accuracy()) >= TARGET_ACCURACY and a, 120, f"accuracy {TARGET_ACCURACY}")
        # `--prometheus`: every ExpertPool dashboard panel returns data from this run.
        prometheus = (run_dir / "prometheus.url").read_text()
        silent: list[str] = []

        def every_panel_answers() -> bool:
            silent[:] = silent_dashboard_panels(prometheus, "moe-local", source="experts")
            return not silent

        try:
            wait_for(every_panel_answers, 30, "every ExpertPool panel to return data", interval=2.0)
        except AssertionError:
            pytest.fail(f"panels without data: {silent}")
        summary = interrupt_run(runner)
    except BaseException:
        print_run_logs(run_dir)
        raise
    finally:
        kill_leftover(runner)
    assert reached >= TARGET_ACCURACY
    assert summary["state"] == "interrupted" and summary["kind"] == "ExpertPool"
    assert summary["processes"]["expert-server-1"]["restarts"] >= 1
    assert len(list((run_dir / "experts").glob("expert.*.pt"))) == 8
    assert not processes_of(run_dir)
