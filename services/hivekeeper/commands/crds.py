"""`hivekeeper crds --out DIR`: write the CustomResourceDefinitions generated from the spec models."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "crds", help="write the CRDs generated from the spec models (one YAML file per kind)"
    )
    parser.add_argument("--out", action="append", default=None, metavar="DIR",
                        help="directory to write into (repeatable); without it, print the CRDs to stdout")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the files in --out differ from freshly generated ones")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hivekeeper.errors import UserError
    from hivekeeper.spec.crd import crd_files, missing_kinds, write_crds

    missing = missing_kinds()
    if missing:
        raise UserError(f"kinds without a CRD registration in hivekeeper.spec.crd.KINDS: {', '.join(missing)}")
    files = crd_files()
    if not args.out:
        sys.stdout.write("---\n".join(files.values()))
        return 0
    if args.check:
        stale = []
        for out in args.out:
            for name, text in files.items():
                path = Path(out) / name
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path))
        for path in stale:
            print(f"{path}: differs from the spec models; run `hivekeeper crds --out {Path(path).parent}`")
        return 1 if stale else 0
    for out in args.out:
        for path in write_crds(out):
            print(path)
    return 0
