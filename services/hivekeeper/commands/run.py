"""`hivekeeper run ROLE ...`: one service process (what every pod and every local child runs).
The roles are every kind's (`hivekeeper.kinds`) and the two that let volunteers in; a role's
module is imported only when it runs (roles pull in torch and hivemind). Every process a role
starts dies with it (`hivekeeper.runtime.lifeline`)."""

from __future__ import annotations

import argparse
import importlib

from hivekeeper.kinds import KIND_MODULES, runtime
from hivekeeper.runtime import arguments, lifeline
from hivekeeper.runtime.arguments import RoleEntry

ACCESS_ROLES = {
    "relay": RoleEntry("hivekeeper.volunteer.relay", (arguments.peer_access, arguments.relay)),
    "auth": RoleEntry("hivekeeper.volunteer.token_service", (arguments.token_service,)),
}


def all_roles() -> dict[str, RoleEntry]:
    roles: dict[str, RoleEntry] = {}
    for kind in KIND_MODULES:
        roles.update(runtime(kind).role_modules)
    return {**roles, **ACCESS_ROLES}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run one service role (used by pods and the local runner)")
    roles = parser.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, entry in all_roles().items():
        role_parser = roles.add_parser(role, help=entry.help or f"the {role} role")
        arguments.common(role_parser)
        for argument_set in entry.arguments:
            argument_set(role_parser)
        role_parser.set_defaults(handler=_run_role, role_module=entry.module)


def _run_role(args: argparse.Namespace) -> int:
    lifeline.install()  # before the role forks anything; in role processes only
    return importlib.import_module(args.role_module).run(args)
