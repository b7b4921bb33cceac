"""A bootstrap peer that restarts (same identity, same address, empty tables) learns of the
swarm again from the peers' periodic pings (`hivemind_ext/dht_rejoin.py`): a newcomer that
bootstraps from it then finds what the swarm stored. Without the pings, the demo's restarted
trainer found no collaboration behind a restarted backbone and trained alone from step 0."""

from __future__ import annotations

import socket

import pytest

from conftest import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_restarted_bootstrap_peer_learns_of_the_swarm_again(tmp_path, no_leaked_p2pd):
    import hivemind
    from hivemind.utils import get_dht_time

    from hivekeeper.hivemind_ext.dht_rejoin import keep_bootstrap_peers
    from hivekeeper.runtime.bandwidth import peer_ids_of

    identity, port = str(tmp_path / "backbone.key"), free_port()

    def backbone():
        return hivemind.DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=identity)

    first = backbone()
    initial = [str(m) for m in first.get_visible_maddrs()]
    peers = []
    try:
        member = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peers.append(member)
        member.run_coroutine(keep_bootstrap_peers(peer_ids_of(initial), period=1.0))
        assert member.store("swarm_progress", "step 7", get_dht_time() + 600)
        first.shutdown()

        restarted = backbone()
        peers.append(restarted)
        newcomer = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        peers.append(newcomer)

        def found():
            record = newcomer.get("swarm_progress", latest=True)
            return record is not None and record.value == "step 7"

        assert wait_for(found, 30, "the newcomer to find the member's record through the restarted backbone")
    finally:
        for peer in reversed(peers):
            peer.shutdown()
        first.shutdown()
