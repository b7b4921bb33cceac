"""`hivekeeper up` on loopback with real hivemind peers: it trains, serves metrics, survives a
crashed trainer, stops everything at Ctrl-C, and completes at its target with a
summary, status and report that agree. Checks on a live run end it themselves: a run with a target may
finish before a loaded host gets through them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from conftest import kill_leftover, print_run_logs, processes_of, wait_for, write_manifest
from hivekeeper.dashboards import expressions
from hivekeeper.local.supervisor import KILLED_SECONDS
from hivekeeper.runtime.lifeline import STOP_GRACE_SECONDS
from hivekeeper.tasks import load_task

SMALL = {"spec": {
    "targetBatchSize": 128,
    "trainers": {"replicas": 2, "batchSize": 32},
    "auxiliary": {"replicas": 1},
    "monitor": {"evalEverySteps": 4, "checkpointEverySteps": 8},
    "stopping": {"targetSteps": 30, "targetMetric": None},
}}


def start_up(manifest: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hivekeeper", "up", str(manifest), "--run-dir", str(run_dir),
                             "--json", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def prometheus_query(url: str, expr: str, at: float | None = None) -> list:
    """An instant query's result (now, or at time `at`); a query Prometheus refuses (it does not
    parse) fails the test."""
    params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode(params), timeout=5) as reply:
        answer = json.loads(reply.read())
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def silent_dashboard_panels(url: str, swarm: str, source: str = "swarm", at: float | None = None) -> list[str]:
    """Panels of the shipped dashboards fed by `source` (a kind's processes) that return no series."""
    substitutions = {"swarm": swarm, "namespace": ".*", "kind": ".*", "__rate_interval": "30s"}
    return [f"{uid}: {title}: {expr}" for uid, title, panel_source, expr in expressions(substitutions)
            if panel_source == source and not prometheus_query(url, expr, at)]


def http_get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return reply.read().decode()
    except OSError:
        return None


def ports(run_dir: Path) -> dict[str, int]:
    path = run_dir / "ports.json"
    return json.loads(path.read_text()) if path.exists() else {}


def role_status(run_dir: Path, role: str) -> dict:
    """A role's /status ({} before it serves one, or after it is gone)."""
    text = http_get(ports(run_dir).get(role, 0), "/status") if ports(run_dir) else None
    return json.loads(text) if text else {}


def global_step(run_dir: Path) -> int:
    return role_status(run_dir, "monitor-0").get("globalStep", -1)


def role_pids(run_dir: Path, role: str, index: int) -> list[int]:
    """PIDs of `hivekeeper run ROLE --index INDEX` of this run (forked workers included)."""
    pids = []
    for pid in processes_of(run_dir):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"{role}\0".encode() in cmdline and f"--index\0{index}\0".encode() in cmdline:
            pids.append(pid)
    return pids


def role_pid(run_dir: Path, role: str, index: int) -> int | None:
    """The role's own process: the leader of its session (the supervisor starts each role in one
    of its own). Its forked workers share its command line, and pids wrap (32768 here), so the
    lowest pid is not always the role's: CI once killed a worker instead, and no restart came."""
    leaders = []
    for pid in role_pids(run_dir, role, index):
        try:
            if os.getsid(pid) == pid:
                leaders.append(pid)
        except OSError:
            continue
    return leaders[0] if leaders else None


def crash_trainer(run_dir: Path, index: int) -> int:
    """SIGKILL trainer `index` of a run: a crash, not a clean exit. Returns the victim's pid."""
    victim = role_pid(run_dir, "trainer", index)
    assert victim, f"trainer-{index} is running"
    os.kill(victim, signal.SIGKILL)
    return victim


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not exported"
    return float(match.group(1))


@pytest.mark.swarm
@pytest.mark.timeout(720)  # a hang guard: 75 s on an idle 2-core host, 350 s with two busy loops per core
def test_up_trains_serves_metrics_and_survives_a_crash(tmp_path, no_leaked_p2pd):
    """Checks on a live run, which the test ends once it has seen them all (a run with a target
    may end before a loaded host gets through them: the demo's swarm now takes 1.5 steps/s)."""
    run_dir = tmp_path / "run"
    runner = start_up(write_manifest(tmp_path, {**SMALL, "spec": {**SMALL["spec"], "stopping": {"targetSteps": 10_000, "targetMetric": None}}}),
                      run_dir, "--prometheus")
    try:
        wait_for(lambda: global_step(run_dir) >= 3, 300, "three global steps")  # 7 roles start first

        def averaged_once() -> str | None:
            for name in ("trainer-0", "trainer-1"):
                text = http_get(ports(run_dir)[name], "/metrics")
                if text and 'hivekeeper_averaging_rounds_total{outcome="success"} 0.0' not in text:
                    return text
            return None

        text = wait_for(averaged_once, 90, "a trainer's first averaging round")
        trainer_port = ports(run_dir)["trainer-0"]
        assert metric(text, "hivekeeper_samples_total") > 0
        assert metric(text, "hivekeeper_averaging_rounds_total", '{outcome="success"}') >= 1
        assert metric(text, "hivekeeper_averaging_round_duration_seconds_count") >= 1
        assert 2 <= metric(text, "hivekeeper_averaging_group_size") <= 3  # of 2 trainers + 1 auxiliary
        # A peer in a group of n sends at most n-1 vectors' worth of float32 parts an all-reduce, and a
        # round holds two (the gradients, then the parameters: averageStateEvery 1). A round the
        # optimizer gave up on may still have moved its parts: bound by all rounds. No useful lower
        # bound per round: a trainer grouped with only the auxiliary sends just the auxiliary's part.
        vector_bytes = 4 * sum(p.numel() for p in load_task("digits").build_model().parameters())
        succeeded = metric(text, "hivekeeper_averaging_rounds_total", '{outcome="success"}')
        attempted = succeeded + metric(text, "hivekeeper_averaging_rounds_total", '{outcome="failure"}')
        sent = metric(text, "hivekeeper_averaging_sent_bytes_total")
        assert 0 < sent <= 2 * 2 * vector_bytes * attempted, (sent, vector_bytes, attempted)
        assert metric(text, "hivekeeper_averaging_received_bytes_total") == metric(
            text, "hivekeeper_averaging_sent_bytes_total")
        assert metric(text, "hivekeeper_local_step") >= 1
        assert http_get(trainer_port, "/readyz") == "ready\n" and http_get(trainer_port, "/healthz") == "ok\n"
        backbone = http_get(ports(run_dir)["backbone-0"], "/metrics")
        assert metric(backbone, "hivekeeper_peers_alive", '{role="trainer"}') >= 1
        # A crash early in the run (a loaded host may need minutes for the checks below, and the run
        # must not end before the supervisor restarts the trainer): the restarted trainer-1 then has
        # to rejoin the plan and the swarm's reports.
        victim = crash_trainer(run_dir, 1)
        wait_for(lambda: (pid := role_pid(run_dir, "trainer", 1)) and pid != victim, 60, "trainer-1 restarted")
        # The balancer measured every averaging peer and published a plan the trainers follow.
        assert metric(text, "hivekeeper_upload_bytes_per_second") > 0  # the probe at join, then rounds
        averaging_peers = ("trainer-0", "trainer-1", "auxiliary-0")
        balancer = wait_for(lambda: (t := http_get(ports(run_dir)["balancer-0"], "/metrics")) and all(
            f'hivekeeper_plan_aggregation_share{{peer="{name}"}}' in t for name in averaging_peers) and t,
            90, "a plan over every averaging peer", explain=lambda: http_get(ports(run_dir)["balancer-0"], "/status"))
        assert metric(balancer, "hivekeeper_plan_steps_per_second") > 0
        shares = [metric(balancer, "hivekeeper_plan_aggregation_share", f'{{peer="{name}"}}')
                  for name in averaging_peers]
        assert sum(shares) == pytest.approx(1.0)
        # A planned round needs its whole group on one plan; the restarted trainer-1 may hold none
        # yet, and on a loaded host a round takes tens of seconds: these guards allow a few.
        assert wait_for(lambda: (json.loads(http_get(trainer_port, "/status") or "{}").get("plannedRounds") or 0) >= 1,
                        180, "a round on the plan's shares", explain=lambda: http_get(trainer_port, "/status"))
        monitor_status = wait_for(lambda: (s := json.loads(http_get(ports(run_dir)["monitor-0"], "/status") or "{}"))
                                  and {p["name"] for p in (s.get("plan") or {}).get("peers", [])} == set(averaging_peers)
                                  and s, 180, "the monitor to see the plan over every averaging peer")
        assert monitor_status["plan"]["stepsPerSecond"] > 0
        # `hivekeeper status --swarm`: every peer's report, read from the swarm's DHT; the restarted
        # trainer-1's once it has published one again (a read may come before that).
        def peers_reporting() -> set[str] | None:
            began = time.monotonic()  # a new process with a DHT of its own: minutes on a loaded host
            peers = subprocess.run([sys.executable, "-m", "hivekeeper", "status", str(run_dir), "--swarm", "digits",
                                    "--json"], capture_output=True, text=True, timeout=240)
            print(f"status --swarm took {time.monotonic() - began:.1f} s")
            assert peers.returncode == 0, peers.stderr
            names = {r["name"] for r in json.loads(peers.stdout)}
            return names if {"backbone-0", "trainer-0", "trainer-1", "auxiliary-0"} <= names else None

        wait_for(peers_reporting, 300, "every peer's report through `status --swarm`", interval=1.0)
        # `--prometheus`: a real Prometheus scrapes every process, and every dashboard panel that a
        # local run can feed returns data (operator panels need a cluster).
        prometheus = (run_dir / "prometheus.url").read_text()
        silent: list[str] = []

        def every_panel_answers() -> bool:
            silent[:] = silent_dashboard_panels(prometheus, "digits")
            return not silent

        try:
            wait_for(every_panel_answers, 60, "every dashboard panel to return data", interval=2.0)
        except AssertionError:
            pytest.fail(f"panels without data: {silent}")

        # Ctrl-C, with the whole swarm at work: every process is gone (within 10 s on a quiet host).
        assert len(processes_of(run_dir)) >= 5
        runner.send_signal(signal.SIGINT)
        began = time.monotonic()
        out, err = runner.communicate(timeout=60)
        stopped_in = time.monotonic() - began
    finally:
        print_run_logs(run_dir)  # before the kill: a role that hangs writes where it waits
        kill_leftover(runner)
    assert runner.returncode == 130, err[-3000:]
    # How long the stop took is printed, not asserted: the supervisor's part is bounded by
    # construction (STOP_GRACE_SECONDS of grace, then KILLED_SECONDS for the killed roles and as
    # long for the fork server), about 3 s on a quiet host, but the runner's own summary and exit
    # take what a loaded host leaves them (10.1 s with two busy loops per core; 40.6 s once while
    # a cluster started beside it). The communicate() timeout above is the hang guard.
    print(f"Ctrl-C: every process gone in {stopped_in:.1f} s (the supervisor's bound: "
          f"{STOP_GRACE_SECONDS + 2 * KILLED_SECONDS:.0f} s)")
    summary = json.loads(out)
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "interrupted" and summary["globalStep"] >= 3
    assert summary["restarts"] >= 1 and summary["processes"]["trainer-1"]["restarts"] >= 1
    assert not processes_of(run_dir)


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_up_completes_at_its_target_with_a_model_status_and_report(tmp_path, no_leaked_p2pd):
    run_dir = tmp_path / "run"
    runner = start_up(write_manifest(tmp_path, SMALL), run_dir)
    try:
        out, err = runner.communicate(timeout=240)
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(30)
    assert runner.returncode == 0, err[-3000:]
    summary = json.loads(out)
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "completed" and summary["globalStep"] >= SMALL["spec"]["stopping"]["targetSteps"]
    assert summary["metrics"]["accuracy"] > 0.7, summary["metrics"]
    assert summary["wallSeconds"] > 0
    assert Path(summary["checkpoint"]).exists()
    assert not processes_of(run_dir)
    status = subprocess.run([sys.executable, "-m", "hivekeeper", "status", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "completed"
    # `hivekeeper report`: plots of this real run, and a summary that agrees with summary.json.
    report = subprocess.run([sys.executable, "-m", "hivekeeper", "report", str(run_dir)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    for plot in ("loss", "throughput", "rounds", "peers"):
        png = (run_dir / "report" / f"{plot}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, plot  # drawn, not an empty frame
    markdown = (run_dir / "report" / "report.md").read_text()
    assert f"global step: {summary['globalStep']}" in markdown and "![rounds](rounds.png)" in markdown
