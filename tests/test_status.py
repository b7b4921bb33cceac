"""`hivekeeper status`: a table redrawn in place on a terminal, plain lines to a pipe, the summary
once the run's monitor is gone, and every read of a token-admission swarm's DHT signed (the
first and each `--watch` refresh). No swarm starts here: the monitor is a stub HTTP server, the
DHT reads are replaced."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from hivekeeper.cli import main
from hivekeeper.commands.status import show, status_line, status_table

MONITOR = {"elapsedSeconds": 42.0, "globalStep": 12, "loss": 0.5, "samplesPerSecond": 300.0,
           "peersAlive": {"trainer": 2, "backbone": 1}, "lastRound": None, "evalStep": 10,
           "evalMetrics": {"accuracy": 0.8}, "plan": None, "stepsPerSecond": 0.2}
EXPERT_TRAINER = {"elapsedSeconds": 5.0, "globalStep": 3, "loss": 1.2, "samplesPerSecond": 50.0,
                  "peersAlive": {"expert-server": 2}, "evalStep": None, "evalMetrics": {},
                  "expertRequests": {"ok": 40, "failed": 2}, "expertsAlive": 8, "failedBatches": 1,
                  "beamSearchSeconds": 0.004}


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
    """rich takes a terminal from these whatever the output is."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):
        monkeypatch.delenv(name, raising=False)


def rendered(table, width: int = 160) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=False)
    console.print(table)
    return console.file.getvalue()


def test_status_table_shows_what_every_kind_has_and_only_its_own_rows():
    swarm = rendered(status_table("digits", MONITOR))
    for expected in ("digits", "42s", "global step", "12", "0.5000", "300.0", "1 backbone, 2 trainer",
                     "accuracy 0.8000 (step 10)", "last averaging", "averaging plan"):
        assert expected in swarm, expected
    assert "expert requests" not in swarm
    experts = rendered(status_table("moe", EXPERT_TRAINER))
    for expected in ("40 ok, 2 failed", "experts alive", "8", "batches dropped", "0.0040 s"):
        assert expected in experts, expected
    assert "averaging plan" not in experts


def test_show_redraws_in_place_on_a_terminal_and_appends_lines_otherwise():
    frames = [dict(MONITOR, globalStep=step) for step in (12, 13, 14)]
    terminal = Console(file=io.StringIO(), width=160, force_terminal=True)
    show(terminal, frames, lambda s: status_table("digits", s), status_line)
    drawn = terminal.file.getvalue()
    places = [drawn.index(f"│ {step} ") for step in (12, 13, 14)]
    assert places == sorted(places)
    for before, after in zip(places, places[1:]):
        assert "\x1b[1A" in drawn[before:after]  # the cursor goes back up over the previous table
    pipe = Console(file=io.StringIO(), width=160, force_terminal=False)
    show(pipe, frames, lambda s: status_table("digits", s), status_line)
    lines = pipe.file.getvalue().splitlines()
    assert "\x1b" not in pipe.file.getvalue()
    assert [line.split("step ")[1].split()[0] for line in lines] == ["12", "13", "14"]


class StubMonitor(BaseHTTPRequestHandler):
    """Answers /status from a queue, then 503 as a monitor that has gone."""

    statuses: list[dict] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/status" and self.statuses:
            body = json.dumps(self.statuses.pop(0)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(503)

    def log_message(self, *args):
        pass


def test_watch_to_a_pipe_prints_a_line_per_refresh_then_the_summary(tmp_path: Path, capsys):
    StubMonitor.statuses = [dict(MONITOR, globalStep=step) for step in (5, 6, 7)]
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubMonitor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "run.json").write_text(json.dumps({"host": "127.0.0.1", "progressRole": "monitor-0"}))
        (tmp_path / "ports.json").write_text(json.dumps({"monitor-0": server.server_address[1]}))
        (tmp_path / "summary.json").write_text(json.dumps({"state": "completed", "globalStep": 7,
                                                           "metrics": {"accuracy": 0.9}}))
        assert main(["status", str(tmp_path), "--watch", "--interval", "0"]) == 0
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    assert "\x1b" not in out
    lines = out.splitlines()
    assert [line.split("step ")[1].split()[0] for line in lines[:3]] == ["5", "6", "7"]
    assert lines[3:] == [f"{tmp_path}: completed at step 7, metrics {{'accuracy': 0.9}}"]


def test_every_dht_read_of_a_token_swarm_is_signed(tmp_path: Path, monkeypatch, capsys):
    import hivekeeper.auth.authorizer
    import hivekeeper.peer_table

    authorizer = object()
    reads: list[object] = []

    def read_reports(peers, swarm, signed_by=None):
        reads.append(signed_by)
        if len(reads) == 3:
            raise KeyboardInterrupt  # the user stops watching
        return [{"name": "trainer-0", "role": "trainer", "globalEpoch": len(reads)}]

    monkeypatch.setattr(hivekeeper.auth.authorizer, "make_authorizer", lambda gateway, invite, patience: authorizer)
    monkeypatch.setattr(hivekeeper.peer_table, "read_reports", read_reports)
    code = main(["status", "--swarm", "open", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer",
                 "--gateway", "127.0.0.1:1", "--invite", str(tmp_path / "invite.json"), "--watch", "--interval", "0"])
    assert code == 130
    assert reads == [authorizer] * 3
    assert capsys.readouterr().out.count("open: 1 peers reporting") == 2
