"""The wrapper over plain PyTorch loops: replicas that merge end identical, a peer joining
late starts from the merged state (weights, optimizer moments, step), a TIES peer that missed
a merge adopts the group's base instead of blocking later merges, merges fall on the steps an
epoch fraction names, moments stay local when told, and mode `gradients` steps the replicas
together. The tests that start peers fork hivemind averagers from the test process."""

from __future__ import annotations

import threading
import time
from fractions import Fraction

import hivemind
import pytest
import torch

from hivekeeper.swarm import ddap
from hivekeeper.swarm.merging_peer import MergeSchedule, MergingPeer, load_merged_state, state_tensors

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


# --- the merge schedule ------------------------------------------------------------------------


def merge_steps(schedule: MergeSchedule, steps: int) -> list[int]:
    return [step for step in range(1, steps + 1) if schedule.merges_at(step)]


def test_an_epoch_fraction_merges_on_the_marks_it_names():
    quarter = MergeSchedule.of(merge_every_epochs=0.25, steps_per_epoch=10)
    assert quarter.interval == Fraction(5, 2)
    assert merge_steps(quarter, 30) == [3, 5, 8, 10, 13, 15, 18, 20, 23, 25, 28, 30]  # epochs end on a merge
    assert merge_steps(MergeSchedule.of(merge_every_epochs=0.1, steps_per_epoch=30), 9) == [3, 6, 9]  # 3, exactly
    assert merge_steps(MergeSchedule.of(merge_every_epochs=2, steps_per_epoch=7), 30) == [14, 28]
    assert merge_steps(MergeSchedule.of(merge_every_epochs=0.01, steps_per_epoch=10), 3) == [1, 2, 3]  # < 1 step
    assert merge_steps(MergeSchedule.of(merge_every=4), 12) == [4, 8, 12]
    assert merge_steps(MergeSchedule.of(), 20) == [10, 20]


def test_shifts_fall_between_merges():
    schedule = MergeSchedule.of(merge_every_epochs=0.5, steps_per_epoch=9, shift_every=2)  # merges at 5, 9
    assert [step for step in range(1, 11) if schedule.shifts_at(step)] == [2, 4, 6, 8, 10]
    assert [step for step in range(1, 11) if schedule.merges_at(step)] == [5, 9]


@pytest.mark.parametrize("options, message", [
    (dict(merge_every=5, merge_every_epochs=0.5, steps_per_epoch=10), "not both"),
    (dict(merge_every_epochs=0.5), "steps_per_epoch"),
    (dict(merge_every_epochs=0, steps_per_epoch=10), "positive"),
    (dict(merge_every=0), "at least 1"),
    (dict(merge_every_epochs=0.25, steps_per_epoch=10, shift_every=3), "below the merge interval"),
])
def test_a_schedule_that_cannot_work_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        MergeSchedule.of(**options)


def test_the_wrapper_refuses_an_unknown_mode_before_starting_anything():
    model, opt = make_replica(0)
    with pytest.raises(ValueError, match="gradients, parameters, ties"):
        ddap.connect(model, opt, [], "no-run", mode="sgd")


# --- real peers ------------------------------------------------------------------------------


def together(calls: list, timeout: float) -> None:
    """Runs each (function, args) in a thread of its own; waits for all (at most `timeout` s each)."""
    threads = [threading.Thread(target=function, args=args) for function, args in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


@pytest.fixture
def bootstrap():
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield [str(a) for a in dht.get_visible_maddrs()]
    dht.shutdown()


@pytest.fixture
def dhts():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [str(a) for a in first.get_visible_maddrs()]
    others = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers) for _ in range(2)]
    yield [first, *others]
    for dht in reversed(others + [first]):
        dht.shutdown()


@pytest.mark.swarm
@pytest.mark.isolated
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["parameters", "ties"])
def test_replicas_merge_and_a_late_joiner_starts_from_the_merged_state(dhts, no_leaked_p2pd, mode):
    replicas = [make_replica(i) for i in range(2)]
    peers = [MergingPeer(model, opt, dht, "merge-test", mode=mode, merge_every=EVERY, matchmaking_seconds=2.0,
                         timeout_seconds=30.0) for (model, opt), dht in zip(replicas, dhts)]
    joiner = None
    try:
        records: list[list] = [[], []]
        together([(train, (peer, model, opt, seed, STEPS, records[seed]))
                  for seed, (peer, (model, opt)) in enumerate(zip(peers, replicas))], timeout=120)
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


@pytest.mark.swarm
@pytest.mark.isolated
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
            together([(train, (peers[1], *replicas[1], 1, EVERY, moved[0])),
                      (train, (third, third_model, third_opt, 2, EVERY, moved[1]))], timeout=60)
            assert [[r.outcome for r in rs] for rs in moved] == [["success"], ["success"]], moved
            # Peer 0, on the old base, fails its next merge alone and adopts the group's base...
            train(peers[0], *replicas[0], 0, EVERY, lonely)
            # (members' merged tensors agree to float32 rounding: each adds the averaged delta to its own)
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(peers[0].base, peers[1].base))
            assert peers[0].base_id == peers[1].base_id
            assert peers[0].merges == peers[1].merges == 1
            # ...so that it merges with the others again.
            again: list[list] = [[], [], []]
            everyone = zip(peers + [third], replicas + [(third_model, third_opt)])
            together([(train, (peer, model, opt, seed, EVERY, again[seed]))
                      for seed, (peer, (model, opt)) in enumerate(everyone)], timeout=60)
            # peer 0 merges with someone again: possible only on the group's base (members that
            # reach the merge point apart may pair off, so not every one need be in its group)
            assert again[0] and again[0][-1].outcome == "success" and again[0][-1].group_size >= 2, again
        finally:
            third.shutdown()
    finally:
        for peer in peers:
            peer.shutdown()


@pytest.mark.swarm
@pytest.mark.isolated
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

        together([(two_steps, args) for args in zip(peers, models, optimizers)], timeout=60)
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


@pytest.mark.swarm
@pytest.mark.isolated
@pytest.mark.timeout(120)
def test_a_with_block_merges_weights_not_moments_when_told_and_stops_everything(bootstrap, no_leaked_p2pd):
    """merge_optimizer_state=False: the weights are merged, each replica's Adam moments stay its
    own. Leaving the `with` block stops the merger and the DHT that `connect` started."""
    replicas = [make_replica(i) for i in range(2)]
    options = dict(host="127.0.0.1", merge_every=EVERY, merge_optimizer_state=False, timeout_seconds=30.0)
    records: list[list] = [[], []]
    with MergingPeer.connect(*replicas[0], bootstrap, "moments-test", **options) as first, \
            MergingPeer.connect(*replicas[1], bootstrap, "moments-test", **options) as second:
        peers = [first, second]
        dhts = [peer._own_dht for peer in peers]
        together([(train, (peer, model, opt, seed, EVERY, records[seed]))
                  for seed, (peer, (model, opt)) in enumerate(zip(peers, replicas))], timeout=90)
    assert [[(r.outcome, r.group_size) for r in rs] for rs in records] == [[("success", 2)]] * 2, records
    (model_a, _), (model_b, _) = replicas
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    moments = [[opt.state[p][key] for p in model.parameters() for key in ("exp_avg", "exp_avg_sq")]
               for model, opt in replicas]
    assert all(not torch.allclose(a, b) for a, b in zip(*moments)), "each replica keeps its own moments"
    assert not any(peer.merger.averager.is_alive() or dht.is_alive() for peer, dht in zip(peers, dhts))


@pytest.mark.swarm
@pytest.mark.isolated
@pytest.mark.timeout(150)
def test_mode_gradients_steps_the_replicas_together(bootstrap, no_leaked_p2pd):
    """DeDLOC through the wrapper: two peers, each step on the average of both peers' gradients
    (a global batch of both peers' batches), so the replicas stay one model."""
    replicas = [make_replica(i) for i in range(2)]
    before = [p.detach().clone() for p in replicas[0][0].parameters()]
    options = dict(mode="gradients", host="127.0.0.1", batch_size=32, target_batch_size=64, expected_peers=2,
                   matchmaking_seconds=1.0, timeout_seconds=30.0)
    peers = []
    try:
        for model, opt in replicas:
            peers.append(ddap.connect(model, opt, bootstrap, "gradients-test", **options))
        records: list[list] = [[], []]

        def train_to_epoch(peer, model, seed: int) -> None:
            generator = torch.Generator().manual_seed(seed)
            deadline = time.monotonic() + 90
            while peer.epoch < 2 and time.monotonic() < deadline:
                time.sleep(0.02)  # a step takes no time here; the peers meet in the DHT within a second or two
                x = torch.randn(32, 8, generator=generator)
                torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
                peer.optimizer.step()
                peer.optimizer.zero_grad()
                record = peer.step()
                if record is not None:
                    records[seed].append(record)

        together([(train_to_epoch, (peer, model, seed))
                  for seed, (peer, (model, _)) in enumerate(zip(peers, replicas))], timeout=120)
        assert [peer.epoch for peer in peers] == [2, 2]
        assert all(any((r.outcome, r.group_size) == ("success", 2) for r in rs) for rs in records), records
        (model_a, _), (model_b, _) = replicas
        assert not all(torch.equal(a, b) for a, b in zip(model_a.parameters(), before)), "the user's model trained"
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            assert torch.allclose(a, b, atol=1e-6)
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
