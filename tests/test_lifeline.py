"""hivekeeper.runtime.lifeline, in processes that stand in for roles: what a role forks (from its
main thread, or from a thread that is gone by then) and what those exec die with the role when
it is killed with SIGKILL, and not before; a role whose supervisor is killed stops by itself.
The test process never installs the hooks: each case runs in a process of its own."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import p2pd_pids
from helpers.processes import Proc, alive, kill_all, proc, tree, wait_gone
from hivekeeper.runtime.lifeline import STOP_GRACE_SECONDS, SUPERVISOR_ENV

# Forks a child from its main thread and one from a thread that then ends, while threads come and
# go; each child execs a grandchild through exec_prefix() (setpriv, or the interpreter: argv[1]).
FORKS = r"""
import multiprocessing as mp, os, subprocess, sys, threading, time
from hivekeeper.runtime import lifeline
lifeline.install()
prefix = lifeline.exec_prefix() if sys.argv[1] == "default" else [sys.executable, "-I", "-S", "-c", lifeline._PYTHON_EXEC]

def child(out):
    grandchild = subprocess.Popen([*prefix, "sleep", "600"])
    out.put((os.getpid(), grandchild.pid))
    time.sleep(600)

ctx = mp.get_context("fork")
out = ctx.Queue()
ctx.Process(target=child, args=(out,), daemon=True).start()
pids = [*out.get(timeout=60)]
starter = threading.Thread(target=lambda: (ctx.Process(target=child, args=(out,), daemon=True).start(),
                                           pids.extend(out.get(timeout=60))))  # the thread outlives the fork
starter.start()
starter.join()
for _ in range(50):  # threads that come and go
    thread = threading.Thread(target=time.sleep, args=(0.01,))
    thread.start()
    thread.join()
print(*pids, flush=True)
time.sleep(600)
"""

# A supervisor: starts the role below in a session of its own, as hivekeeper's does, and waits.
SUPERVISOR = r"""
import os, subprocess, sys
from hivekeeper.runtime.lifeline import SUPERVISOR_ENV
role = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                        env={**os.environ, SUPERVISOR_ENV: str(os.getpid())})
role.wait()
"""

# A role with a forked child; it says whether the child saw SUPERVISOR_ENV, and "stopped" when
# SIGTERM ends its loop. argv[1]: "polite", "stubborn" (it ignores SIGTERM) or "hangs" (its exit
# hangs after the interpreter has finalized, where no Python thread runs any more, as a native
# library's exit handler that waits for a thread of its own would: pause() is such a handler).
ROLE = r"""
import ctypes, multiprocessing as mp, os, signal, sys, threading, time
from hivekeeper.runtime import lifeline
lifeline.install()
if sys.argv[1] == "hangs":
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.cast(libc.pause, ctypes.c_void_p), None, None)
ctx = mp.get_context("fork")
out = ctx.Queue()
ctx.Process(target=lambda: (out.put(os.environ.get(lifeline.SUPERVISOR_ENV)), time.sleep(600)), daemon=True).start()
stop = threading.Event()  # the child keeps SIGTERM's default: the role's exit ends it
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == "stubborn" else (lambda *_: stop.set()))
print(os.getpid(), out.get(timeout=60), flush=True)
while not stop.wait(0.1):
    pass
print("stopped", flush=True)
"""

# A role's DHT: p2pd in the DHT's process, started through the exec wrapper. Shuts it down on "stop".
DHT = r"""
import os, sys
import hivemind
from hivekeeper.runtime import lifeline
lifeline.install()
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print(dht.pid, flush=True)
sys.stdin.readline()
dht.shutdown()
print("down", flush=True)
"""


def start(script: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, **kwargs)


def read_line(process: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output in {timeout:.0f}s"
    return process.stdout.readline().strip()


def stop(process: subprocess.Popen, started: list[Proc]) -> None:
    """In a test's `finally`: the process, all it started and whatever it still runs are killed."""
    kill_all([*started, *tree(process.pid)])
    if process.poll() is None:
        process.kill()
    process.wait(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefix", ["default", "python"])
def test_forked_and_execd_children_die_with_their_role_and_not_before(prefix):
    role = start(FORKS, prefix)
    started: list[Proc] = []
    try:
        pids = [role.pid, *map(int, read_line(role, 50).split())]
        started = [p for p in map(proc, pids) if p is not None]
        assert len(started) == len(pids) == 5, f"not all of {pids} are running"
        main_child, main_grandchild, thread_child, thread_grandchild = started[1:]
        assert main_grandchild.comm == thread_grandchild.comm == "sleep"  # exec'd in the wrapper's pid
        time.sleep(1.0)  # the thread that forked one child ended long ago, and 50 more came and went
        assert all(alive(p) for p in started), "a child died while its role lives"
        os.kill(role.pid, signal.SIGKILL)
        assert not wait_gone(started[1:], 10), "children outlived their role"
    finally:
        stop(role, started)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("manner", ["polite", "stubborn", "hangs"])
def test_a_role_stops_when_its_supervisor_is_killed(manner):
    supervisor = start(SUPERVISOR, ROLE, manner)
    started: list[Proc] = []
    try:
        pid, seen = read_line(supervisor, 50).split()
        assert seen == "None", "the role's children are told of no supervisor"
        started = tree(int(pid))
        assert len(started) == 2  # the role and its child
        assert all(alive(p) for p in started)
        os.kill(supervisor.pid, signal.SIGKILL)
        supervisor.wait(10)
        if manner != "stubborn":
            assert read_line(supervisor, 10) == "stopped", "the role stopped as on SIGTERM"
        assert not wait_gone(started, STOP_GRACE_SECONDS + 10), "the role outlived its supervisor"
    finally:
        stop(supervisor, started)


@pytest.mark.swarm
@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed", [True, False])
def test_a_dhts_p2pd_goes_with_its_role(killed, no_leaked_p2pd):
    """Killed: the DHT's process and its p2pd die with the role. Shut down: hivemind stops the
    p2pd it started through the wrapper by the pid it got, as without it."""
    role = start(DHT, stdin=subprocess.PIPE)
    started: list[Proc] = []
    try:
        dht = int(read_line(role, 100))
        started = tree(role.pid)
        p2pd = [p for p in started if p.comm == "p2pd"]
        assert len(p2pd) == 1 and p2pd[0].pid in p2pd_pids(), started
        assert proc(dht) in started
        if killed:
            os.kill(role.pid, signal.SIGKILL)
            assert not wait_gone(started, 10), "the DHT's process or its p2pd outlived the role"
        else:
            role.stdin.write("stop\n")
            role.stdin.flush()
            assert read_line(role, 60) == "down"
            assert role.wait(30) == 0
            assert not wait_gone(started, 10)
    finally:
        stop(role, started)
