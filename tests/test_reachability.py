"""The dial-back reachability check on loopback (no namespaces needed): a listening peer is
reachable at its own addresses, not at an address where nobody listens, and the checker dials
from a fresh daemon, so the caller's own connection to it does not make it reachable."""

from __future__ import annotations

import asyncio

import pytest

from hivekeeper.local.network import free_port
from hivekeeper.volunteer.reachability import ReachabilityService, ask, check_reachability

pytestmark = pytest.mark.swarm


async def _scenario() -> dict:
    from hivemind.p2p import P2P

    service = ReachabilityService(dial_timeout=3.0)
    checker = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    caller = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dialer_only = await P2P.create(no_listen=True)
    try:
        await service.serve(checker)
        checker_maddr = str((await checker.get_visible_maddrs())[0])
        own = [str(a) for a in await caller.get_visible_maddrs()]
        nowhere = [f"/ip4/127.0.0.1/tcp/{free_port()}"]
        answer = await ask(caller, checker_maddr, own)
        return {
            "reachable": answer,
            "nowhere": await ask(caller, checker_maddr, nowhere),
            "no_addresses": await ask(caller, checker_maddr, []),
            "someone_else": await ask(caller, checker_maddr, own, peer=str(dialer_only.peer_id)),
            # connected to the checker, but it listens nowhere: a fresh daemon cannot dial it
            "dialer_only": await check_reachability(dialer_only, [checker_maddr], nowhere),
            "outcomes": dict(service.outcomes),
        }
    finally:
        for p2p in (dialer_only, caller, checker):
            await p2p.shutdown()


def test_dial_back_tells_reachable_from_unreachable(no_leaked_p2pd):
    result = asyncio.run(_scenario())
    assert result["reachable"].reachable and result["reachable"].error is None
    assert result["reachable"].observed.startswith("/ip4/127.0.0.1/tcp/")
    assert not result["nowhere"].reachable and result["nowhere"].error
    assert not result["no_addresses"].reachable and "no addresses" in result["no_addresses"].error
    assert result["dialer_only"] is False
    # another peer is dialed only through a reservation at the checker, never at any address
    assert not result["someone_else"].reachable and "only at relayed addresses" in result["someone_else"].error
    assert result["outcomes"] == {"reachable": 1, "unreachable": 3, "error": 1}
