"""Supervised child processes for `hivekeeper up` and `join`: start each role, restart a crashed
one with exponential backoff, and stop them all within a deadline: SIGTERM to each role, as the
kubelet sends it to a pod's main process, so that the role shuts its averagers, DHT and p2pd
down in order, then SIGKILL of its whole process group, which takes whatever it left behind.

Roles are forked from a fork server that has imported their modules once (`forkserver`), on
Linux; elsewhere, with HIVEKEEPER_FORKSERVER=0 or a command of the caller's own, each is a fresh
interpreter. Each child is told the pid of its parent, the supervisor or its fork server
(lifeline.SUPERVISOR_ENV), so that it stops by itself once that is gone."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from hivekeeper.local import forkserver
from hivekeeper.local.forkserver import ForkedProcess, ForkServer
from hivekeeper.runtime.lifeline import STOP_GRACE_SECONDS, SUPERVISOR_ENV
from hivekeeper.topology import Role

log = logging.getLogger("hivekeeper.supervisor")

BACKOFF_START = 1.0
BACKOFF_MAX = 30.0
STABLE_SECONDS = 60.0  # a child that ran this long gets its backoff reset
KILLED_SECONDS = 2.0  # for the children killed at the end of a stop to be reaped, all together


@dataclass
class Child:
    role: Role
    log_path: Path
    process: Optional[subprocess.Popen | ForkedProcess] = None
    restarts: int = 0
    started_at: float = 0.0
    next_start: float = 0.0
    backoff: float = BACKOFF_START
    exit_codes: list[int] = field(default_factory=list)
    finished: bool = False  # exited 0 and is not to be restarted

    @property
    def state(self) -> str:
        if self.finished:
            return "done"
        if self.process is not None and self.process.poll() is None:
            return "running"
        return "restarting" if self.exit_codes else "starting"


class Supervisor:
    def __init__(self, roles: Sequence[Role], log_dir: Path, command: Sequence[str] | None = None,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1"):
        self.host = host  # where the children serve /readyz and /metrics
        self.command = list(command or [sys.executable, "-m", "hivekeeper", "run"])
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.pop(SUPERVISOR_ENV, None)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.children = [Child(role, log_dir / f"{role.name}.log") for role in roles]
        self.forks = command is None and forkserver.available()
        self._server: Optional[ForkServer] = None

    def start(self, ready_first: Callable[[Role], bool] = lambda role: False, ready_timeout: float = 60.0) -> None:
        """Start every child; the roles `ready_first` picks (the backbone, which the others
        bootstrap from; the token service) start first and must answer /readyz before the rest
        start."""
        first = [c for c in self.children if ready_first(c.role)]
        for child in first:
            self._spawn(child)
        deadline = time.monotonic() + ready_timeout
        for child in first:
            while not _is_ready(self.host, child.role.ports.get("metrics")):
                if child.process is not None and child.process.poll() is not None:
                    raise RuntimeError(f"{child.role.name} exited during start-up; see {child.log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{child.role.name} not ready after {ready_timeout:.0f}s; see {child.log_path}")
                time.sleep(0.2)
        for child in self.children:
            if child not in first:
                self._spawn(child)

    def _spawn(self, child: Child) -> None:
        # Its own session: Ctrl-C reaches only the runner, which then stops children in order,
        # and killpg() reaches the child's p2pd too.
        if self.forks:
            try:
                server = self._fork_server()
                child.process = server.spawn(["run", *child.role.args], child.log_path,
                                             {**self.env, SUPERVISOR_ENV: str(server.pid)})
            except OSError as e:
                log.warning("%s; every role starts as a fresh interpreter from now on (see %s)", e,
                            self.log_dir / "forkserver.log")
                self.forks = False
        if not self.forks:
            with open(child.log_path, "ab") as log_file:
                child.process = subprocess.Popen(
                    [*self.command, *child.role.args], stdout=log_file, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env={**self.env, SUPERVISOR_ENV: str(os.getpid())},
                    start_new_session=True,
                )
        child.started_at = time.monotonic()

    def _fork_server(self) -> ForkServer:
        """The fork server, started (again, if it died) with the modules of every role."""
        if self._server is None or not self._server.alive:
            if self._server is not None:
                log.warning("the fork server (pid %s) is gone; starting another", self._server.pid)
            components = list(dict.fromkeys(child.role.args[0] for child in self.children))
            self._server = ForkServer(components, self.log_dir / "forkserver.log", self.env)
        return self._server

    def poll(self) -> list[Child]:
        """Restart crashed children whose backoff has passed; return children that completed the run."""
        now = time.monotonic()
        completed = []
        for child in self.children:
            process = child.process
            if child.finished:
                continue
            if process is not None and process.poll() is not None:
                code = process.returncode
                child.exit_codes.append(code)
                child.process = None
                _kill_group(process.pid)  # leftovers (p2pd) of the dead child
                if code == 0:  # a clean exit: the run is done, or the role was told to stop
                    child.finished = True
                    if child.role.completes_run:
                        completed.append(child)
                    continue
                if now - child.started_at > STABLE_SECONDS:
                    child.backoff = BACKOFF_START
                child.next_start = now + child.backoff
                log.warning("%s exited with %s; restarting in %.0fs", child.role.name, code, child.backoff)
                child.backoff = min(child.backoff * 2, BACKOFF_MAX)
            if child.process is None and not child.finished and now >= child.next_start and child.role.restart:
                child.restarts += 1
                self._spawn(child)
        return completed

    @property
    def restarts(self) -> int:
        return sum(child.restarts for child in self.children)

    def stop(self, timeout: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM every role, wait up to `timeout`, then SIGKILL the process groups and wait up
        to KILLED_SECONDS for them all, and as long for the fork server: whatever the load and
        the number of roles, everything is gone inside the 10 s a user waits after Ctrl-C. The
        SIGTERM goes to the role alone: sent to its whole group, it ended the role's p2pd before
        the role's averagers could leave it, which logged their shutdown as failures and held
        the role 3 s in its DHT's grace period."""
        running = [c.process for c in self.children if c.process is not None and c.process.poll() is None]
        for process in running:
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        _wait_all(running, timeout)
        started = [c.process for c in self.children if c.process is not None]
        for process in started:
            _kill_group(process.pid)
        _wait_all(started, KILLED_SECONDS)
        if self._server is not None:
            self._server.close(KILLED_SECONDS)


def _is_ready(host: str, port: Optional[int]) -> bool:
    if not port:
        return True
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/readyz", timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def _wait_all(processes: Sequence[subprocess.Popen | ForkedProcess], timeout: float) -> None:
    """Waits until every one of `processes` has exited, or `timeout` seconds in all."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
