"""A role killed with SIGKILL takes every process it started with it (the processes hivemind
forks: its DHT's, its averagers'; each DHT's p2pd; torch's shared-memory manager), and
`hivekeeper up` killed with SIGKILL takes every role of its run and theirs: one run of each kind,
with every role the kind has (the Swarm's with the relay and the token service), every role killed
at once, then, once the runner has restarted them all, the runner.

While the roles are killed the runner is stopped (SIGSTOP): its clean-up of a dead child's
process group, which kills what the child left there, must not be what removes them. Processes
are named by pid and start time, recorded before the kill; the runner restarts each killed role
(with the same name, ports and keys)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import parent_pid, print_run_logs, wait_for, write_manifest
from helpers.processes import Proc, describe, kill_all, proc, tree, wait_gone
from hivekeeper.local.network import free_port
from hivekeeper.runtime.lifeline import POLL_SECONDS, STOP_GRACE_SECONDS
from test_swarm_local import http_get, ports, processes_of

READY_SECONDS = 240.0  # a role (re)started on a loaded 2-core host: torch, hivemind, the DHT
# a killed role's forks and p2pd go at once; torch's shared-memory manager (a session of its own)
# 2 s after its last client, or later (below)
KILL_SECONDS = 15.0
# each role sees the runner gone, stops, and is killed STOP_GRACE_SECONDS later; then as above
RUNNER_SECONDS = POLL_SECONDS + STOP_GRACE_SECONDS + KILL_SECONDS
# torch's shared-memory manager is torch's, not ours, and ends by itself once its clients have:
# CI once found one still running (state R) 15 s past RUNNER_SECONDS, its clients all gone
SHM_MANAGER = "torch_shm_manag"  # its name in /proc/PID/comm
SHM_MANAGER_SECONDS = 60.0


def wait_gone_with_torch(procs: list[Proc], timeout: float) -> list[Proc]:
    """`wait_gone`, then as long again as SHM_MANAGER_SECONDS for torch's shared-memory
    managers, if they are all that is left."""
    left = wait_gone(procs, timeout)
    if left and all(p.comm == SHM_MANAGER for p in left):
        left = wait_gone(left, SHM_MANAGER_SECONDS)
    return left


def swarm() -> tuple[str, dict[str, Any], list[str]]:
    relay, gateway = free_port(), free_port()
    while gateway == relay:
        gateway = free_port()
    changes = {"spec": {"trainers": {"replicas": 1}, "auxiliary": {"replicas": 1},
                        "stopping": {"targetSteps": 1_000_000, "targetMetric": None},
                        "volunteers": {"relays": 1, "relayPort": relay, "gatewayPort": gateway}}}
    roles = ["trainer-0", "auxiliary-0", "monitor-0", "relay-0", "auth-0", "backbone-0", "balancer-0"]
    return "swarm-digits-volunteers.yaml", changes, roles


def blockserver() -> tuple[str, dict[str, Any], list[str]]:
    # One server holding half the model: the client waits for a route to the rest, and the run,
    # which ends when the client is done, goes on.
    changes = {"spec": {"servers": {"replicas": 1, "spanLength": 3}}}
    return "blockserver.yaml", changes, ["block-client-0", "block-server-0", "block-balancer-0", "backbone-blocks-0"]


def expertpool() -> tuple[str, dict[str, Any], list[str]]:
    changes = {"metadata": {"name": "moe-kill"}, "spec": {
        "grid": {"dimensions": [2, 2]}, "expert": {"hiddenSize": 16}, "servers": {"replicas": 1},
        "trainers": {"batchSize": 16, "batchesInFlight": 1, "dmoe": {"layers": 1, "kBest": 2}},
        "stopping": {"targetSteps": 1_000_000, "targetMetric": None}}}
    return "expertpool.yaml", changes, ["expert-server-0", "expert-trainer-0", "backbone-experts-0"]


def children(pid: int) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and parent_pid(int(e.name)) == pid]


def role_process(runner: subprocess.Popen, name: str) -> Optional[Proc]:
    """The process that runs role `name` (`hivekeeper run COMPONENT --index I ...`): a child of
    the runner's fork server."""
    component, index = name.rsplit("-", 1)
    for pid in (role for server in children(runner.pid) for role in children(server)):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"\0run\0{component}\0".encode() in cmdline and f"\0--index\0{index}\0".encode() in cmdline:
            return proc(pid)
    return None


class Run:
    """`hivekeeper up` of one kind's manifest."""

    def __init__(self, tmp_path: Path, base: str, changes: dict[str, Any]):
        self.run_dir = tmp_path / "run"
        self.log = tmp_path / "up.log"
        manifest = write_manifest(tmp_path, changes, base=base)
        with open(self.log, "wb") as log:
            self.runner = subprocess.Popen([sys.executable, "-m", "hivekeeper", "up", str(manifest), "--run-dir",
                                            str(self.run_dir)], stdout=log, stderr=subprocess.STDOUT)
        self.seen: set[Proc] = set()  # every process of the run seen, for the clean-up

    def ready(self, name: str) -> Optional[list[Proc]]:
        """Role `name`'s process and all below it, once it is ready and (but the token service,
        which joins no DHT) runs its p2pd."""
        main = role_process(self.runner, name)
        if main is None or http_get(ports(self.run_dir).get(name, 0), "/readyz") != "ready\n":
            return None
        procs = tree(main.pid)
        self.seen.update(procs)
        if not name.startswith("auth-") and not any(p.comm == "p2pd" for p in procs):
            return None
        return procs

    def stop_runner_when(self, condition, what: str):
        """Stops the runner (SIGSTOP) at a moment `condition()` holds, checked again once it is
        stopped (a role may exit by itself meanwhile); returns its value. The runner stays stopped."""
        for _ in range(5):
            wait_for(condition, READY_SECONDS, what)
            os.kill(self.runner.pid, signal.SIGSTOP)
            value = condition()
            if value:
                return value
            os.kill(self.runner.pid, signal.SIGCONT)
        raise AssertionError(f"{what}: never so with the runner stopped")

    def stop_runner_when_ready(self, names: list[str]) -> dict[str, list[Proc]]:
        """Stops the runner once every role in `names` is ready; each one's processes."""
        trees: dict[str, list[Proc]] = {}

        def every_role_ready() -> bool:
            trees.clear()
            for name in names:
                procs = self.ready(name)
                if procs:
                    trees[name] = procs
            return len(trees) == len(names)

        try:
            self.stop_runner_when(every_role_ready, "every role ready")
        except AssertionError as e:
            raise AssertionError(f"{e}; not ready: {', '.join(set(names) - set(trees))}") from None
        return dict(trees)

    def kill_roles(self, names: list[str]) -> dict[str, list[Proc]]:
        """SIGKILL every role at once, each ready, with the runner stopped; what of each is left
        after KILL_SECONDS (the roles with nothing left are not named)."""
        trees = self.stop_runner_when_ready(names)
        try:
            for procs in trees.values():
                os.kill(procs[0].pid, signal.SIGKILL)
            left = set(wait_gone_with_torch([p for procs in trees.values() for p in procs], KILL_SECONDS))
            return {name: [p for p in procs if p in left] for name, procs in trees.items() if left & set(procs)}
        finally:
            os.kill(self.runner.pid, signal.SIGCONT)

    def kill_runner(self, names: list[str]) -> list[Proc]:
        """SIGKILL the runner once every role is ready; what of the run is left after RUNNER_SECONDS."""
        self.stop_runner_when_ready(names)
        procs = [p for child in children(self.runner.pid) for p in tree(child)]  # nothing starts now
        self.seen.update(procs)
        os.kill(self.runner.pid, signal.SIGKILL)
        self.runner.wait(10)
        return wait_gone_with_torch(procs, RUNNER_SECONDS)

    def clean_up(self) -> None:
        """Whatever happened: the runner and every process of the run are killed."""
        if self.runner.poll() is None:
            os.kill(self.runner.pid, signal.SIGCONT)
            self.runner.kill()
            self.runner.wait(30)
        kill_all([*self.seen, *(p for pid in processes_of(self.run_dir) for p in tree(pid))])


@pytest.mark.swarm
@pytest.mark.timeout(900)  # a hang guard: about 2 minutes a kind on an idle 2-core host
@pytest.mark.parametrize("kind", [swarm, blockserver, expertpool], ids=["Swarm", "BlockServer", "ExpertPool"])
def test_killed_roles_and_runner_leave_nothing(kind, tmp_path, no_leaked_p2pd):
    base, changes, roles = kind()
    run = Run(tmp_path, base, changes)
    try:
        wait_for(lambda: ports(run.run_dir), READY_SECONDS, "the run laid out")
        assert set(ports(run.run_dir)) == set(roles), "every role of the kind is killed"
        left_by_role = run.kill_roles(roles)
        assert not left_by_role, "roles killed: still running\n" + "\n".join(
            f"{name}:\n{describe(left)}" for name, left in left_by_role.items())
        left = run.kill_runner(roles)
        assert not left, f"runner killed: still running\n{describe(left)}"
        assert not processes_of(run.run_dir)
    finally:
        print_run_logs(run.run_dir, run.log)  # before the clean-up: a role that hangs writes where it waits
        run.clean_up()
