"""What a Swarm pod runs: `python -m hivekeeper_operator.launch --component trainer`.

The operator renders every role's `hivekeeper run` arguments with the same topology function
the local runner uses and puts them in the ConfigMap (roles.json). Pods of one StatefulSet
share a template, so each pod picks its own role by its ordinal (the number at the end of a
StatefulSet pod's name, or an Indexed Job's completion index), expands $(VAR) references from its environment as Kubernetes does in
container args (the pod IP it announces), and execs `hivekeeper run ...` in its place."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from hivekeeper_operator.network import CONFIG_DIR

_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, environ: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: unknown variables stay as they are."""
    return _VARIABLE.sub(lambda m: environ.get(m.group(1), m.group(0)), arg)


def ordinal(pod_name: str) -> int:
    match = re.search(r"-(\d+)$", pod_name)
    if not match:
        raise SystemExit(f"launch: cannot read a StatefulSet ordinal from the pod name {pod_name!r}")
    return int(match.group(1))


def resolve(roles: dict, component: str, index: int, environ: dict[str, str]) -> list[str]:
    name = f"{component}-{index}"
    if name not in roles:
        known = ", ".join(sorted(roles)) or "none"
        raise SystemExit(f"launch: no role {name!r} in the rendered roles (known: {known}); "
                         "the ConfigMap may not be updated yet, the pod will restart")
    return [expand(arg, environ) for arg in roles[name]["args"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hivekeeper_operator.launch")
    parser.add_argument("--component", required=True, help="backbone | trainer | auxiliary | monitor")
    parser.add_argument("--roles", default=f"{CONFIG_DIR}/roles.json")
    parser.add_argument("--index", type=int, default=None,
                        help="default: $JOB_COMPLETION_INDEX, else the ordinal in $POD_NAME")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)

    roles = json.loads(Path(args.roles).read_text())
    if args.index is not None:
        index = args.index
    elif "JOB_COMPLETION_INDEX" in os.environ:  # a pod of an Indexed Job (roles that end the run)
        index = int(os.environ["JOB_COMPLETION_INDEX"])
    else:
        index = ordinal(os.environ.get("POD_NAME", ""))
    command = ["hivekeeper", "run", *resolve(roles, args.component, index, dict(os.environ))]
    if args.dry_run:
        print(json.dumps(command))
        return 0
    executable = shutil.which("hivekeeper") or command[0]
    sys.stdout.flush()
    os.execv(executable, command)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
