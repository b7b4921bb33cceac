"""`hivekeeper crds --out DIR`: write the CustomResourceDefinitions generated from the spec models.

In this repository: `hivekeeper crds --out crds --out charts/hivekeeper/files/crds` (crds/ for
`kubectl apply -f crds/`; the chart renders its copy as templates, so `helm upgrade` upgrades them)."""

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

    for out in args.out or ():
        if Path(out).name == "crds" and (Path(out).parent / "Chart.yaml").exists():
            # Helm installs a chart's crds/ once and never upgrades it; the chart's templates/crds.yaml
            # renders the CRDs from files/crds instead, and the two would clash on install.
            raise UserError(f"{out}: a Helm chart's crds/ folder is never upgraded; write the chart's CRDs to "
                            f"{Path(out).parent / 'files' / 'crds'}")
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
