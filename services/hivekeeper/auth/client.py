"""Asking the token service for access: `request_access` trades an invite and proof of a key
for an access token, the swarm's public key and what the swarm tells its peers."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivekeeper.auth import protocol
from hivekeeper.auth.tokens import InvalidToken, parse_invite, read_invite, token_expiry, verify_access_token
from hivekeeper.errors import UserError

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class AccessRefused(UserError):
    """The gateway (or the invite itself) does not admit this peer; retrying will not help.
    `code` is the gRPC status name (PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"access refused ({code}): {message}")
        self.code = code


class GatewayUnavailable(ConnectionError):
    """The gateway did not answer; it may be starting or restarting."""


@dataclass(frozen=True)
class Grant:
    token: AccessToken
    swarm_public_key: RSAPublicKey
    swarm: dict[str, Any] = field(default_factory=dict)  # kind, name, manifest, initialPeers, relays

    @property
    def identity(self) -> str:
        return self.token.username

    @property
    def expires_at(self) -> float:
        return token_expiry(self.token)


def request_access(gateway: str, invite: str, private_key: RSAPrivateKey, timeout: float = 10.0) -> Grant:
    """One Join call to the gateway at host:port. Raises AccessRefused (the invite is malformed,
    expired, not allowlisted...) or GatewayUnavailable (worth retrying)."""
    invite = invite.strip()
    try:  # what the invite alone says: no need to ask the gateway about a damaged or expired one
        claims = parse_invite(invite)[0]
    except InvalidToken as e:
        raise AccessRefused("INVALID_ARGUMENT", str(e)) from None
    if claims.expires_at <= time.time():
        raise AccessRefused("UNAUTHENTICATED", f"the invite for {claims.identity!r} has expired")
    request = protocol.join_request(invite, private_key, time.time())
    # A channel of its own, with its own connection: channels share subchannels process-wide by
    # default, and a hivemind DHT process forked after the parent dialed would inherit a dead one.
    with grpc.insecure_channel(gateway, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        join = channel.unary_unary(protocol.JOIN_METHOD)
        try:
            reply = protocol.decode(join(protocol.encode(request), timeout=timeout))
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise GatewayUnavailable(f"token service at {gateway}: {e.details()}") from None
            raise AccessRefused(e.code().name, e.details() or "") from None
    return _checked_grant(reply, invite, request["publicKey"])


def _checked_grant(reply: dict[str, Any], invite: str, public_key: str) -> Grant:
    """Trust the swarm key only if it signed our invite: a gateway that is not the swarm's cannot
    hand us a key of its own choosing."""
    try:
        swarm_key = RSAPublicKey.from_bytes(reply["swarmPublicKey"].encode())
        token = AccessToken.FromString(base64.b64decode(reply["accessToken"]))
        read_invite(invite, swarm_key)
        swarm = reply.get("swarm") or {}
    except (KeyError, TypeError, ValueError, DecodeError) as e:  # InvalidToken is a ValueError
        raise AccessRefused("UNAUTHENTICATED", f"the gateway's reply does not check out: {e}") from None
    check = verify_access_token(token, swarm_key)
    if not check or token.public_key != public_key.encode():
        why = check.reason or "issued for another key"
        raise AccessRefused("UNAUTHENTICATED", f"the gateway's token does not check out ({why})")
    return Grant(token=token, swarm_public_key=swarm_key, swarm=swarm)
