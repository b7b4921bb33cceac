"""Asking the token service for access: `request_access` trades an invite and proof of a key
for an access token, the swarm's public key and what the swarm tells its peers. It talks to
the gateway over TLS pinned to the swarm key its invite names (hivekeeper.auth.tls), and sends
the invite only to a gateway that holds that key."""

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
from hivekeeper.auth.labs import split_subject
from hivekeeper.auth.tls import GATEWAY_TLS_NAME, NotTLS, certificate_fingerprint, fetch_certificate, key_fingerprint
from hivekeeper.auth.tokens import InvalidToken, parse_invite, read_invite, token_expiry, verify_access_token
from hivekeeper.errors import UserError

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class AccessRefused(UserError):
    """The gateway (or the invite itself) does not admit this peer; retrying will not help.
    `code` is the gRPC status name (PERMISSION_DENIED, UNAUTHENTICATED, INVALID_ARGUMENT)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"access refused ({code}): {message}")
        self.code = code


class UntrustedGateway(AccessRefused):
    """The gateway's certificate does not hold the swarm key the invite names: someone else
    answers at that address (a man in the middle, another swarm). The invite was not sent."""

    def __init__(self, message: str):
        super().__init__("UNAUTHENTICATED", message)


class GatewayUnavailable(ConnectionError):
    """The gateway did not answer; it may be starting or restarting."""


@dataclass(frozen=True)
class Grant:
    token: AccessToken
    swarm_public_key: RSAPublicKey
    swarm: dict[str, Any] = field(default_factory=dict)  # kind, name, manifest, initialPeers, relays

    @property
    def identity(self) -> str:
        return split_subject(self.token.username)[0]

    @property
    def role(self) -> str | None:
        """The role the token names, if the request named one."""
        return split_subject(self.token.username)[1]

    @property
    def expires_at(self) -> float:
        return token_expiry(self.token)


def request_access(gateway: str, invite: str, private_key: RSAPrivateKey, timeout: float = 10.0,
                   role: str | None = None, peer: str | None = None) -> Grant:
    """One Join call to the gateway at host:port, for a peer named `peer` that runs `role` (a
    lab's peers name both). Raises AccessRefused (the invite is malformed, expired, not
    allowlisted, the lab's quota is full...; UntrustedGateway: the gateway does not hold the
    invite's swarm key) or GatewayUnavailable (worth retrying)."""
    reply, request, fingerprint = _join(gateway, invite, private_key, timeout, role=role, peer=peer)
    return _checked_grant(reply, invite.strip(), fingerprint, request["publicKey"])


def describe_swarm(gateway: str, invite: str, private_key: RSAPrivateKey, timeout: float = 10.0) -> dict[str, Any]:
    """What the swarm tells its peers (kind, name, manifest, initial peers, relays), for an invite
    the gateway admits, without a token: what a peer reads before it knows which role it runs.
    Raises as request_access does."""
    reply, _, fingerprint = _join(gateway, invite, private_key, timeout, probe=True)
    return _checked_reply(reply, invite.strip(), fingerprint)[1]


def _join(gateway: str, invite: str, private_key: RSAPrivateKey, timeout: float,
          **fields: Any) -> tuple[bytes, dict[str, Any], str]:
    """The Join call: the reply, the request sent and the swarm key fingerprint the invite names."""
    invite = invite.strip()
    try:  # what the invite alone says: no need to ask the gateway about a damaged or expired one
        claims = parse_invite(invite)[0]
    except InvalidToken as e:
        raise AccessRefused("INVALID_ARGUMENT", str(e)) from None
    if claims.expires_at <= time.time():
        raise AccessRefused("UNAUTHENTICATED", f"the invite for {claims.identity!r} has expired")
    deadline = time.monotonic() + timeout
    with pinned_channel(gateway, claims.key_fingerprint, timeout) as channel:
        request = protocol.join_request(invite, private_key, time.time(), **fields)
        join = channel.unary_unary(protocol.JOIN_METHOD)
        try:
            reply = join(protocol.encode(request), timeout=max(deadline - time.monotonic(), 0.1))
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise GatewayUnavailable(f"token service at {gateway}: {e.details()}") from None
            raise AccessRefused(e.code().name, e.details() or "") from None
    return reply, request, claims.key_fingerprint


def pinned_channel(gateway: str, fingerprint: str, timeout: float = 10.0) -> grpc.Channel:
    """A gRPC channel to the gateway at HOST:PORT over TLS that trusts exactly the certificate the
    gateway presents now, once its key's fingerprint is `fingerprint` (the invite's). Raises
    UntrustedGateway if it is not, AccessRefused for a bad address or a server that does not
    speak TLS, GatewayUnavailable if nothing answers within `timeout` seconds."""
    try:
        certificate = fetch_certificate(gateway, timeout)
    except NotTLS as e:
        raise AccessRefused("FAILED_PRECONDITION", f"the token service at {gateway} does not speak TLS: {e} "
                                                   "(does it run an older hivekeeper?)") from None
    except OSError as e:  # refused, unreachable, timed out, dropped mid-handshake
        raise GatewayUnavailable(f"token service at {gateway}: {e or type(e).__name__}") from None
    except ValueError as e:  # not HOST:PORT
        raise AccessRefused("INVALID_ARGUMENT", f"bad token service address: {e}") from None
    served = certificate_fingerprint(certificate)
    if served != fingerprint:
        raise UntrustedGateway(
            f"the token service at {gateway} does not hold the swarm key the invite names (it presents key "
            f"{served}, the invite names {fingerprint}): someone else answers there, perhaps intercepting "
            "the connection; the invite was not sent")
    # The handshake trusts this certificate alone, so a swap since the fetch fails (UNAVAILABLE)
    # rather than trusting anyone else. A channel of its own, with its own connection: channels
    # share subchannels process-wide by default, and a hivemind DHT process forked after the
    # parent dialed would inherit a dead one.
    return grpc.secure_channel(gateway, grpc.ssl_channel_credentials(root_certificates=certificate),
                               options=[("grpc.use_local_subchannel_pool", 1),
                                        ("grpc.ssl_target_name_override", GATEWAY_TLS_NAME)])


def _checked_reply(reply_bytes: bytes, invite: str, fingerprint: str) -> tuple[dict[str, Any], dict[str, Any], RSAPublicKey]:
    """The reply, the swarm's information and its key, trusting the key only if it is the one the
    invite names and it signed the invite: a gateway that is not the swarm's cannot hand us a key
    of its own choosing."""
    try:
        reply = protocol.decode(reply_bytes)
        swarm_key = RSAPublicKey.from_bytes(reply["swarmPublicKey"].encode())
        if key_fingerprint(swarm_key) != fingerprint:
            raise ValueError("its swarm key is not the one the invite names")
        read_invite(invite, swarm_key)
        swarm = reply.get("swarm") or {}
        if not isinstance(swarm, dict):
            raise TypeError("its swarm information is not an object")
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # InvalidToken is a ValueError
        raise AccessRefused("UNAUTHENTICATED", f"the gateway's reply does not check out: {e}") from None
    return reply, swarm, swarm_key


def _checked_grant(reply_bytes: bytes, invite: str, fingerprint: str, public_key: str) -> Grant:
    """The token in the reply, if it is the swarm key's and vouches for `public_key`."""
    reply, swarm, swarm_key = _checked_reply(reply_bytes, invite, fingerprint)
    try:
        token = AccessToken.FromString(base64.b64decode(reply["accessToken"]))
    except (KeyError, TypeError, ValueError, DecodeError) as e:
        raise AccessRefused("UNAUTHENTICATED", f"the gateway's reply does not check out: {e}") from None
    check = verify_access_token(token, swarm_key)
    if not check or token.public_key != public_key.encode():
        why = check.reason or "issued for another key"
        raise AccessRefused("UNAUTHENTICATED", f"the gateway's token does not check out ({why})")
    return Grant(token=token, swarm_public_key=swarm_key, swarm=swarm)
