"""Peer keys: made by the operator, kept in a Secret, so each backbone peer's ID is known
before its pod starts (everyone else's bootstrap multiaddrs name it) and survives restarts,
rescheduling and operator restarts. The balancer's key signs the averaging plan; peers are
told its ID the same way. Keys are hivemind's own format (a protobuf
`PrivateKey` holding an RSA key, what `P2P.generate_identity` writes and p2pd reads)."""

from __future__ import annotations

import base64
from typing import Callable

KeyGenerator = Callable[[], bytes]


def key_name(index: int) -> str:
    return f"backbone-{index}.key"


def generate_key() -> bytes:
    """A fresh libp2p private key, serialized as hivemind writes identity files."""
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()


def peer_id(key: bytes) -> str:
    """The base58 peer ID of a private key (as `PeerID.from_identity`)."""
    from hivemind.p2p import PeerID

    return PeerID.from_identity(key).to_base58()


BALANCER_KEY = "balancer-0.key"


def ensure_keys(existing: dict[str, str] | None, replicas: int, generate: KeyGenerator = generate_key,
                balancer: bool = False) -> tuple[dict[str, str], list[str], str | None]:
    """Secret `data` holding a key for every backbone index below `replicas` (existing keys are
    kept as they are, also those above it, so scaling down and up again keeps IDs) and, with
    `balancer`, the balancer's plan-signing key; the peer IDs of backbone indices
    0..replicas-1, and the balancer's."""
    data = dict(existing or {})
    names = [key_name(index) for index in range(replicas)] + ([BALANCER_KEY] if balancer else [])
    for name in names:
        if name not in data:
            data[name] = base64.b64encode(generate()).decode()
    ids = [peer_id(base64.b64decode(data[key_name(index)])) for index in range(replicas)]
    balancer_id = peer_id(base64.b64decode(data[BALANCER_KEY])) if balancer else None
    return data, ids, balancer_id
