"""Real hivemind DHTs on loopback, every member signing and checking each request with a
SwarmAuthorizer whose token comes from a real token service. Peers without a valid token (none,
expired, another key's, another swarm's) get nowhere, a replayed request is refused, and the
members keep working throughout."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import hivemind
import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.timed_storage import get_dht_time

from conftest import wait_for
from hivekeeper.auth.authorizer import SwarmAuthorizer, make_authorizer
from hivekeeper.auth.tokens import issue_access_token, mint_invite, verify_access_token
from helpers.token_service import token_service

# the members are DHT processes forked from the test process (see test_planned_averaging)
pytestmark = [pytest.mark.isolated, pytest.mark.swarm, pytest.mark.timeout(120)]

HOUR = 3600.0
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MEMBERS = [("digits/backbone-0", True), ("alice", False), ("bob", False)]  # (identity, internal invite)


@dataclass
class Swarm:
    key: RSAPrivateKey
    gateway: str  # the token service's HOST:PORT
    members: list[hivemind.DHT]
    authorizers: list[SwarmAuthorizer]

    @property
    def maddrs(self) -> list[str]:
        return [str(maddr) for maddr in self.members[0].get_visible_maddrs()]


class Impostor(TokenAuthorizerBase):
    """A peer that follows the protocol to the letter with a token it should not hold."""

    def __init__(self, key: RSAPrivateKey, token: AccessToken, swarm_public_key: RSAPublicKey):
        super().__init__(key)
        self.token, self.swarm_public_key = token, swarm_public_key

    async def get_token(self) -> AccessToken:
        return self.token

    def is_token_valid(self, access_token: AccessToken) -> bool:  # its own, and the swarm's for others
        return access_token is self.token or bool(verify_access_token(access_token, self.swarm_public_key))

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    key = RSAPrivateKey()
    members, authorizers = [], []
    with token_service(key, ["alice", "bob"], {"name": "digits"}) as gateway:
        try:
            for identity, internal in MEMBERS:
                invite = tmp_path_factory.mktemp("invites") / "peer.invite"
                invite.write_text(mint_invite(key, identity, time.time() + HOUR, internal=internal))
                # a key of its own: in a role process the process-wide key, here several peers share a process
                authorizer = make_authorizer(gateway, invite, private_key=RSAPrivateKey(), patience=10)
                initial = [str(m) for m in members[0].get_visible_maddrs()] if members else []
                members.append(hivemind.DHT(initial_peers=initial, host_maddrs=LOOPBACK, authorizer=authorizer,
                                            start=True))
                authorizers.append(authorizer)
            yield Swarm(key, gateway, members, authorizers)
        finally:
            for dht in members:
                dht.shutdown()


def value_at(dht: hivemind.DHT, key: str):
    found = dht.get(key, latest=True)
    return found.value if found is not None else None


def assert_members_share(swarm: Swarm, key: str) -> None:
    """A member stores, every other member reads it: the swarm works."""
    writer, *readers = swarm.members
    value = f"{key} at {time.time()}"
    assert writer.store(key, value, get_dht_time() + 60)
    for reader in readers:
        wait_for(lambda: value_at(reader, key) == value, timeout=15, what=f"{key} to reach every member")


def test_members_store_and_get_with_tokens(swarm):
    assert [a.grant.identity for a in swarm.authorizers] == [identity for identity, _ in MEMBERS]
    assert_members_share(swarm, "members")
    assert value_at(swarm.members[2], "members") == value_at(swarm.members[1], "members")


def outsider(case: str, swarm: Swarm) -> TokenAuthorizerBase | None:
    key = RSAPrivateKey()
    own = key.get_public_key().to_bytes()
    if case == "no token":
        return None
    token = {
        "expired token": lambda: issue_access_token(swarm.key, "alice", own, HOUR, now=time.time() - 2 * HOUR),
        "another key's token": lambda: swarm.authorizers[1].grant.token,  # alice's, for alice's key
        "another swarm's token": lambda: issue_access_token(RSAPrivateKey(), "alice", own, HOUR),
    }[case]()
    return Impostor(key, token, swarm.key.get_public_key())


@pytest.mark.parametrize("case", ["no token", "expired token", "another key's token", "another swarm's token"])
def test_peers_without_a_valid_token_get_nowhere(swarm, case, no_leaked_p2pd):
    """The outsider dials the members directly: its requests are refused, so it neither reads the
    swarm's records nor gets its own stored with any member; the members carry on."""
    assert_members_share(swarm, f"before {case}")
    intruder = hivemind.DHT(initial_peers=swarm.maddrs, host_maddrs=LOOPBACK, authorizer=outsider(case, swarm),
                            ensure_bootstrap_success=False, start=True)
    try:
        intruder.store(f"intruder {case}", "let me in", get_dht_time() + 60)
        assert value_at(intruder, f"before {case}") is None
        for member in swarm.members:
            assert value_at(member, f"intruder {case}") is None
    finally:
        intruder.shutdown()
    assert_members_share(swarm, f"after {case}")


def test_refused_and_replayed_requests_fail_at_the_caller(swarm, tmp_path, no_leaked_p2pd):
    """Requests sent straight to a member's DHT protocol: a refused one fails at the caller with
    P2PHandlerError (the member answers nothing); a signed request sent twice is answered once."""
    invite = tmp_path / "carol.invite"
    invite.write_text(mint_invite(swarm.key, "digits/monitor-0", time.time() + HOUR, internal=True))
    honest = make_authorizer(swarm.gateway, invite, private_key=RSAPrivateKey(), patience=10)
    member_key = swarm.authorizers[0].local_public_key

    async def scenario() -> None:
        p2p = await P2P.create(initial_peers=swarm.maddrs[:1], host_maddrs=LOOPBACK)
        try:
            stub = super(DHTProtocol, DHTProtocol).get_stub(p2p, swarm.members[0].peer_id)

            async def ping(authorizer: TokenAuthorizerBase | None, receiver: RSAPublicKey | None = None):
                request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo())
                if authorizer is not None:
                    await authorizer.sign_request(request, receiver)
                return request, await stub.rpc_ping(request, timeout=10)

            request, response = await ping(honest, member_key)  # addressed to this member: answered
            assert await honest.validate_response(response, request)  # and the member signed its answer
            # a refusal: the auth wrapper answers None, which hivemind fails to serialize back to us
            with pytest.raises(P2PHandlerError, match="NoneType"):  # the very same request again
                await stub.rpc_ping(request, timeout=10)
            with pytest.raises(P2PHandlerError, match="NoneType"):  # signed for another receiver
                await ping(honest, RSAPrivateKey().get_public_key())
            for case in ("no token", "expired token", "another key's token", "another swarm's token"):
                with pytest.raises(P2PHandlerError, match="NoneType"):
                    await ping(outsider(case, swarm))
            request, response = await ping(honest)  # still answered
            assert await honest.validate_response(response, request)
        finally:
            await p2p.shutdown()

    asyncio.run(scenario())
    assert_members_share(swarm, "after replays")
