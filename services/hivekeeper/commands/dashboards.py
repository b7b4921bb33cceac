"""`hivekeeper dashboards --out DIR`: write the Grafana dashboards (one JSON file each)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("dashboards", help="write the Grafana dashboards as JSON (one file each)")
    parser.add_argument("--out", default=None, metavar="DIR", help="directory to write into; without it, list them")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hivekeeper.dashboards import DASHBOARDS, write

    if not args.out:
        for dashboard in DASHBOARDS:
            sys.stdout.write(f"{dashboard.uid}.json  {dashboard.title}: {len(dashboard.panels)} panels\n")
        return 0
    for path in write(args.out):
        print(path)
    return 0
