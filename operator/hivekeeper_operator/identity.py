"""Peer keys: made by the operator, kept in a Secret, so each identity role's peer ID is known
before its pod starts (everyone else's bootstrap multiaddrs name it) and survives restarts,
rescheduling and operator restarts.

Keys are libp2p's own format, made with `cryptography` alone (the operator never imports
hivemind): a protobuf `PrivateKey {key_type: RSA, data: PKCS#1 DER}`, what hivemind's
`P2P.generate_identity` writes and p2pd reads. A peer ID is the multihash of the protobuf
`PublicKey {key_type: RSA, data: SubjectPublicKeyInfo DER}`, base58btc (libp2p's peer-ids spec);
tests/test_operator_identity.py checks both against hivemind's `PeerID.from_identity`."""

from __future__ import annotations

import base64
import hashlib
from typing import Callable

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

KeyGenerator = Callable[[], bytes]

RSA_KEY_TYPE = 0  # crypto.pb.KeyType.RSA
IDENTITY_MULTIHASH_LIMIT = 42  # libp2p inlines public keys up to this size
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _key_message(data: bytes) -> bytes:
    """crypto.pb PublicKey/PrivateKey (both `key_type = 1; data = 2`, proto2 required fields)."""
    return b"\x08" + _varint(RSA_KEY_TYPE) + b"\x12" + _varint(len(data)) + data


def _key_data(message: bytes) -> bytes:
    """The `data` field of a crypto.pb key message."""
    i = 0
    while i < len(message):
        tag, i = message[i], i + 1
        value, shift = 0, 0
        while True:
            byte, i = message[i], i + 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        if tag == 0x12:
            return message[i:i + value]
        if tag & 0x07 == 2:
            i += value
    raise ValueError("not a libp2p key: no data field")


def base58(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    out = ""
    while number:
        number, digit = divmod(number, 58)
        out = _BASE58[digit] + out
    return "1" * (len(data) - len(data.lstrip(b"\0"))) + out


def generate_key() -> bytes:
    """A fresh libp2p private key (RSA 2048), serialized as hivemind writes identity files."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return _key_message(key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                          serialization.NoEncryption()))


def peer_id(key: bytes) -> str:
    """The base58 peer ID of a serialized private key (as `PeerID.from_identity`)."""
    private = serialization.load_der_private_key(_key_data(key), password=None)
    public = _key_message(private.public_key().public_bytes(serialization.Encoding.DER,
                                                            serialization.PublicFormat.SubjectPublicKeyInfo))
    if len(public) <= IDENTITY_MULTIHASH_LIMIT:
        return base58(b"\x00" + _varint(len(public)) + public)
    return base58(b"\x12\x20" + hashlib.sha256(public).digest())


def ensure_role_keys(existing: dict[str, str] | None, role_names: list[str],
                     generate: KeyGenerator = generate_key) -> tuple[dict[str, str], dict[str, str]]:
    """Secret `data` with a key (ROLE.key) for every role in `role_names`, existing keys kept
    (also those of roles not named), and the peer ID of each named role."""
    data = dict(existing or {})
    for name in role_names:
        if f"{name}.key" not in data:
            data[f"{name}.key"] = base64.b64encode(generate()).decode()
    return data, {name: peer_id(base64.b64decode(data[f"{name}.key"])) for name in role_names}
