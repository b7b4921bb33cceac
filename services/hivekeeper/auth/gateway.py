"""The token service: a gRPC server whose Join method trades an invite, and proof that the
caller holds an RSA key, for an access token for that key (DeDLOC appendix I.5). It also serves
the standard gRPC health service. Over TLS only, with a certificate for the swarm's own key,
which clients pin by the fingerprint their invite carries (hivekeeper.auth.tls)."""

from __future__ import annotations

import base64
import logging
import math
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import grpc
from cryptography.exceptions import UnsupportedAlgorithm
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivekeeper.auth import protocol
from hivekeeper.auth.client import Grant, request_access  # noqa: F401 (the client half, by its agreed path)
from hivekeeper.auth.keys import public_key_text, unwrap_private_key
from hivekeeper.auth.labs import (MAX_PEER_NAME, AccessList, Lab, PeerQuota, QuotaExceeded, parse_access_list,
                                  token_subject)
from hivekeeper.auth.tls import RotatingCertificate, certificate_fingerprint, key_fingerprint
from hivekeeper.auth.tokens import InvalidToken, issue_access_token, read_invite
from hivekeeper.auth.watched import WatchedFile
from hivekeeper.spec.volunteers import LAB_ROLES

__all__ = ["Allowlist", "GatewayServer", "Grant", "TokenService", "request_access", "serve_gateway"]
log = logging.getLogger("hivekeeper.auth")


class Allowlist:
    """Identities and labs from the manifest, plus those in a file re-read whenever it changes
    (hivekeeper.auth.labs: its format), so that removing someone takes effect without a restart
    (for new tokens; issued ones run out)."""

    def __init__(self, identities: Iterable[str] = (), path: str | Path | None = None,
                 labs: Mapping[str, Lab] | None = None):
        self.static = AccessList(frozenset(identities) - frozenset(labs or {}), dict(labs or {}))
        self._file = WatchedFile(path, parse_access_list, AccessList()) if path else None

    def current(self) -> AccessList:
        return self.static.merged(self._file.value) if self._file else self.static

    def identities(self) -> frozenset[str]:
        return self.current().names()

    def lab(self, identity: str) -> Lab | None:
        return self.current().labs.get(identity)

    def __contains__(self, identity: str) -> bool:
        return identity in self.identities()


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason = code, reason


REFUSAL_REASONS = ("malformed", "bad_signature", "expired", "clock_skew", "bad_proof", "not_allowlisted",
                   "role_not_allowed", "over_quota")
# what an invite that fails to read means to the caller
_INVITE_STATUS = {"malformed": grpc.StatusCode.INVALID_ARGUMENT}


class TokenService:
    """Join's checks, in order: a well-formed request, an invite signed by the swarm's key and
    unexpired, a fresh time, a signature by the key being vouched for, the allowlist (not for
    the swarm's own roles), and for a lab's peer the role it names and the lab's peer quota. A
    token lasts `token_ttl` seconds, never past its invite, and names the role the request named
    (hivekeeper.auth.labs)."""

    def __init__(self, swarm_key: RSAPrivateKey, allowlist: Allowlist, swarm_info: Callable[[], dict[str, Any]],
                 token_ttl: float = 3600.0, on_issue: Callable[[str, bool], None] = lambda identity, internal: None,
                 on_refuse: Callable[[str], None] = lambda reason: None):
        self.swarm_key, self.allowlist, self.swarm_info = swarm_key, allowlist, swarm_info
        self.swarm_public_key = swarm_key.get_public_key()
        self.token_ttl = token_ttl
        self.on_issue, self.on_refuse = on_issue, on_refuse
        self.quota = PeerQuota()

    def join(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return protocol.encode(self.admit(request))
        except Refused as e:
            self.on_refuse(e.reason)
            log.info("join refused", extra={"fields": {"reason": e.reason, "detail": str(e)}})
            context.abort(e.code, str(e))

    def admit(self, raw: bytes) -> dict[str, Any]:
        now = time.time()
        invite_text, key_text, public_key, at, signature, role, peer, probe = self._fields(raw)
        try:
            invite = read_invite(invite_text, self.swarm_public_key, now)
        except InvalidToken as e:
            raise Refused(_INVITE_STATUS.get(e.reason, grpc.StatusCode.UNAUTHENTICATED), e.reason, str(e)) from None
        if abs(at - now) > protocol.PROOF_WINDOW_SECONDS:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "clock_skew",
                          f"the request's time is {at - now:+.0f} s off the gateway's clock "
                          f"(at most {protocol.PROOF_WINDOW_SECONDS:.0f} s): check the clock")
        if not public_key.verify(protocol.proof_bytes(invite_text, key_text, at), signature):
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "bad_proof",
                          "the request is not signed by the key it asks a token for")
        if not invite.internal and invite.identity not in self.allowlist:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "not_allowlisted",
                          f"{invite.identity!r} is not on this swarm's allowlist")
        described = {"identity": invite.identity, "swarmPublicKey": public_key_text(self.swarm_public_key),
                     "swarm": self.swarm_info()}
        if probe:  # the swarm's information for an admitted invite; no token, no quota taken
            return described
        ttl = min(self.token_ttl, invite.expires_at - now)
        lab = None if invite.internal else self.allowlist.lab(invite.identity)
        if lab is not None:
            self._check_lab_peer(lab, role, peer)
            try:
                self.quota.take(lab, peer, now + ttl, now)
            except QuotaExceeded as e:
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "over_quota", str(e)) from None
        token = issue_access_token(self.swarm_key, token_subject(invite.identity, role), public_key.to_bytes(),
                                   ttl, now=now)
        self.on_issue(invite.identity, invite.internal)
        log.info("token issued", extra={"fields": {"identity": invite.identity, "expires": token.expiration_time}})
        return {**described, "accessToken": base64.b64encode(token.SerializeToString()).decode()}

    @staticmethod
    def _check_lab_peer(lab: Lab, role: str | None, peer: str | None) -> None:
        if role is None or peer is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                          f"a peer of lab {lab.name!r} names its role and itself (role, peer): "
                          "is the lab's hivekeeper older than the host's?")
        if role not in lab.roles:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, "role_not_allowed",
                          f"lab {lab.name!r} may run {', '.join(sorted(lab.roles))}, not {role}")

    @staticmethod
    def _fields(raw: bytes) -> tuple[str, str, RSAPublicKey, float, bytes, str | None, str | None, bool]:
        try:
            request = protocol.decode(raw)
            invite, key, at, signature = (request[k] for k in ("invite", "publicKey", "time", "signature"))
            role, peer, probe = request.get("role"), request.get("peer"), request.get("probe", False)
            if not (isinstance(invite, str) and isinstance(key, str) and isinstance(signature, str)
                    and isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)):
                raise TypeError("fields of the wrong type")
            if role is not None and role not in LAB_ROLES:
                raise ValueError(f"role {role!r} is not one of {', '.join(LAB_ROLES)}")
            if peer is not None and not (isinstance(peer, str) and 0 < len(peer) <= MAX_PEER_NAME):
                raise ValueError(f"peer must name the peer in 1 to {MAX_PEER_NAME} characters")
            if not isinstance(probe, bool):
                raise TypeError("probe must be true or false")
            return (invite, key, RSAPublicKey.from_bytes(key.encode()), float(at), signature.encode(), role, peer,
                    probe)
        # UnicodeDecodeError, JSONDecodeError are ValueErrors; a key of another kind is UnsupportedAlgorithm
        except (ValueError, KeyError, TypeError, UnsupportedAlgorithm) as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "malformed",
                          f"not a Join request ({type(e).__name__}: {e})") from None


@dataclass
class GatewayServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int
    certificate: RotatingCertificate
    key_fingerprint: str  # of the swarm key its certificate holds: what invites name

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()  # health checks answer NOT_SERVING while calls finish
        self.server.stop(grace).wait()


def serve_gateway(service: TokenService, host: str = "127.0.0.1", port: int = 0, workers: int = 4,
                  certificate: RotatingCertificate | None = None) -> GatewayServer:
    """Start the gRPC server, over TLS only: hivekeeper.Gateway/Join and grpc.health.v1.Health.
    `certificate` defaults to a self-signed one for the service's swarm key, made now."""
    certificate = certificate or RotatingCertificate(unwrap_private_key(service.swarm_key))
    fingerprint = key_fingerprint(service.swarm_public_key)
    if certificate_fingerprint(certificate.current()[1]) != fingerprint:
        raise ValueError("the gateway's certificate must hold the swarm's key: clients pin it")

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        renewed = certificate.renewed()
        return grpc.ssl_server_certificate_configuration([renewed]) if renewed else None

    credentials = grpc.dynamic_ssl_server_credentials(
        grpc.ssl_server_certificate_configuration([certificate.current()]), fetch)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gateway"))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        protocol.SERVICE, {"Join": grpc.unary_unary_rpc_method_handler(service.join)}),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_secure_port(f"{host}:{port}", credentials)
    if not bound:
        raise OSError(f"token service: cannot listen on {host}:{port}")
    server.start()
    for name in ("", protocol.SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return GatewayServer(server, health_servicer, bound, certificate, fingerprint)
