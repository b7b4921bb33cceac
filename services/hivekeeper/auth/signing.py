"""The swarm's signing key as invites and tokens use it, without hivemind: hivemind's RSA scheme
(PSS with the longest salt, SHA-256, base64 signatures) on a `cryptography` key. Minting an
invite (`hivekeeper invite`, the operator's internal invites) then costs no torch import: about
7 CPU-seconds less, which on a loaded host is minutes."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa


class SigningKey:
    """An RSA key (private or public) with the part of hivemind's RSAPrivateKey/RSAPublicKey
    interface `hivekeeper.auth.tokens` uses: sign, verify, get_public_key, to_bytes."""

    _PADDING = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)

    def __init__(self, key: Any):
        self.key = key

    def sign(self, data: bytes) -> bytes:
        return base64.b64encode(self.key.sign(data, self._PADDING, hashes.SHA256()))

    def get_public_key(self) -> "SigningKey":
        return SigningKey(self.key.public_key())

    def to_bytes(self) -> bytes:
        """Of the public key: its OpenSSH form, like hivemind's RSAPublicKey (invites carry its fingerprint)."""
        return self.key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)

    def verify(self, data: bytes, signature: bytes) -> bool:
        try:
            self.key.verify(base64.b64decode(signature), data, self._PADDING, hashes.SHA256())
            return True
        except Exception:  # noqa: BLE001 (bad base64 or signature: not ours)
            return False


def signing_key_from_pem(pem: bytes, source: str = "the key") -> SigningKey:
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{source}: not an RSA private key")
    return SigningKey(key)


def load_signing_key(path: str | Path) -> SigningKey:
    """The swarm's private key from its PEM file."""
    return signing_key_from_pem(Path(path).read_bytes(), str(path))
