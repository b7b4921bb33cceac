"""`hivekeeper report RUN_DIR`: plots and a Markdown summary of a local run."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("report", help="plot a local run (loss, throughput, rounds, peers) as PNG + Markdown")
    parser.add_argument("run_dir", help="the run directory `hivekeeper up` wrote")
    parser.add_argument("--out", default=None, help="where to write (default: RUN_DIR/report)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hivekeeper.report import write_report

    for path in write_report(Path(args.run_dir), Path(args.out) if args.out else None):
        print(path)
    return 0
