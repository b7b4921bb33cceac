"""`hivekeeper run ROLE ...`: one service process (what every pod and every local child runs).
The roles are every kind's (`hivekeeper.kinds`) and the two that let volunteers in; a role's
module is imported only when it runs (roles pull in torch and hivemind). Every process a role
starts dies with it (`hivekeeper.runtime.lifeline`).

A role that returns has shut its DHT, p2pd and averagers down and closed its files: the process
then exits at once, skipping the interpreter's teardown of torch and hivemind, which nothing
needs and which took a trainer 2 s on an idle host (the fork server's like teardown took over
10 s on a loaded one); a pod's stop, and every local run's, waited for it. A role that raises ends as any Python program does.

A role, and every process it forks, writes the stack of each of its threads to its log on
SIGUSR1 (`kill -USR1 PID`): what a process that hangs waits for, read without stopping it.
Python's faulthandler writes it from the signal handler itself, so a process whose every thread
is blocked on a lock still answers."""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import importlib
import logging
import os
import signal
import sys

from hivekeeper.kinds import all_roles
from hivekeeper.runtime import arguments, lifeline


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run one service role (used by pods and the local runner)")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, entry in all_roles().items():
        role_parser = roles.add_parser(role, help=entry.help or f"the {role} role")
        arguments.common(role_parser)
        for argument_set in entry.arguments:
            argument_set(role_parser)
        role_parser.set_defaults(handler=_run_role, role_module=entry.module, lab_role=entry.lab_role)


def _run_role(args: argparse.Namespace) -> int:
    lifeline.install()  # before the role forks anything; in role processes only
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # inherited by what the role forks
    code = int(importlib.import_module(args.role_module).run(args) or 0)
    atexit._run_exitfuncs()  # what the role's libraries registered (multiprocessing's, ours) still runs
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
