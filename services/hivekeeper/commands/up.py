"""`hivekeeper up MANIFEST`: run a manifest on this machine, no cluster needed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="run a manifest locally as supervised processes (on 127.0.0.1 by default)")
    parser.add_argument("manifest", help="a Swarm manifest (YAML)")
    parser.add_argument("--run-dir", default=None, help="where logs, checkpoints and summary.json go "
                        "(default: runs/NAME-TIMESTAMP)")
    parser.add_argument("--json", action="store_true", help="print the final summary as JSON on stdout")
    parser.add_argument("--prometheus", action="store_true",
                        help="also run a local Prometheus scraping every process (needs the prometheus binary)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every process listens on and announces (volunteers dial relays here)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hivekeeper.spec import load_manifest

    manifest = load_manifest(args.manifest)  # bad input: one line, exit 2, nothing started
    join = getattr(manifest.spec, "join", None)
    if join is not None:
        from hivekeeper.errors import UserError

        raise UserError(f"{args.manifest}: spec.join: a lab's cluster joins another's swarm through the operator; "
                        f"on one machine, join it with `hivekeeper join {join.gateway} --token INVITE`")
    if args.prometheus:
        from hivekeeper.local.prometheus import prometheus_binary

        prometheus_binary()  # a missing binary is bad input too
    run_dir = Path(args.run_dir or f"runs/{manifest.metadata.name}-{time.strftime('%Y%m%d-%H%M%S')}")

    from hivekeeper.local.runner import run_locally

    summary = run_locally(manifest, run_dir, prometheus=args.prometheus, host=args.host)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in summary["metrics"].items())
        print(f"{summary['state']}: step {summary['globalStep']}, {metrics or 'no metrics'}, "
              f"{summary['wallSeconds']:.0f}s, {summary['restarts']} restarts -> {run_dir / 'summary.json'}")
    return {"completed": 0, "interrupted": 130}.get(summary["state"], 1)
