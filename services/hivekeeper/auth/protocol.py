"""The token service's wire format, shared by the gateway and its clients. No generated code:
gRPC carries JSON objects (camelCase keys) through generic handlers."""

from __future__ import annotations

import json
from typing import Any

from hivemind.utils.crypto import RSAPrivateKey

from hivekeeper.auth.keys import public_key_text
from hivekeeper.auth.tokens import signed_bytes

SERVICE = "hivekeeper.Gateway"
JOIN_METHOD = f"/{SERVICE}/Join"
PROOF_WINDOW_SECONDS = 60.0  # a Join's time may differ this much from the gateway's clock
_PROOF_DOMAIN = b"hivekeeper-join-v1\x00"

# Join request:  {"invite": str, "publicKey": str (OpenSSH), "time": float, "signature": str,
#                 "role": str, "peer": str (both optional; a lab's peers send both),
#                 "probe": true (optional: the reply then holds no token)}
# Join reply:    {"identity": str, "accessToken": base64 of the serialized AccessToken (not for a probe),
#                 "swarmPublicKey": str (OpenSSH), "swarm": {kind, name, manifest, initialPeers, relays}}


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    """A JSON object, or ValueError."""
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message


def join_request(invite: str, private_key: RSAPrivateKey, at: float, signer: RSAPrivateKey | None = None,
                 role: str | None = None, peer: str | None = None, probe: bool = False) -> dict:
    """A Join request for `private_key`; `signer` (default: that key) makes the proof. `role` and
    `peer` say what the peer runs and its name (a lab's peers must say both); a `probe` asks for
    the swarm's information only, no token."""
    public_key = public_key_text(private_key.get_public_key())
    signature = (signer or private_key).sign(proof_bytes(invite, public_key, at))
    request = {"invite": invite, "publicKey": public_key, "time": at, "signature": signature.decode()}
    request.update({k: v for k, v in (("role", role), ("peer", peer)) if v is not None})
    if probe:
        request["probe"] = True
    return request


def proof_bytes(invite: str, public_key: str, at: float) -> bytes:
    """What a joining peer signs with its key: it holds the key it asks a token for, now."""
    return signed_bytes(_PROOF_DOMAIN, invite.encode(), public_key.encode(), f"{at:.3f}".encode())
