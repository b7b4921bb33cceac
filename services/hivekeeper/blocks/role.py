"""What every BlockServer role shares with the Swarm roles (arguments, DHT, HTTP endpoint,
signals, structured logs), with the BlockServer's own metrics."""

from __future__ import annotations

import argparse
from hivekeeper.blocks.metrics import BlockMetrics
from hivekeeper.spec import load_manifest
from hivekeeper.spec.blockserver import BlockServerSpec
from hivekeeper.swarm.common import RoleContext, install_signal_handlers


def load_block_context(role: str, args: argparse.Namespace) -> RoleContext:
    manifest = load_manifest(args.manifest)
    if not isinstance(manifest.spec, BlockServerSpec):
        raise SystemExit(f"{args.manifest}: role {role} needs a BlockServer manifest")
    ctx = RoleContext(role=role, args=args, manifest=manifest, metrics=BlockMetrics())  # type: ignore[arg-type]
    install_signal_handlers(ctx.stop)
    return ctx
