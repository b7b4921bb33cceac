"""The weight-merging wrapper over plain PyTorch loops: replicas that merge end identical, a
peer joining late starts from the merged state (weights, optimizer moments, step), and a
TIES peer that missed a merge adopts the group's base instead of blocking later merges."""

from __future__ import annotations

import threading

import hivemind
import pytest
import torch

from hivekeeper.swarm.merging_peer import MergingPeer, load_merged_state, state_tensors

STEPS, EVERY = 6, 3


def make_replica(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # same initial weights everywhere, as a Swarm's seeded task gives
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(peer: MergingPeer, model, optimizer, seed: int, steps: int, results: list) -> None:
    generator = torch.Generator().manual_seed(seed)  # each replica sees its own data
    for _ in range(steps):
        x = torch.randn(32, 8, generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record = peer.step()
        if record is not None:
            results.append(record)


@pytest.fixture
def dhts():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in first.get_visible_maddrs()]
    others = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers) for _ in range(2)]
    yield [first, *others]
    for dht in reversed(others + [first]):
        dht.shutdown()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["parameters", "ties"])
def test_replicas_merge_and_a_late_joiner_starts_from_the_merged_state(dhts, no_leaked_p2pd, mode):
    replicas = [make_replica(i) for i in range(2)]
    peers = [MergingPeer(model, opt, dht, "merge-test", mode=mode, merge_every=EVERY, matchmaking_seconds=2.0,
                         timeout_seconds=30.0) for (model, opt), dht in zip(replicas, dhts)]
    joiner = None
    try:
        records: list[list] = [[], []]
        threads = [threading.Thread(target=train, args=(peer, model, opt, seed, STEPS, records[seed]))
                   for seed, (peer, (model, opt)) in enumerate(zip(peers, replicas))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert [[r.outcome for r in rs] for rs in records] == [["success"] * 2] * 2, records
        assert all(r.group_size == 2 for rs in records for r in rs)
        # Merging is the last thing each did: the replicas, moments included, are one model now.
        first, second = (state_tensors(model, opt) for model, opt in replicas)
        for a, b in zip(first, second):
            assert torch.allclose(a, b, atol=1e-6)

        model, opt = make_replica(2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # a joiner whose weights differ
        joiner = MergingPeer.connect(model, opt, [str(a) for a in dhts[0].get_visible_maddrs()], "merge-test",
                                     host="127.0.0.1", mode=mode, merge_every=EVERY)  # its own DHT; joins
        assert (joiner.local_steps, joiner.merges) == (STEPS, 2)
        for a, b in zip(state_tensors(model, opt), first):
            assert torch.allclose(a, b, atol=1e-6)
        # A monitor reads the same merged weights without taking part.
        watcher, _ = make_replica(3)
        metadata = load_merged_state(dhts[2], "merge-test", watcher, torch.optim.Adam(watcher.parameters()))
        assert (metadata["step"], metadata["merges"]) == (STEPS, 2)
        for a, b in zip(watcher.parameters(), replicas[0][0].parameters()):
            assert torch.allclose(a, b, atol=1e-6)
    finally:
        for peer in peers + ([joiner] if joiner else []):
            peer.shutdown()


@pytest.mark.timeout(120)
def test_a_ties_peer_that_missed_a_merge_adopts_the_base_and_merges_again(dhts, no_leaked_p2pd):
    replicas = [make_replica(i) for i in range(2)]
    peers = [MergingPeer(model, opt, dht, "base-test", mode="ties", merge_every=EVERY, matchmaking_seconds=2.0,
                         timeout_seconds=10.0) for (model, opt), dht in zip(replicas, dhts)]
    try:
        # Peer 0 merges alone (no group forms): it keeps its replica and base.
        lonely: list = []
        train(peers[0], *replicas[0], 0, EVERY, lonely)
        assert [r.outcome for r in lonely] == ["failure"]
        # Peer 1 now holds a different base? No: nobody merged, so both bases are still the start.
        # Make peer 1 merge with a third peer so its base moves on, then peer 0 must catch up.
        third_model, third_opt = make_replica(2)
        third = MergingPeer(third_model, third_opt, dhts[2], "base-test", mode="ties", merge_every=EVERY,
                            matchmaking_seconds=2.0, timeout_seconds=10.0)
        try:
            moved: list[list] = [[], []]
            threads = [threading.Thread(target=train, args=(peers[1], *replicas[1], 1, EVERY, moved[0])),
                       threading.Thread(target=train, args=(third, third_model, third_opt, 2, EVERY, moved[1]))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            assert [[r.outcome for r in rs] for rs in moved] == [["success"], ["success"]], moved
            # Peer 0, on the old base, fails its next merge alone and adopts the group's base...
            train(peers[0], *replicas[0], 0, EVERY, lonely)
            # (members' merged tensors agree to float32 rounding: each adds the averaged delta to its own)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(peers[0].base, peers[1].base))
            assert peers[0].base_id == peers[1].base_id
            assert peers[0].merges == peers[1].merges == 1
            # ...so that it merges with the others again.
            again: list[list] = [[], [], []]
            threads = [threading.Thread(target=train, args=(peer, model, opt, seed, EVERY, again[seed]))
                       for seed, (peer, (model, opt)) in enumerate(zip(peers + [third],
                                                                         replicas + [(third_model, third_opt)]))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            # peer 0 merges with someone again: possible only on the group's base (members that
            # reach the merge point apart may pair off, so not every one need be in its group)
            assert again[0] and again[0][-1].outcome == "success" and again[0][-1].group_size >= 2, again
        finally:
            third.shutdown()
    finally:
        for peer in peers:
            peer.shutdown()


@pytest.mark.timeout(120)
def test_model_shifting_moves_each_replica_to_the_next_peer_in_the_ring(dhts, no_leaked_p2pd):
    models = []
    for i in range(3):
        torch.manual_seed(i)  # three different replicas
        models.append(torch.nn.Linear(4, 2))
    # lr 0: steps leave the weights alone, so what moves is exactly what was shifted
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    peers = [MergingPeer(m, opt, dht, "shift-test", merge_every=100, shift_every=2, matchmaking_seconds=2.0)
             for m, opt, dht in zip(models, optimizers, dhts)]
    try:
        def two_steps(peer, model, optimizer) -> None:
            for _ in range(2):
                model(torch.ones(1, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                peer.step()

        threads = [threading.Thread(target=two_steps, args=args) for args in zip(peers, models, optimizers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        ring = sorted(peer.shifter.peer_id for peer in peers)
        index_of = {peer.shifter.peer_id: i for i, peer in enumerate(peers)}
        for position, peer_id in enumerate(ring):
            me, predecessor = index_of[peer_id], index_of[ring[position - 1]]
            assert peers[me].shifts == 1
            for now, then in zip(models[me].parameters(), before[predecessor]):
                assert torch.equal(now, then), f"peer {me} continues peer {predecessor}'s replica"
    finally:
        for peer in peers:
            peer.shutdown()


def test_a_garbage_shift_payload_is_refused():
    from hivekeeper.swarm.model_shifting import deserialize, serialize

    like = [torch.zeros(2, 3), torch.zeros(4)]
    assert [t.shape for t in deserialize(serialize(like), like)] == [(2, 3), (4,)]
    for payload in (b"garbage", serialize([torch.zeros(3, 2)]), serialize(like[:1])):
        with pytest.raises(ValueError):
            deserialize(payload, like)
