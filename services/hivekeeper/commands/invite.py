"""`hivekeeper invite RUN_DIR --identity NAME`: an invite for a volunteer, signed by the swarm's
key. The token service admits its holder while NAME stays on the swarm's allowlist."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from hivekeeper.errors import UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("invite", help="invite a volunteer into a swarm that admits peers by token")
    parser.add_argument("run_dir", nargs="?", default=None,
                        help="a local run's directory (its keys/swarm-auth.pem signs the invite)")
    parser.add_argument("--key-file", default=None, metavar="PATH",
                        help="the swarm's signing key instead (in a cluster: the Secret NAME-swarm-auth)")
    parser.add_argument("--identity", required=True, help="who it is for; must be on the swarm's allowlist")
    parser.add_argument("--hours", type=float, default=24 * 7, help="how long the invite is good for (default a week)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if (args.run_dir is None) == (args.key_file is None):
        raise UserError("give a run directory or --key-file, one of them")
    if args.hours <= 0:
        raise UserError(f"--hours must be positive, not {args.hours}")
    key_path = Path(args.key_file) if args.key_file else Path(args.run_dir) / "keys" / "swarm-auth.pem"
    if not key_path.is_file():
        raise UserError(f"{key_path}: no signing key (does the swarm set volunteers.enabled?)")
    from hivekeeper.auth.signing import load_signing_key
    from hivekeeper.auth.tokens import mint_invite

    try:
        key = load_signing_key(key_path)
    except ValueError as e:
        raise UserError(f"{key_path}: not a signing key: {e}") from None
    print(mint_invite(key, args.identity, time.time() + args.hours * 3600))
    return 0
