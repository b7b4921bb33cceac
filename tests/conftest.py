"""Shared helpers: manifests written to tmp dirs, and a check that no p2pd outlives a test."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def p2pd_pids() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "p2pd":
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def deep_update(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_update(merged[key], value)
        else:
            merged[key] = value
    return merged


def write_manifest(directory: Path, changes: dict[str, Any] | None = None, base: str = "swarm-digits.yaml") -> Path:
    document = yaml.safe_load((EXAMPLES / base).read_text())
    document = deep_update(document, changes or {})
    path = directory / "manifest.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    """Poll `condition` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def parent_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@pytest.fixture
def no_leaked_p2pd():
    """Fails the test if it leaves an orphaned p2pd behind: one whose hivemind process is gone.
    (A p2pd whose parent still runs belongs to someone else on this machine.) Leftovers are
    killed so later tests start clean."""
    before = p2pd_pids()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = {pid for pid in p2pd_pids() - before if parent_pid(pid) in (1, None) or parent_pid(pid) == os.getpid()}
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"p2pd processes leaked: {sorted(leaked)}"
