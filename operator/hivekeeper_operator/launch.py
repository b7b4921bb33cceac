"""What every pod runs: `python -m hivekeeper_operator.launch --component trainer`.

The operator renders every role's `hivekeeper run` arguments with the same topology function
the local runner uses and puts them in the ConfigMap (roles.json). Pods of one StatefulSet
share a template, so each pod picks its own role by its ordinal (the number at the end of a
StatefulSet pod's name, or an Indexed Job's completion index), expands $(VAR) references from
its environment as Kubernetes does in container args (the pod IP it announces), and execs
`hivekeeper run ...` in its place.

A Job's pod (a role whose exit ends the run: a Swarm's monitor, a BlockServer's client...)
runs `hivekeeper run` as a child instead, passing SIGTERM and SIGINT on, and after a successful
exit puts the role's final report (RUN_DIR/result.json, compacted) in the container's
termination message: the pod's emptyDir goes with it, and the operator reads the run's final
figures from there (`readers.final_report_of`). A role stopped by a signal exits 0 (a clean
shutdown), but its pod must not succeed: the Job would count the run as done. It exits
128 + the signal instead, and the Job starts the role again in a new pod (a drained node, a
deleted pod)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

TERMINATION_LOG = "/dev/termination-log"  # Kubernetes' default terminationMessagePath

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


def ends_run(environ: dict[str, str]) -> bool:
    """A pod of an Indexed Job: its role's exit ends the run."""
    return "JOB_COMPLETION_INDEX" in environ


def supervise(executable: str, command: list[str], termination_log: str) -> int:
    """Run the role as a child; after a successful exit, report its result.json."""
    run_dir = Path(command[command.index("--run-dir") + 1]) if "--run-dir" in command[:-1] else None
    if run_dir is not None:  # an earlier container of this pod may have left one (the emptyDir stays)
        (run_dir / "result.json").unlink(missing_ok=True)
    child = subprocess.Popen(command, executable=executable)
    stopped_by: list[int] = []

    def pass_on(number: int, _frame) -> None:
        stopped_by.append(number)
        child.send_signal(number)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == 0 and stopped_by:  # stopped before the run ended
        return 128 + stopped_by[0]
    if code == 0 and run_dir is not None:
        try:
            from hivekeeper_operator.readers import final_report_message

            Path(termination_log).write_text(final_report_message(json.loads((run_dir / "result.json").read_text())))
        except (OSError, ValueError) as e:  # no report: the status keeps the last live figures
            print(f"launch: no final report: {e}", file=sys.stderr)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def main(argv: list[str] | None = None) -> int:
    from hivekeeper_operator.network import CONFIG_DIR  # after the SIGTERM handler (below): pydantic

    parser = argparse.ArgumentParser(prog="python -m hivekeeper_operator.launch")
    parser.add_argument("--component", required=True, help="the pod's component: trainer, block-server, ...")
    parser.add_argument("--roles", default=f"{CONFIG_DIR}/roles.json")
    parser.add_argument("--index", type=int, default=None,
                        help="default: $JOB_COMPLETION_INDEX, else the ordinal in $POD_NAME")
    parser.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    parser.add_argument("--termination-log", default=TERMINATION_LOG,
                        help="where a Job's pod writes its final report (the container's terminationMessagePath)")
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
    if ends_run(dict(os.environ)):
        return supervise(executable, command, args.termination_log)
    os.execv(executable, command)
    return 0  # not reached


if __name__ == "__main__":
    # The pod's PID 1 until it execs the role, or for good where it supervises one: SIGTERM is
    # caught before the heavy imports, as `hivekeeper run` catches it (see end_at_sigterm). A
    # Job's pod replaces the handler with one that passes the signal on, once its role runs.
    from hivekeeper.cli import end_at_sigterm

    end_at_sigterm()
    raise SystemExit(main())
