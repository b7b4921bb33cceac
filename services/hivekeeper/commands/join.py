"""`hivekeeper join GATEWAY --token INVITE`: contribute this machine to a swarm from outside."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

MODES = ("auto", "direct", "relay", "client")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "join", help="join a swarm as a volunteer: directly, through a relay, or in client mode")
    parser.add_argument("gateway", metavar="HOST:PORT", help="the swarm's token service (its public address)")
    parser.add_argument("--token", required=True, metavar="INVITE",
                        help="your invite (from `hivekeeper invite`), or a file holding it")
    parser.add_argument("--dry-run", action="store_true",
                        help="only check access and connectivity, print the mode this machine would run in")
    parser.add_argument("--run-dir", default=None, help="where logs, the manifest and summary.json go "
                        "(default: runs/join-TIMESTAMP); keeps this volunteer's key for next time")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--p2p-port", type=int, default=0,
                        help="libp2p port (default: a free one; name a forwarded port to be reachable directly)")
    parser.add_argument("--mode", choices=MODES, default="auto",
                        help="auto (default): direct if the swarm can dial this machine back, else through a "
                             "relay, else client mode (dialing out only)")
    parser.add_argument("--batch-size", type=int, default=None, help="trainer: override trainers.batchSize")
    parser.add_argument("--step-delay", type=float, default=None,
                        help="trainer: extra seconds per batch (emulates a slower device)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hivekeeper.volunteer.join import JoinOptions, join

    role_args: tuple[str, ...] = ()
    if args.batch_size:
        role_args += ("--batch-size", str(args.batch_size))
    if args.step_delay:
        role_args += ("--step-delay", str(args.step_delay))
    run_dir = Path(args.run_dir or f"runs/join-{time.strftime('%Y%m%d-%H%M%S')}")
    return join(JoinOptions(gateway=args.gateway, token=args.token, run_dir=run_dir, host=args.host,
                            p2p_port=args.p2p_port, mode=args.mode, dry_run=args.dry_run, role_args=role_args))
