"""`hivekeeper report` on a history with what real runs leave behind: a line cut short by a
kill, NaN losses of a diverged run, snapshots before the first round. (A real run's report
is made and checked in test_swarm_local.py.)"""

from __future__ import annotations

import json

import pytest

from hivekeeper.cli import main

pytest.importorskip("matplotlib", reason="pip install -e '.[report]'")


def snapshot(t: float, step: int, **fields) -> dict:
    return {"time": 1_000 + t, "elapsedSeconds": t, "globalStep": step, "peersAlive": {"trainer": 2, "backbone": 1},
            **fields}


def test_report_survives_cut_lines_nan_and_missing_rounds(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(snapshot(1, 0)),
             json.dumps(snapshot(2, 1, loss=2.3, lossStep=0, samplesPerSecond=100.0)),
             json.dumps(snapshot(3, 2, loss=float("nan"), lossStep=1, evalStep=2,
                                 evalMetrics={"accuracy": 0.5, "loss": float("nan")},
                                 lastRound={"outcome": "success", "groupSize": 2, "seconds": 1.5, "time": 1_002.5})),
             '{"time": 1004, "elapsedSe']  # the monitor was killed mid-write
    (run / "history.jsonl").write_text("\n".join(lines))
    assert main(["report", str(run)]) == 0
    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in written] == ["loss.png", "throughput.png", "rounds.png", "peers.png",
                                                      "report.md"]
    markdown = (run / "report" / "report.md").read_text()
    assert "global step: 2 after 3 s" in markdown and "accuracy 0.5000" in markdown
    assert "1 successful, median 1.50 s" in markdown and "state: running" in markdown


def test_report_of_a_directory_without_history_is_one_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no history.jsonl" in err and len(err.strip().splitlines()) == 1
