"""The `hivekeeper` command line. Each subcommand lives in `hivekeeper.commands.<name>`
and registers itself; heavy imports (torch, hivemind) happen inside the handlers."""

from __future__ import annotations

import argparse
import importlib
import sys

from hivekeeper import __version__
from hivekeeper.errors import UserError

COMMANDS = ("up", "run", "status", "validate", "plan", "crds", "dashboards", "report", "invite", "join")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hivekeeper",
        description="Run decentralized deep-learning swarms locally or in Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"hivekeeper {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hivekeeper.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
