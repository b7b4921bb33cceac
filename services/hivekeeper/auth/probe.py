"""What a lab that joins another's swarm (spec.join) learns from the host's token service, in a
process of its own: the operator runs `python -m hivekeeper.auth.probe GATEWAY INVITE_FILE`
(it never imports hivemind, nor torch with it) and reads the one JSON object it prints:

    {"identity": LAB, "swarm": {kind, name, manifest, initialPeers, relays, planSigner}}
    {"reason": REASON, "message": "..."}   REASON one of REASONS

The exit code is 0 either way; anything else is a crash, with its traceback on stderr.

The process loads only the parts of hivemind the token service's protocol uses (its RSA keys and
token message), not the package's `__init__`, which imports torch: a probe process then takes
0.56 s and 58 MB (`/usr/bin/time -v`, a refused invite), within the operator pod's memory limit."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

# why a probe failed, as the joining resource's Joined condition says it
UNREACHABLE = "GatewayUnreachable"  # nothing answers: a partition, a gateway not up yet (retry)
KEY_MISMATCH = "GatewayKeyMismatch"  # its certificate is not the invite's swarm key: another swarm's invite
INVITE_INVALID = "InviteInvalid"  # damaged, not an invite
INVITE_EXPIRED = "InviteExpired"
INVITE_REFUSED = "InviteRefused"  # off the allowlist (revoked), or the lab may not run what it asks
REASONS = (UNREACHABLE, KEY_MISMATCH, INVITE_INVALID, INVITE_EXPIRED, INVITE_REFUSED)


def probe(gateway: str, invite: str, timeout: float = 10.0) -> dict[str, Any]:
    """The host's answer for `invite`, or the reason there is none."""
    from hivemind.utils.crypto import RSAPrivateKey

    from hivekeeper.auth.client import AccessRefused, GatewayUnavailable, UntrustedGateway, describe_swarm
    from hivekeeper.auth.tokens import InvalidToken, parse_invite

    try:
        identity = parse_invite(invite.strip())[0].identity
        swarm = describe_swarm(gateway, invite, RSAPrivateKey(), timeout=timeout)  # a throwaway key: no token
    except InvalidToken as e:
        return {"reason": INVITE_INVALID, "message": f"the invite cannot be read: {e}"}
    except GatewayUnavailable as e:
        return {"reason": UNREACHABLE, "message": str(e)}
    except UntrustedGateway as e:
        return {"reason": KEY_MISMATCH, "message": str(e)}
    except AccessRefused as e:
        if e.code == "INVALID_ARGUMENT":
            reason = INVITE_INVALID
        elif e.code == "UNAUTHENTICATED" and "expired" in str(e):
            reason = INVITE_EXPIRED
        else:
            reason = INVITE_REFUSED
        return {"reason": reason, "message": str(e)}
    return {"identity": identity, "swarm": swarm}


def without_hivemind_init() -> None:
    """Registers `hivemind` and `hivemind.utils` as bare packages, so that importing a module of
    theirs runs that module alone (crypto.py needs only `cryptography`). For this process only:
    nothing else of hivemind works here afterwards."""
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    root = list(spec.submodule_search_locations or [])[0]
    for name, path in (("hivemind", root), ("hivemind.utils", f"{root}/utils")):
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package


def main(argv: list[str] | None = None) -> int:
    without_hivemind_init()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m hivekeeper.auth.probe GATEWAY INVITE_FILE", file=sys.stderr)
        return 2
    gateway, invite_file = args
    print(json.dumps(probe(gateway, Path(invite_file).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
