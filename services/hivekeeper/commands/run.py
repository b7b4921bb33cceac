"""`hivekeeper run ROLE ...`: one service process (what every pod and every local child runs).
Role modules are imported only for the role that runs: they pull in torch and hivemind."""

from __future__ import annotations

import argparse
import importlib

from hivekeeper.swarm.common import add_role_arguments

ROLES = {
    "backbone": "hivekeeper.swarm.backbone",
    "trainer": "hivekeeper.swarm.trainer",
    "auxiliary": "hivekeeper.swarm.auxiliary",
    "monitor": "hivekeeper.swarm.monitor",
    "balancer": "hivekeeper.swarm.balancer",
    "backbone-experts": "hivekeeper.experts.backbone",
    "expert-server": "hivekeeper.experts.server",
    "expert-trainer": "hivekeeper.experts.trainer",
    "backbone-blocks": "hivekeeper.blocks.backbone",
    "block-server": "hivekeeper.blocks.server",
    "block-balancer": "hivekeeper.blocks.balancer",
    "block-client": "hivekeeper.blocks.client_role",
    "relay": "hivekeeper.volunteer.relay",
    "auth": "hivekeeper.auth.role",
}


def _trainer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=None, help="override trainers.batchSize")
    parser.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per batch (emulates a slow device)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--trace", default=None, help="append one JSON line per batch and per round to this file")


def _block_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", default=None, metavar="START:END",
                        help="hold exactly these blocks (no block selection, no moving)")


EXTRA_ARGUMENTS = {"trainer": _trainer_arguments, "block-server": _block_server_arguments}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run one service role (used by pods and the local runner)")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, module_name in ROLES.items():
        role_parser = roles.add_parser(role, help=f"the {role} role")
        add_role_arguments(role_parser)
        if role in EXTRA_ARGUMENTS:
            EXTRA_ARGUMENTS[role](role_parser)
        role_parser.set_defaults(handler=_run_role, role_module=module_name)


def _run_role(args: argparse.Namespace) -> int:
    return importlib.import_module(args.role_module).run(args)
