"""A local run's access files when its swarm admits peers by token: the swarm's signing key, an
invite for each of its own roles (and one for `hivekeeper status`), and what the token service
tells volunteers. `hivekeeper invite RUN_DIR --identity NAME` invites someone from outside."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hivekeeper.spec import Manifest
from hivekeeper.topology import Network, Role, volunteer_info

INTERNAL_INVITE_SECONDS = 365 * 24 * 3600.0  # the run's own roles; the key dies with the run directory
ADMIN_INVITE = "admin.invite"


def provision_access(manifest: Manifest, network: Network, roles: list[Role], peer_ids: dict[str, str]) -> None:
    from hivekeeper.auth.keys import load_or_create_swarm_key
    from hivekeeper.auth.tokens import mint_invite

    key = load_or_create_swarm_key(network.access_path("swarm-auth.pem"))
    expires = time.time() + INTERNAL_INVITE_SECONDS
    name = manifest.metadata.name
    for invitee in [f"{role.name}.invite" for role in roles if role.component != "auth"] + [ADMIN_INVITE]:
        identity = f"{name}/{invitee.removesuffix('.invite')}"
        _write_private(Path(network.access_path(invitee)), mint_invite(key, identity, expires, internal=True))
    relays = [peer_ids[f"relay-{i}"] for i in range(manifest.spec.volunteers.relays)]
    info = volunteer_info(manifest, network, relays, plan_signer=peer_ids.get("balancer-0"))
    Path(network.access_path("swarm-info.json")).write_text(json.dumps(info, indent=2))


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
