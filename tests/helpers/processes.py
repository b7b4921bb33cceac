"""Processes as /proc shows them, each named by its pid and its start time: a pid the kernel
hands out again after a process died is another process, never mistaken for the first. For
tests that kill processes and check what is left of them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterable, NamedTuple, Optional

from conftest import descendants


class Proc(NamedTuple):
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22)
    comm: str


def proc(pid: int) -> Optional[Proc]:
    """The process `pid` now, or None if there is none (a zombie counts as none: it is dead,
    only not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
    if fields[0] in ("Z", "X"):
        return None
    return Proc(pid, int(fields[19]), comm)


def alive(p: Proc) -> bool:
    now = proc(p.pid)
    return now is not None and now.start == p.start


def tree(pid: int) -> list[Proc]:
    """`pid` and every live process below it."""
    found = (proc(p) for p in [pid, *descendants(pid)])
    return [p for p in found if p is not None]


def describe(procs: Iterable[Proc]) -> str:
    """One line a process: pid, name, state, parent and command line, for a failure message
    that says which process was left and where it hangs."""
    lines = []
    for p in procs:
        try:
            stat = Path(f"/proc/{p.pid}/stat").read_text()
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            wchan = Path(f"/proc/{p.pid}/wchan").read_text()
        except OSError:
            lines.append(f"{p.pid} {p.comm}: gone")
            continue
        lines.append(f"{p.pid} {p.comm} state {state} ppid {ppid} wchan {wchan}: {cmdline[:160]}")
    return "\n".join(lines)


def wait_gone(procs: Iterable[Proc], timeout: float) -> list[Proc]:
    """Waits up to `timeout` seconds for every one of `procs` to be dead; those still alive."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_all(procs: Iterable[Proc]) -> None:
    """SIGKILL every one of `procs` still alive (stopped first, so that none starts another
    while the rest are killed)."""
    procs = [p for p in procs if alive(p)]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            if alive(p):
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass
