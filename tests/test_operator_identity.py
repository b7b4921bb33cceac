"""The operator makes libp2p keys and peer IDs with `cryptography` alone: they must be exactly
what hivemind (and so p2pd) reads and computes."""

from __future__ import annotations

import pytest

pytest.importorskip("hivemind", reason="hivemind is the reference here")

from hivemind.p2p import PeerID  # noqa: E402
from hivemind.proto import crypto_pb2  # noqa: E402
from hivemind.utils.crypto import RSAPrivateKey  # noqa: E402

from hivekeeper_operator import identity  # noqa: E402


def test_operator_keys_are_hivemind_identities_with_the_same_peer_id():
    key = identity.generate_key()
    parsed = crypto_pb2.PrivateKey.FromString(key)
    assert parsed.key_type == crypto_pb2.KeyType.RSA
    # Byte for byte the message hivemind's P2P.generate_identity writes for the same RSA key.
    assert crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=parsed.data).SerializeToString() == key
    assert identity.peer_id(key) == PeerID.from_identity(key).to_base58()


def test_peer_ids_of_hivemind_made_keys_match():
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes()).SerializeToString()
    assert identity.peer_id(key) == PeerID.from_identity(key).to_base58()
    assert identity.peer_id(key).startswith("Qm")  # a sha2-256 multihash: RSA public keys are over 42 bytes


def test_base58_keeps_leading_zero_bytes():
    assert identity.base58(b"\x00\x00\x01") == "112"
    assert identity.base58(b"") == ""
