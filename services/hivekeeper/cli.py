"""The `hivekeeper` command line. Each subcommand lives in `hivekeeper.commands.<name>`
and registers itself; heavy imports (torch, hivemind) happen inside the handlers.

A command line that names its command imports and registers only that command's module
(`hivekeeper run`'s roles alone take half a second to register, and `plan averaging` should
not pay for them); without one (`--help`, no arguments, a mistyped name) every command is
registered, so the listing and the error name them all."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Optional, Sequence

from hivekeeper import __version__
from hivekeeper.errors import UserError

COMMANDS = ("up", "run", "status", "validate", "plan", "crds", "dashboards", "report", "invite", "join")


def named_command(argv: Sequence[str]) -> Optional[str]:
    """The command `argv` runs, when its first argument is one (the top level takes no option
    before it but --help and --version, which need every command or none)."""
    return argv[0] if argv and argv[0] in COMMANDS else None


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser for `command` alone, or with every command registered."""
    parser = argparse.ArgumentParser(
        prog="hivekeeper",
        description="Run decentralized deep-learning swarms locally or in Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"hivekeeper {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in (command,) if command else COMMANDS:
        importlib.import_module(f"hivekeeper.commands.{name}").register(subparsers)
    return parser


def end_at_sigterm() -> None:
    """SIGTERM ends the process from now on, as its default action would. In a pod the role (and
    before it the pod's launcher) is PID 1, which the kernel does not end on a signal it has no
    handler for: a pod deleted while its role was still importing torch waited out its whole
    grace period (52 s for a Swarm's) before the kubelet killed it. A role installs its
    clean-stop handler once it can stop."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if named_command(argv) == "run":
        end_at_sigterm()
    if argv[:1] == ["--version"]:  # as argparse would print it, without importing every command
        print(f"hivekeeper {__version__}")
        return 0
    args = build_parser(named_command(argv)).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
