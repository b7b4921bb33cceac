"""`hivekeeper plan averaging|blocks --input FILE [--json]`: the planners, offline."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="solve a planning problem from an input file")
    kinds = parser.add_subparsers(dest="plan_kind", required=True, metavar="KIND")

    averaging = kinds.add_parser("averaging", help="DeDLOC averaging roles and shares (linear program)")
    averaging.add_argument("--input", required=True, help="YAML or JSON file with targetBatchSize, numParameters, peers")
    averaging.add_argument("--json", action="store_true", help="print JSON instead of a table")
    averaging.set_defaults(handler=_plan_averaging)

    blocks = kinds.add_parser("blocks", help="Petals block spans that maximize the worst block's throughput")
    blocks.add_argument("--input", required=True, help="YAML or JSON file with numBlocks and servers")
    blocks.add_argument("--json", action="store_true", help="print JSON instead of a table")
    blocks.set_defaults(handler=_plan_blocks)


def _plan_averaging(args: argparse.Namespace) -> int:
    from hivekeeper.planning.averaging_cli import run_plan_averaging

    return run_plan_averaging(args.input, as_json=args.json)


def _plan_blocks(args: argparse.Namespace) -> int:
    from hivekeeper.planning.blocks_cli import run_plan_blocks

    return run_plan_blocks(args.input, as_json=args.json)
