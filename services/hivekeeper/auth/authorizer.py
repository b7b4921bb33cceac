"""Every DHT request and response signed and checked (DeDLOC appendix I.5). hivemind's
TokenAuthorizerBase does the per-request work: request and response signatures, the timestamp
window, nonce replay, the intended receiver. This class supplies the tokens: its own from the
gateway, and the verdict on others' (signed by the swarm's key, unexpired).

hivemind uses an authorizer in the DHT protocol only (`hivemind.DHT(..., authorizer=...)`): a
peer without a valid token gets no answer to its DHT requests, and its answers count as none."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivekeeper.auth.client import AccessRefused, GatewayUnavailable, Grant, request_access
from hivekeeper.auth.tokens import InvalidToken, parse_invite, token_expiry, verify_access_token

log = logging.getLogger("hivekeeper.auth")
MAX_BACKOFF_SECONDS = 10.0


class SwarmAuthorizer(TokenAuthorizerBase):
    """`private_key` is the key tokens vouch for and requests are signed with; by default the
    process-wide one hivemind also signs this peer's DHT records with (RSASignatureValidator), so
    one key stands for the peer. Each role is its own process, so each has its own."""

    def __init__(self, gateway: str, invite: str, private_key: RSAPrivateKey | None = None,
                 patience: float | None = None, request_timeout: float = 10.0, role: str | None = None,
                 peer: str | None = None):
        super().__init__(private_key)
        self.gateway, self.invite = gateway, invite.strip()
        self.role, self.peer = role, peer  # what the token names, and the peer's name (a lab's quota)
        self.patience, self.request_timeout = patience, request_timeout
        self.grant: Grant | None = None
        self._lifetime = 0.0
        self._renewing = False
        self._retry_at = 0.0  # after a failed renewal: when to ask the gateway again

    @property
    def swarm_public_key(self) -> RSAPublicKey | None:
        return self.grant.swarm_public_key if self.grant else None

    @property
    def private_key(self) -> RSAPrivateKey:
        """The key this peer's token vouches for (it proves the token is this peer's)."""
        return self._local_private_key

    def fetch_grant(self) -> Grant:
        """Ask the gateway until it answers (backing off while it is down, for up to `patience`
        seconds, None: no limit). AccessRefused is final: it is not retried."""
        deadline = None if self.patience is None else time.monotonic() + self.patience
        delay = 0.5
        while True:
            try:
                return self._accept(self._request())
            except GatewayUnavailable as e:
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise
                log.warning("token service unreachable, retrying", extra={"fields": {"error": str(e), "in": delay}})
                time.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_SECONDS)

    @property
    def admitted_as(self) -> str | None:
        """The lab or volunteer this peer's invite names; None for one of the swarm's own roles
        (an internal invite) or before the first token."""
        if self.grant is None:
            return None
        return None if parse_invite(self.invite)[0].internal else self.grant.identity

    def _request(self) -> Grant:
        return request_access(self.gateway, self.invite, self._local_private_key, timeout=self.request_timeout,
                              role=self.role, peer=self.peer)

    def _accept(self, grant: Grant) -> Grant:
        self.grant = grant
        self._lifetime = grant.expires_at - time.time()
        log.info("access token", extra={"fields": {"identity": grant.identity, "expires": grant.token.expiration_time}})
        return grant

    async def get_token(self) -> AccessToken:
        if self.grant is None or not self.is_token_valid(self.grant.token):
            return (await asyncio.get_running_loop().run_in_executor(None, self.fetch_grant)).token
        if self.does_token_need_refreshing(self.grant.token) and not self._renewing \
                and time.monotonic() >= self._retry_at:
            # renew in the background: requests never wait on the gateway while the token still serves
            self._renewing = True
            threading.Thread(target=self._renew, name="token-renewal", daemon=True).start()
        return self.grant.token

    def _renew(self) -> None:
        try:
            self._accept(self._request())
        except (GatewayUnavailable, AccessRefused) as e:  # keep the current token until it runs out
            self._retry_at = time.monotonic() + MAX_BACKOFF_SECONDS
            log.warning("cannot renew the access token", extra={"fields": {"error": str(e)}})
        finally:
            self._renewing = False

    def is_token_valid(self, access_token: AccessToken) -> bool:
        key = self.swarm_public_key
        return key is not None and bool(verify_access_token(access_token, key))

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        try:
            remaining = token_expiry(access_token) - time.time()
        except InvalidToken:
            return True
        return remaining < self._lifetime / 4


def make_authorizer(gateway: str, invite_path: str | Path, private_key: RSAPrivateKey | None = None,
                    patience: float | None = None, role: str | None = None,
                    peer: str | None = None) -> SwarmAuthorizer:
    """An authorizer that already holds its token: a refused invite fails here, in the role's own
    process with a clear message, not later inside the DHT's process as a failed bootstrap."""
    authorizer = SwarmAuthorizer(gateway, Path(invite_path).read_text(), private_key, patience, role=role, peer=peer)
    authorizer.fetch_grant()
    return authorizer
