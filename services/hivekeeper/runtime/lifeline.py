"""Every process a role starts dies with the role, and a role that `hivekeeper up` (or `join`)
started stops when its supervisor is gone. `hivekeeper run` calls `install()` before the role
forks anything; nothing else installs it (a test process that forks hivemind peers keeps
hivemind's behaviour).

A role forks hivemind's processes (its DHT, its averagers: multiprocessing's fork), and each
DHT process execs a p2pd. A role killed with SIGKILL, or one that crashes hard, would orphan
them: a DHT process holds both ends of its control pipe, so it never reads EOF, and runs on
with its p2pd, a peer nobody stops.

- Forked children. An at-fork hook sets Linux's parent-death signal (PR_SET_PDEATHSIG,
  SIGKILL) in every child the role forks, and in every child those fork (the hook is inherited),
  so a killed role takes its DHT process down, and that one its p2pd. The kernel sends the
  signal when the *thread* that forked the child exits, not its process: it is set only in a
  child its parent's main thread forked (a Python process ends with its main thread: the
  interpreter finalizes there). A child another thread forked (a thread that may end long
  before its process) polls its parent's pid instead, from a thread of its own, and kills
  itself once it has been re-parented.
- Exec'd children. The at-fork hooks do not run for subprocess's fork-exec; the parent-death
  signal survives execve but not fork. So p2pd starts through `exec_prefix()` (setpriv, or this
  interpreter where util-linux's setpriv is missing), which sets the signal and execs p2pd in
  the same process: hivemind still stops p2pd by the pid it got (hivemind_ext.p2pd). The patch
  is applied at the role's first fork after hivemind is imported (every p2pd a role starts is
  started in a DHT process, a fork): hivemind sets its loggers' level when it is imported, and
  importing it here, before the role sets up its logging, would turn which one wins around.
  (torch's shared-memory manager, which torch execs in a session of its own, needs nothing: it
  exits 2 s after its last client is gone.)
- The supervisor. A role runs in a session of its own (Ctrl-C reaches only the runner), so a
  runner killed with SIGKILL would leave its roles running. The supervisor names itself in
  SUPERVISOR_ENV; the role watches its parent's pid from a thread, and once the supervisor is
  gone it stops as on SIGTERM, and is ended STOP_GRACE_SECONDS later if it has not exited. The
  kernel ends it (SIGALRM, whose default action terminates the process): a Python thread could
  not, since once the interpreter finalizes, a daemon thread that wakes never runs again, and a
  stop that hangs there would keep the role, its DHT process and its p2pd alive.

Elsewhere than Linux there is no parent-death signal and `install()` does nothing."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["SUPERVISOR_ENV", "STOP_GRACE_SECONDS", "install", "exec_prefix"]

SUPERVISOR_ENV = "HIVEKEEPER_SUPERVISOR_PID"  # set by the supervisor for its children only
STOP_GRACE_SECONDS = 5.0  # a role told to stop gets this long before SIGKILL (Supervisor.stop too)
POLL_SECONDS = 0.2  # how often a watcher reads its parent's pid
PR_SET_PDEATHSIG = 1

log = logging.getLogger("hivekeeper.lifeline")

_prctl: Optional[Callable[..., int]] = None  # resolved before any fork: no dlopen in a forked child
_pid = 0  # this process's pid; in a child, until its at-fork hook runs, its parent's
_main_ident = 0  # this process's main thread; in a child, until its hook runs, the parent's
_p2pd_patched = False
# Execs argv[1:] with the parent-death signal (1: PR_SET_PDEATHSIG) set to SIGKILL (9).
_PYTHON_EXEC = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "
                "os.execvp(sys.argv[1], sys.argv[1:])")


def install() -> None:
    """In a role process, from its main thread, before it forks: children die with it, p2pd with
    the process that starts it, and the role stops once its supervisor (SUPERVISOR_ENV) is gone.
    Idempotent."""
    global _prctl, _pid, _main_ident
    supervisor = os.environ.pop(SUPERVISOR_ENV, None)  # the role's own children have no supervisor
    if not sys.platform.startswith("linux"):
        return
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _pid, _main_ident = os.getpid(), threading.main_thread().ident or 0
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    if supervisor and supervisor.isdigit():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the watcher's deadline terminates
        threading.Thread(target=_watch_supervisor, args=(int(supervisor),), name="supervisor-watch",
                         daemon=True).start()


def exec_prefix() -> list[str]:
    """The words that run a command with its parent-death signal set to SIGKILL, in the same
    process (the pid its starter gets is the command's): `setpriv --pdeathsig KILL --` where
    util-linux's setpriv has the option (2.33 on), this interpreter otherwise."""
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        probe = [setpriv, "--pdeathsig", "KILL", "--", sys.executable, "-I", "-S", "-c", ""]
        try:
            if subprocess.run(probe, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=10).returncode == 0:
                return [setpriv, "--pdeathsig", "KILL", "--"]
        except (OSError, subprocess.SubprocessError):
            pass
    return [sys.executable, "-I", "-S", "-c", _PYTHON_EXEC]


def _before_fork() -> None:
    """In the forking process: once hivemind is imported, its p2pd starts through exec_prefix()
    here and in every process forked from now on."""
    global _p2pd_patched
    if _p2pd_patched or "hivemind.p2p" not in sys.modules:
        return
    _p2pd_patched = True
    try:
        from hivekeeper.hivemind_ext.p2pd import die_with_parent

        die_with_parent(exec_prefix())
    except Exception:  # a p2pd that may outlive its DHT is no reason to fail the fork
        log.exception("p2pd starts without a parent-death signal")


def _after_fork_in_child() -> None:
    """In every child forked by a role or its descendants (multiprocessing's fork, os.fork)."""
    global _pid, _main_ident
    parent, forked_by_main = _pid, threading.get_ident() == _main_ident  # pthread ids survive fork
    _pid, _main_ident = os.getpid(), threading.get_ident()  # this thread is the child's main one
    if forked_by_main:
        assert _prctl is not None
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was set
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        threading.Thread(target=_die_with, args=(parent,), name="lifeline", daemon=True).start()


def _die_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_supervisor(supervisor: int) -> None:
    while os.getppid() == supervisor:
        time.sleep(POLL_SECONDS)
    # The deadline first: the kernel keeps it whatever becomes of this thread or the logging.
    # When it fires, the role's children follow by their parent-death signal.
    signal.alarm(math.ceil(STOP_GRACE_SECONDS))
    log.warning(f"the supervisor (pid {supervisor}) is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)  # the role's own handler: a clean stop, DHT and p2pd first
