"""Role processes forked from one process that has already imported what the roles import.

A role that starts as `python -m hivekeeper run ROLE` spends about two CPU-seconds importing
torch, hivemind and its own modules before it does anything; a run of seven roles on a 2-core
host spends most of its start-up there, and so does every restart of a crashed role. The
supervisor of `hivekeeper up` and `hivekeeper join` therefore starts one fork server, which
imports the modules of the run's roles once, and asks it for each role process.

The server is `python -m hivekeeper.local.forkserver ROLE,ROLE,... PADDING`, a child of the
supervisor. It reads requests on its stdin, one JSON object a line, and answers on its stdout:

    {"argv": [...], "env": {...}, "cwd": DIR, "log": PATH}  ->  {"pid": N}  or  {"error": TEXT}

and, whenever one of its children exits, {"exited": N, "code": C}, C as subprocess tells it
(-SIGNAL for a signal). It exits when its stdin closes: its supervisor stopped, or was killed.

A child is what `python -m hivekeeper ARGV` would be: a session of its own, stdin from
/dev/null, stdout and stderr appended to LOG, ENV as its environment, the default signal
handlers, fresh seeds for numpy's and torch's generators (Python's `random` reseeds itself on
fork), its command line (`ps`, /proc/PID/cmdline) rewritten to that command, and an ordinary
interpreter exit (threads joined, atexit handlers run). The server's own command line is padded
(PADDING) so that a child's command line fits where the kernel reads it.

What a module reads from the environment when it is imported, it reads from the server's: the
supervisor starts the server with the environment every child gets (all but the supervisor's
pid, lifeline.SUPERVISOR_ENV, which names the server to its children).

hivemind makes process-shared locks when it is imported (multiprocessing semaphores in shared
memory, which a fork shares rather than copies): MPFuture's, SharedBytes' and its asyncio
executor's. A role that imported hivemind itself shares them only with the processes it forks,
which die with it. Forked from one server, every role of a run would share them, and a role
killed while it held one (a crash, a test's SIGKILL) would leave it held for all the others:
their next DHT process hung at start-up, waiting on it forever. So each child makes its own
(`renew_shared_locks`), as a fresh interpreter would have."""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["ForkServer", "ForkedProcess", "available"]

log = logging.getLogger("hivekeeper.forkserver")

COMMAND_LINE_ROOM = 8192  # bytes of command line a child can take (role arguments are paths)
START_TIMEOUT = 180.0  # the first answer waits for the imports: seconds on a loaded 2-core host
DISABLE_ENV = "HIVEKEEPER_FORKSERVER"  # "0": every role is a fresh interpreter


def available() -> bool:
    """Forking a process that has imported torch is what hivemind itself does (its DHT and
    averagers are forked); it is done on Linux only, where the rest of the lifeline works."""
    return sys.platform.startswith("linux") and os.environ.get(DISABLE_ENV, "1") != "0"


# ---------------------------------------------------------------------------------------------
# The supervisor's end


class ForkedProcess:
    """A child of the fork server, with the part of subprocess.Popen's interface the supervisor
    uses: pid, poll(), wait(), returncode. Its exit code comes from the server."""

    def __init__(self, server: "ForkServer", pid: int):
        self.server, self.pid = server, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """Starts the server (it imports the roles' modules meanwhile) and talks to it."""

    def __init__(self, roles: Sequence[str], log_path: Path, env: dict[str, str]):
        padding = "-" * COMMAND_LINE_ROOM
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hivekeeper.local.forkserver", ",".join(roles), padding],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, env=env,
            )
        self.pid = self.process.pid
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self._codes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._requests = threading.Lock()  # one request in flight: answers come in order
        self._gone = False
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def spawn(self, argv: Sequence[str], log_path: Path, env: dict[str, str]) -> ForkedProcess:
        """A child running `hivekeeper ARGV`; raises OSError if the server cannot start it."""
        request = {"argv": list(argv), "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        with self._requests:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps(request).encode() + b"\n")
                self.process.stdin.flush()
                answer = self._answers.get(timeout=START_TIMEOUT)
            except (OSError, ValueError) as e:  # a closed pipe: the server is gone
                raise OSError(f"the fork server (pid {self.pid}) is gone: {e}") from e
            except queue.Empty:
                raise OSError(f"the fork server (pid {self.pid}) did not answer in {START_TIMEOUT:.0f}s") from None
        if "pid" not in answer:
            raise OSError(f"the fork server could not start {' '.join(argv[:2])}: {answer.get('error')}")
        return ForkedProcess(self, int(answer["pid"]))

    def exit_code(self, pid: int) -> Optional[int]:
        with self._lock:
            if pid in self._codes:
                return self._codes[pid]
        if self._gone:  # nobody reports this child's exit any more: is it still there?
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                with self._lock:
                    return self._codes.setdefault(pid, -signal.SIGKILL)
            except PermissionError:
                pass
        return None

    def close(self, timeout: float = 10.0) -> None:
        """Closes the server's stdin, which ends it; its children are left to their supervisor."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if "exited" in message:
                with self._lock:
                    self._codes[int(message["exited"])] = int(message["code"])
            else:
                self._answers.put(message)
        self._gone = True
        self._answers.put({"error": "the fork server exited"})


# ---------------------------------------------------------------------------------------------
# The server


def preload(roles: Sequence[str]) -> None:
    """Imports what `hivekeeper run ROLE` imports for each role, and the command line itself."""
    from hivekeeper.cli import build_parser
    from hivekeeper.kinds import all_roles

    build_parser("run")
    entries = all_roles()
    for role in roles:
        if role in entries:  # an unknown one is refused by the child's own argument parsing
            importlib.import_module(entries[role].module)


def serve(requests: int, answers: int) -> Optional[dict[str, Any]]:
    """The server's loop. Returns None in the server once `requests` closes, and the request in
    each child it forks (with the server's descriptors and signal handling undone)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up byte is what matters
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    pending = b""

    def answer(message: dict[str, Any]) -> None:
        os.write(answers, json.dumps(message).encode() + b"\n")

    def undo() -> None:
        selector.close()
        signal.set_wakeup_fd(-1)
        for fd in (wake_read, wake_write, requests, answers):
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                try:
                    while os.read(wake_read, 512):
                        pass
                except BlockingIOError:
                    pass
                continue
            data = os.read(requests, 1 << 16)
            if not data:
                undo()
                return None
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    argv, env, cwd, log_path = request["argv"], request["env"], request["cwd"], request["log"]
                    assert isinstance(argv, list) and isinstance(env, dict), "argv must be a list, env an object"
                except (ValueError, KeyError, AssertionError) as e:
                    answer({"error": f"bad request: {e}"})
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    undo()
                    return request
                answer({"pid": pid})
        while True:  # reap every child that exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            answer({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def become(request: dict[str, Any]) -> int:
    """In a forked child: become `python -m hivekeeper ARGV` and run it."""
    os.setsid()
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = [str(word) for word in request["argv"]]
    set_command_line([sys.executable, "-m", "hivekeeper", *argv])
    sys.argv = ["hivekeeper", *argv]
    reseed()
    renew_shared_locks()
    from hivekeeper.cli import main

    return main(argv)


def reseed() -> None:
    """A fork copies its parent's generator states: every child would draw the same numbers."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def renew_shared_locks() -> None:
    """Gives this process its own copies of the process-shared locks hivemind made at import
    (in the server, before the fork): the ones it shares with the server's other children."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()  # MPFuture's two locks and SharedBytes'
    hivemind_asyncio = sys.modules.get("hivemind.utils.asyncio")
    if hivemind_asyncio is not None:
        import multiprocessing

        hivemind_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def set_command_line(words: Sequence[str]) -> None:
    """Writes `words` over this process's command line (where the kernel reads
    /proc/self/cmdline: the memory between the stat file's arg_start and arg_end), cut to the
    room there is. Python keeps its own copy of argv: sys.argv is not touched."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5); these start at 3
        data = "\0".join(words).encode()[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as memory:
            memory.seek(start)
            memory.write(data + b"\0" * (end - start - len(data)))
    except (OSError, ValueError, IndexError) as e:  # ps shows the server's command line: no harm
        log.debug("command line not rewritten: %s", e)


def main(argv: Sequence[str]) -> int:
    roles = [role for role in (argv[0] if argv else "").split(",") if role]
    requests, answers = os.dup(0), os.dup(1)  # the protocol; 0 and 1 of the server go nowhere
    null_fd = os.open(os.devnull, os.O_RDWR)
    os.dup2(null_fd, 0)
    os.dup2(2, 1)  # what the imports print goes to the server's log
    os.close(null_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's to handle
    set_command_line([sys.executable, "-m", "hivekeeper.local.forkserver", ",".join(roles)])
    preload(roles)
    request = serve(requests, answers)
    if request is None:
        # Nothing of the server outlives it but its log: it skips the interpreter's teardown of
        # torch and hivemind, which took over 10 s on a loaded 2-core host, and exits at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return become(request)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
