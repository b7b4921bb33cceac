"""Invites and access tokens, both signed by the swarm's key.

An invite is what an admin hands a volunteer (or the runner a role): who it is for, until when,
whether it is one of the swarm's own roles, and the fingerprint of the swarm's public key, by
which the volunteer knows the real token service (its TLS certificate holds that key). The
gateway trades it for an access token: hivemind's `AccessToken` (identity, the peer's RSA public
key, expiry), which the peer attaches to every DHT request it signs. Each kind of signature
covers a distinct domain prefix, so the swarm key's signature on one can never pass as the other."""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from hivekeeper.auth.tls import key_fingerprint

if TYPE_CHECKING:  # invites need no hivemind: the operator mints them without importing it
    from hivemind.proto.auth_pb2 import AccessToken
    from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

INVITE_PREFIX = "hk1"
_INVITE_DOMAIN = b"hivekeeper-invite-v1\x00"
_TOKEN_DOMAIN = b"hivekeeper-access-token-v1\x00"


class InvalidToken(ValueError):
    """An invite or access token that does not admit its holder. `reason` is a short label
    (malformed, bad_signature, expired) for logs and metrics; the message says what is wrong."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Invite:
    identity: str
    expires_at: float
    key_fingerprint: str  # of the swarm's public key (see hivekeeper.auth.tls): the gateway must hold it
    internal: bool = False  # one of the swarm's own roles: admitted without being on the allowlist


@dataclass(frozen=True)
class TokenCheck:
    """The verdict on an access token: truthy when it admits, else `reason` says why not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint_invite(swarm_key: RSAPrivateKey, identity: str, expires_at: float, internal: bool = False) -> str:
    """A compact URL-safe invite: hk1.PAYLOAD.SIGNATURE (base64url, no padding)."""
    if not identity or not isinstance(identity, str):
        raise ValueError("an invite needs an identity")
    claims = {"sub": identity, "exp": float(expires_at), "int": bool(internal),
              "key": key_fingerprint(swarm_key.get_public_key())}
    payload = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    signature = base64.b64decode(swarm_key.sign(_INVITE_DOMAIN + payload.encode()))
    return f"{INVITE_PREFIX}.{payload}.{_b64(signature)}"


def parse_invite(text: str) -> tuple[Invite, bytes, bytes]:
    """The invite's claims, unverified, with the signed bytes and the signature."""
    if not isinstance(text, str):
        raise InvalidToken("malformed", f"an invite is text, not {type(text).__name__}")
    parts = text.strip().split(".")
    if len(parts) != 3 or parts[0] != INVITE_PREFIX:
        raise InvalidToken("malformed", f"not a hivekeeper invite (expected {INVITE_PREFIX}.PAYLOAD.SIGNATURE)")
    try:
        claims = json.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
        invite = Invite(identity=claims["sub"], expires_at=claims["exp"], key_fingerprint=claims.get("key"),
                        internal=claims.get("int", False))
    except (binascii.Error, ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError too
        raise InvalidToken("malformed", f"the invite is damaged: {e}") from None
    if invite.key_fingerprint is None:
        raise InvalidToken("malformed", f"the invite for {invite.identity!r} was made by an older hivekeeper "
                                        "(it names no swarm key to trust): mint a new invite")
    if not (isinstance(invite.identity, str) and invite.identity and isinstance(invite.expires_at, (int, float))
            and math.isfinite(invite.expires_at) and isinstance(invite.internal, bool)
            and isinstance(invite.key_fingerprint, str) and invite.key_fingerprint):
        raise InvalidToken("malformed", "the invite's fields have the wrong types")
    return invite, _INVITE_DOMAIN + parts[1].encode(), signature


def read_invite(text: str, swarm_public_key: RSAPublicKey, now: float | None = None) -> Invite:
    """The invite, if the swarm's key signed it, names that key and has not expired; else InvalidToken."""
    invite, signed, signature = parse_invite(text)
    if not swarm_public_key.verify(signed, base64.b64encode(signature)):
        raise InvalidToken("bad_signature", "the invite is not signed by this swarm's key")
    if invite.key_fingerprint != key_fingerprint(swarm_public_key):  # signed, yet for another key: a minting bug
        raise InvalidToken("bad_signature", "the invite names another swarm key than the one that signed it")
    now = time.time() if now is None else now
    if invite.expires_at <= now:
        raise InvalidToken("expired", f"the invite for {invite.identity!r} expired at {_iso(invite.expires_at)}")
    return invite


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat()


def signed_bytes(domain: bytes, *fields: bytes) -> bytes:
    """A domain prefix, then each field length-prefixed: no two field lists sign alike."""
    return domain + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _token_bytes(token: AccessToken) -> bytes:
    """What the swarm key signs: every field but the signature."""
    return signed_bytes(_TOKEN_DOMAIN, token.username.encode(), bytes(token.public_key), token.expiration_time.encode())


def issue_access_token(swarm_key: RSAPrivateKey, identity: str, peer_public_key_bytes: bytes,
                       ttl_seconds: float, now: float | None = None) -> AccessToken:
    from hivemind.proto.auth_pb2 import AccessToken

    now = time.time() if now is None else now
    token = AccessToken(username=identity, public_key=peer_public_key_bytes,
                        expiration_time=_iso(now + ttl_seconds))
    token.signature = swarm_key.sign(_token_bytes(token))
    return token


def token_expiry(token: AccessToken) -> float:
    """The token's expiry as a Unix time; InvalidToken if it is not an ISO-8601 time with a zone."""
    try:
        expiry = datetime.fromisoformat(token.expiration_time)
    except ValueError:
        raise InvalidToken("malformed", f"expiration_time {token.expiration_time!r} is not ISO-8601") from None
    if expiry.tzinfo is None:
        raise InvalidToken("malformed", "expiration_time has no time zone")
    return expiry.timestamp()


def verify_access_token(token: AccessToken, swarm_public_key: RSAPublicKey, now: float | None = None) -> TokenCheck:
    """Signed by the swarm's key and not expired. Never raises: a peer's token is input from anyone."""
    try:
        if not token.signature or not swarm_public_key.verify(_token_bytes(token), token.signature):
            return TokenCheck(False, "bad_signature")
        expiry = token_expiry(token)
    except InvalidToken as e:
        return TokenCheck(False, e.reason)
    except Exception:  # noqa: BLE001 (a wrong type, bad base64: any of it is a bad token)
        return TokenCheck(False, "malformed")
    if expiry <= (time.time() if now is None else now):
        return TokenCheck(False, "expired")
    return TokenCheck(True)
