"""`hivekeeper validate MANIFEST...`: check manifests without running anything."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("validate", help="check manifests against the spec; exit 2 on the first error")
    parser.add_argument("manifests", nargs="+")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hivekeeper.spec import load_manifest

    for path in args.manifests:
        manifest = load_manifest(path)
        print(f"{path}: valid {manifest.kind} {manifest.metadata.name!r}")
    return 0
