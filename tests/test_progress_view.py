"""The progress view of `hivekeeper up` (its plain-line form, as in CI logs)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from rich.console import Console

from hivekeeper.local.progress import ProgressView


def view() -> tuple[ProgressView, io.StringIO]:
    out = io.StringIO()
    children = [SimpleNamespace(state="running"), SimpleNamespace(state="running")]
    supervisor = SimpleNamespace(children=children, restarts=0)
    progress = ProgressView("digits", supervisor, 40, Console(file=out, force_terminal=False, width=200))
    return progress, out


STATUS = {"globalStep": 40, "loss": 0.5, "samplesPerSecond": 100.0, "peersAlive": {"trainer": 2},
          "evalStep": 40, "evalMetrics": {"accuracy": 0.9}}


def test_a_silent_monitor_is_starting_before_its_first_status_and_finishing_after():
    progress, out = view()
    progress.update(None)
    progress._last_line = 0.0  # the next update prints its line without waiting 5 s
    progress.update(STATUS)
    progress._last_line = 0.0
    progress.update(None)  # the run reached its target: the monitor evaluates and reports
    lines = out.getvalue().splitlines()
    assert "digits: starting" in lines[0]
    assert "step 40/40" in lines[1]
    assert "digits: finishing" in lines[2] and "starting" not in lines[2]
