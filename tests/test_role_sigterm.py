"""A role ends at SIGTERM from its first moments, also as PID 1 of a pid namespace, which is what
it is in a pod. The kernel ends a namespace's PID 1 on no signal it has no handler for, so a
role that had not yet installed its own (it was still importing torch) ignored the kubelet's
SIGTERM, and its pod waited out the whole grace period before it was killed: 52 s for a
Swarm's pods, which the real-cluster tier waited four times a run. `hivekeeper run` now catches
SIGTERM before it imports anything heavy (`hivekeeper.cli.end_at_sigterm`) and exits 143."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import descendants, wait_for

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "swarm-digits.yaml"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="a pid namespace of its own needs root and unshare")


def catches(pid: int, number: int) -> bool:
    """Whether process `pid` has a handler for signal `number` (SigCgt in /proc/PID/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (number - 1)))
    except OSError:
        pass
    return False


def role_process(runner: int) -> int | None:
    """The `hivekeeper run` process below `runner` (unshare's child: PID 1 of its namespace)."""
    for pid in descendants(runner):
        try:
            if b"hivekeeper\0run\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def test_a_role_that_is_pid_1_ends_at_sigterm_while_it_starts(tmp_path):
    namespace = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "hivekeeper", "run", "trainer",
         "--manifest", str(EXAMPLE), "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        role = wait_for(lambda: role_process(namespace.pid), 60, "the role's process")
        # SIGTERM as soon as the role catches it: long before the role's own clean-stop handler
        # (it imports torch and hivemind first), which would stop it with 0, not 143
        wait_for(lambda: catches(role, signal.SIGTERM), 60, "the role to catch SIGTERM", interval=0.02)
        os.kill(role, signal.SIGTERM)
        output = namespace.communicate(timeout=60)[0]
        assert namespace.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert '"msg": "trainer started"' not in output, output[-3000:]
    finally:
        if namespace.poll() is None:
            namespace.kill()
            namespace.communicate(timeout=30)
