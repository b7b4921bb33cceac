"""Shared helpers: manifests written to tmp dirs, a Swarm optimizer peer for forked test
processes, and a check that no p2pd outlives a test."""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
import yaml

# The real-cluster tier's fixtures (tests/e2e/): a plugin, since a second conftest.py would
# replace this one under the module name `conftest` that the tests import from. Each test's
# CPU time goes to the JUnit report (helpers/cpu_time.py).
pytest_plugins = ["e2e.support", "helpers.cpu_time"]

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


def wait_for(condition, timeout: float, what: str, interval: float = 0.5, explain=None):
    """Poll `condition` until it returns something truthy (returned), or fail naming `what` and,
    with `explain`, what `explain()` says then (say, the status of the role that never got there).
    Each wait prints how long it took: a failing test's output shows where its time went."""
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            print(f"waited {time.monotonic() - start:.1f} s of {timeout:.0f} for {what}")
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f": {explain()}" if explain else ""))


def interrupt_run(runner) -> dict[str, Any]:
    """Ctrl-C a `hivekeeper up --json` the test has seen enough of; its summary (exit code 130)."""
    runner.send_signal(signal.SIGINT)
    out, err = runner.communicate(timeout=60)
    assert runner.returncode == 130, err[-3000:]
    return json.loads(out)


def print_run_logs(run_dir: Path, *extra: Path, tail: int = 4000) -> None:
    """The end of each log of a local run (and of `extra` files): pytest shows what a test
    printed when it fails, so a failed run explains itself. Every process of the run still up
    first writes its threads' stacks to its log (SIGUSR1: commands.run), so a role that hangs
    shows where."""
    signalled = False
    for pid in run_processes(run_dir):
        try:
            os.kill(pid, signal.SIGUSR1)
            signalled = True
        except OSError:
            pass
    if signalled:
        time.sleep(1.0)
    for path in [*extra, *sorted((run_dir / "logs").glob("*.log"))]:
        print(f"--- {path.name}:", path.read_text(errors="replace")[-tail:] if path.exists() else "(none)")


def command_words(pid: int) -> list[bytes]:
    """A process's command line, word by word ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def processes_of(run_dir: Path) -> list[int]:
    """PIDs of the processes of a local run but its runner: those whose command line names the
    run's folder (its roles, what they forked, its Prometheus)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            words = command_words(int(entry.name))
            if str(run_dir).encode() in b" ".join(words) and b"up" not in words:
                found.append(int(entry.name))
    return found


def run_processes(run_dir: Path) -> list[int]:
    """The roles of a local run and what they forked (`hivekeeper run ...`): not its
    Prometheus, which SIGUSR1 would end."""
    return [pid for pid in processes_of(run_dir) if b"run" in command_words(pid)]


def kill_leftover(runner) -> None:
    """In a test's `finally`: a run still up after a failure is killed, with its children."""
    if runner.poll() is None:
        runner.kill()
        runner.wait(30)


def parent_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@pytest.fixture(autouse=True)
def _p2pd_dies_with_its_dht(request):
    """In a test that starts hivemind peers in this process (isolated, swarm), every p2pd starts
    with its parent-death signal set, as a role's does (`runtime.lifeline`): a DHT process that
    dies takes its p2pd with it. (hivemind's DHT process dies when a request arrives from an
    averager process that has just exited: its pipe cannot be unpickled.)"""
    global _P2PD_DIES_WITH_ITS_DHT
    if not _P2PD_DIES_WITH_ITS_DHT and (request.node.get_closest_marker("isolated")
                                        or request.node.get_closest_marker("swarm")):
        from hivekeeper.hivemind_ext.p2pd import die_with_parent
        from hivekeeper.runtime.lifeline import exec_prefix

        die_with_parent(exec_prefix())
        _P2PD_DIES_WITH_ITS_DHT = True
    yield


_P2PD_DIES_WITH_ITS_DHT = False


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


@contextmanager
def optimizer_peer(manifest_path: str, run_id: str, initial_peers: Sequence[str] = (), batch_size: int = 16,
                   announce=None) -> Iterator[tuple[Any, Any, Any, Any]]:
    """A Swarm trainer's optimizer on the manifest's digits task, with a DHT of its own, for a
    peer forked off by a test (hivemind signs progress with one key per process, so two
    optimizers in one process count as one peer). `announce(maddrs)` is called once the DHT is
    up. Yields (task, model, metrics, optimizer); everything is shut down on exit."""
    import hivemind
    import torch

    from hivekeeper.metrics import SwarmMetrics
    from hivekeeper.spec import load_manifest
    from hivekeeper.swarm.optimizer import make_collaborative_optimizer
    from hivekeeper.tasks import load_task

    manifest = load_manifest(manifest_path)
    task = load_task("digits", manifest.spec.task.options)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers))
    if announce is not None:
        announce([str(a) for a in dht.get_visible_maddrs()])
    torch.manual_seed(0)
    model, metrics = task.build_model(), SwarmMetrics()
    opt = make_collaborative_optimizer(manifest.spec, run_id, dht, model, metrics, batch_size=batch_size)
    try:
        yield task, model, metrics, opt
    finally:
        opt.shutdown()
        dht.shutdown()


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            children.setdefault(parent_pid(int(entry.name)), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def forked_result(target, *args: Any, timeout: float, what: str) -> Any:
    """Run target(*args, out) in a forked process and return the first thing it puts on `out`;
    the process is stopped either way."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, out))
    process.start()
    try:
        return out.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"{what} did not report in {timeout:.0f} s")
    finally:
        stop_processes(process)


def stop_processes(*processes) -> None:
    """Joins forked test processes, killing any that do not exit within 30 s together with all
    it started: hivemind's DHT and averager processes outlive their parent's SIGKILL (each holds
    both ends of its control pipe, so it never reads EOF) and would run on, p2pd and all, holding
    the test run's stdout open."""
    for process in processes:
        if process is not None:
            process.join(30)
            if process.is_alive():
                os.kill(process.pid, signal.SIGSTOP)  # it starts nothing more while its tree is read
                for pid in [process.pid, *descendants(process.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                process.join(5)
