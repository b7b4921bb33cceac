"""The fork server that starts `hivekeeper up`'s roles (hivekeeper.local.forkserver): a child is
`python -m hivekeeper ARGV` in a session of its own, with its own environment, log, command line
and exit code; a bad request is refused and the server serves on; the server ends with its
stdin; a supervisor whose server died starts another. (The roles it starts for real: the swarm
tier's `hivekeeper up` tests, and tests/test_role_kill.py for what a killed one leaves.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import descendants, wait_for
from hivekeeper.local.forkserver import START_TIMEOUT, ForkServer
from hivekeeper.local.supervisor import Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server runs on Linux")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "swarm-digits.yaml"


@pytest.fixture
def server(tmp_path):
    """A fork server; whatever it started is killed at the end (a child a failed test left
    waiting on its FIFO too). It preloads no role's modules: what these tests check does not
    depend on them, and with them each test took 86-106 s (11-15 s of CPU) in a slow CI run
    beside the cluster tier (the swarm tier's `hivekeeper up` tests fork roles from preloaded
    servers)."""
    started = ForkServer([], tmp_path / "forkserver.log", {**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield started
    finally:
        for pid in descendants(started.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        started.close()
    assert started.process.returncode == 0, (tmp_path / "forkserver.log").read_text()


def command_line(pid: int) -> list[str]:
    return [w.decode() for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]


def test_a_child_is_the_command_in_its_own_session_with_its_log(server, tmp_path):
    """(Its environment is the request's: the role watches the pid the supervisor puts there,
    which tests/test_role_kill.py shows when it kills the runner.)"""
    fifo = tmp_path / "manifest.yaml"
    os.mkfifo(fifo)  # `validate` waits on it: the child lives until the test writes the manifest
    log = tmp_path / "child.log"
    child = server.spawn(["validate", str(fifo)], log, dict(os.environ))
    assert child.pid != server.pid and child.poll() is None
    words = wait_for(lambda: (w := command_line(child.pid)) and w[1:] == ["-m", "hivekeeper", "validate", str(fifo)]
                     and w, 30, "the child's command line")
    assert words[0] == sys.executable
    assert os.getsid(child.pid) == child.pid  # killpg(pid) reaches it and what it starts
    fifo.write_text(EXAMPLE.read_text())
    assert child.wait(30) == 0
    assert f"{fifo}: valid Swarm 'digits'" in log.read_text()


def test_exit_codes_reach_the_supervisor_as_subprocess_gives_them(server, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Nope\n")
    refused = server.spawn(["validate", str(bad)], tmp_path / "bad.log", dict(os.environ))
    assert refused.wait(30) == 2 and "apiVersion" in (tmp_path / "bad.log").read_text()
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    killed = server.spawn(["validate", str(fifo)], tmp_path / "killed.log", dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        killed.wait(0.5)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(30) == -signal.SIGKILL


def test_a_bad_request_is_refused_and_the_server_serves_on(server, tmp_path):
    assert server.process.stdin is not None
    server.process.stdin.write(b'{"argv": "not a list"}\n')
    server.process.stdin.flush()
    # the first answer comes once the server has imported what it preloads: it waits as long
    # as spawn() does
    assert "bad request" in server._answers.get(timeout=START_TIMEOUT)["error"]
    child = server.spawn(["validate", str(EXAMPLE)], tmp_path / "child.log", dict(os.environ))
    assert child.wait(30) == 0


def test_children_get_their_own_random_seeds():
    """A fork copies numpy's and torch's generator states; reseed(), which every child runs,
    draws new ones (Python's `random` reseeds itself on fork)."""
    probe = (
        "import os, numpy, torch\n"
        "from hivekeeper.local.forkserver import reseed\n"
        "numpy.random.seed(0); torch.manual_seed(0)\n"
        "draws = []\n"
        "for _ in range(2):\n"
        "    r, w = os.pipe()\n"
        "    if os.fork() == 0:\n"
        "        reseed(); os.write(w, f'{numpy.random.randint(1 << 30)} {torch.randint(1 << 30, ()).item()}'.encode())\n"
        "        os._exit(0)\n"
        "    os.close(w); draws.append(os.read(r, 100).decode()); os.wait()\n"
        "numpy.random.seed(0); torch.manual_seed(0)\n"
        "unseeded = f'{numpy.random.randint(1 << 30)} {torch.randint(1 << 30, ()).item()}'\n"
        "print(len({*draws, unseeded}) == 3)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr


def test_the_server_ends_when_its_stdin_closes(tmp_path):
    server = ForkServer([], tmp_path / "forkserver.log", dict(os.environ))
    server.close()
    assert server.process.returncode == 0 and not server.alive


def test_a_dead_server_refuses_clearly_and_the_supervisor_starts_another(tmp_path):
    server = ForkServer([], tmp_path / "forkserver.log", dict(os.environ))
    server.process.kill()
    server.process.wait(10)
    with pytest.raises(OSError, match="fork server"):
        server.spawn(["validate", str(EXAMPLE)], tmp_path / "child.log", dict(os.environ))
    supervisor = Supervisor([], tmp_path / "logs")
    first = supervisor._fork_server()
    assert supervisor._fork_server() is first
    first.process.kill()
    first.process.wait(10)
    wait_for(lambda: not first.alive, 10, "the supervisor to see its server gone")
    second = supervisor._fork_server()
    assert second is not first and second.alive
    child = second.spawn(["validate", str(EXAMPLE)], tmp_path / "child.log", dict(os.environ))
    assert child.wait(60) == 0  # the new server serves
    supervisor.stop()  # gives a server 2 s after its stdin closes, then kills it: gone either way
    assert second.process.poll() is not None and not second.alive


def _child_gets_hivemind_locks(renew: bool) -> int:
    """Forks a child that takes hivemind's process-shared locks (after renewing them, or not)
    while this process holds them; its exit code: 0 if it got them all within 5 s, 1 if not."""
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    from hivekeeper.local.forkserver import renew_shared_locks

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if renew:
                renew_shared_locks()
            locks = [MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock,
                     _AsyncContextWrapper.EXECUTOR_LOCK]
            code = 0 if all(lock.acquire(timeout=5) for lock in locks) else 1
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.isolated  # forks the test process after importing hivemind
def test_a_child_does_not_wait_on_locks_a_sibling_holds():
    """hivemind's locks are semaphores in shared memory, made at import: every child of the
    server shares the server's. Held by one role (killed while it held them, it holds them for
    good), they stopped the next DHT process of every other role. A child makes its own."""
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    held = [MPFuture._initialization_lock, MPFuture._update_lock, SharedBytes._lock,
            _AsyncContextWrapper.EXECUTOR_LOCK]
    for lock in held:
        assert lock.acquire(timeout=5)  # this process plays the sibling that holds them
    try:
        assert _child_gets_hivemind_locks(renew=False) == 1  # the hazard: shared, and held
        assert _child_gets_hivemind_locks(renew=True) == 0
    finally:
        for lock in held:
            lock.release()
