"""Peer keys: made by the operator, kept in a Secret, so each backbone peer's ID is known
before its pod starts (everyone else's bootstrap multiaddrs name it) and survives restarts,
rescheduling and operator restarts. The balancer's key signs the averaging plan; peers are
told its ID the same way. Keys are hivemind's own format (a protobuf
`PrivateKey` holding an RSA key, what `P2P.generate_identity` writes and p2pd reads)."""

from __future__ import annotations

import base64
from typing import Callable

KeyGenerator = Callable[[], bytes]


def generate_key() -> bytes:
    """A fresh libp2p private key, serialized as hivemind writes identity files."""
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()


def peer_id(key: bytes) -> str:
    """The base58 peer ID of a private key (as `PeerID.from_identity`)."""
    from hivemind.p2p import PeerID

    return PeerID.from_identity(key).to_base58()


def ensure_role_keys(existing: dict[str, str] | None, role_names: list[str],
                     generate: KeyGenerator = generate_key) -> tuple[dict[str, str], dict[str, str]]:
    """Secret `data` with a key (ROLE.key) for every role in `role_names`, existing keys kept
    (also those of roles not named), and the peer ID of each named role."""
    data = dict(existing or {})
    for name in role_names:
        if f"{name}.key" not in data:
            data[f"{name}.key"] = base64.b64encode(generate()).decode()
    return data, {name: peer_id(base64.b64decode(data[f"{name}.key"])) for name in role_names}
