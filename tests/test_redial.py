"""`Redialer` against real p2p daemons on loopback: a peer this daemon never met is dialed at the
addresses its report announces, written as reports write them (with the peer's own /p2p/ part,
which p2pd reads only as a bare multihash), and an address nobody listens on beside them does
not keep the dial from reaching it."""

from __future__ import annotations

import asyncio

import pytest

from hivekeeper.hivemind_ext.p2pd import Redialer
from hivekeeper.local.network import free_port

pytestmark = pytest.mark.swarm


async def _redial() -> tuple[bool, bool]:
    from hivemind.p2p import P2P

    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        announced = [f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{server.peer_id}",  # a pod IP: unreachable
                     *(str(m) for m in await server.get_visible_maddrs())]
        assert all(f"/p2p/{server.peer_id}" in m for m in announced)

        async def connected() -> bool:
            return any(info.peer_id == server.peer_id for info in await client.list_peers())

        before = await connected()
        redialer = Redialer(client, asyncio.get_running_loop(), lambda: {str(server.peer_id): announced})
        redialer.failed(server.peer_id)
        for _ in range(100):
            if await connected():
                return before, True
            await asyncio.sleep(0.1)
        return before, False
    finally:
        await client.shutdown()
        await server.shutdown()


def test_a_peer_never_met_is_dialed_at_its_announced_addresses(no_leaked_p2pd):
    before, after = asyncio.run(_redial())
    assert not before, "the daemons met before the dial: the test proves nothing"
    assert after, "the redial did not connect (see the hivekeeper.p2pd log)"
