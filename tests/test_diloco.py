"""DiLoCo over real hivemind peers: an outer round equals centralized DiLoCo (the weighted mean
of pseudo-gradients through Nesterov SGD, momentum carried across rounds), a late joiner starts
from the outer parameters and momentum, a replica that missed a round catches up without losing
its inner progress, overlapped rounds keep the inner steps taken meanwhile, and float16 halves
the bytes. The tests fork hivemind averagers from the test process."""

from __future__ import annotations

import threading
import time

import hivemind
import pytest
import torch

from hivekeeper.swarm import ddap
from hivekeeper.swarm.diloco import DilocoPeer, OuterOptimizer, OuterState
from hivekeeper.swarm.merging_peer import load_merged_state

H = 2  # inner steps per outer step
OUTER = OuterOptimizer(learning_rate=0.7, momentum=0.9, nesterov=True)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # same initial weights everywhere, as a Swarm's seeded task gives
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def inner_step(model: torch.nn.Module, seed: int) -> None:
    """Stands for one inner optimizer step: a deterministic move of this replica's own."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def run_inner(peer: DilocoPeer, model: torch.nn.Module, seeds: list[int], records: list) -> None:
    for seed in seeds:
        inner_step(model, seed)
        record = peer.step()
        if record is not None:
            records.append(record)


def together(calls: list, timeout: float = 60.0) -> None:
    threads = [threading.Thread(target=function, args=args) for function, args in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


def centralized_round(outer: list[torch.Tensor], momentum: list[torch.Tensor], replicas: list[list[torch.Tensor]],
                      weights: list[float]) -> None:
    """DiLoCo's outer step, in place, with torch's own Nesterov SGD as the reference."""
    total = sum(weights)
    leaves = [torch.nn.Parameter(o.clone()) for o in outer]
    sgd = torch.optim.SGD(leaves, lr=OUTER.learning_rate, momentum=OUTER.momentum, nesterov=True)
    for leaf, buffer in zip(leaves, momentum):
        sgd.state[leaf]["momentum_buffer"] = buffer.clone()
    for i, leaf in enumerate(leaves):
        leaf.grad = sum(w * (outer[i] - r[i]) for w, r in zip(weights, replicas)) / total
    sgd.step()
    for i, leaf in enumerate(leaves):
        outer[i].copy_(leaf.detach())
        momentum[i].copy_(sgd.state[leaf]["momentum_buffer"])


@pytest.fixture
def dhts():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial = [str(a) for a in first.get_visible_maddrs()]
    others = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial) for _ in range(3)]
    yield [first, *others]
    for dht in reversed(others + [first]):
        dht.shutdown()


def start(dht, model, prefix: str, **options) -> DilocoPeer:
    options = {"inner_steps": H, "outer": OUTER, "matchmaking_seconds": 1.0, "timeout_seconds": 20.0,
               "target_group_size": 3, **options}
    return DilocoPeer(model, torch.optim.SGD(model.parameters(), lr=0.1), dht, prefix, **options)


def test_the_outer_optimizer_is_torchs_nesterov_sgd():
    torch.manual_seed(1)
    mine, theirs = [torch.randn(4, 3)], [torch.nn.Parameter(torch.randn(4, 3))]
    mine[0].copy_(theirs[0].detach())
    buffer = [torch.zeros(4, 3)]
    sgd = torch.optim.SGD(theirs, lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(4):
        grad = torch.randn(4, 3)
        theirs[0].grad = grad.clone()
        sgd.step()
        OUTER.step(mine, buffer, [grad])
        assert torch.allclose(mine[0], theirs[0].detach(), atol=1e-6)
    with pytest.raises(ValueError, match="momentum"):
        OuterOptimizer(momentum=1.0)


def test_states_rank_by_step_then_by_the_same_hash_everywhere():
    a, b = OuterState(3, "aa"), OuterState(3, "bb")
    assert OuterState(4, "aa").rank > max(a.rank, b.rank)
    assert (a.rank > b.rank) == (a.priority > b.priority)  # hivemind's download order agrees with adoption's
    assert int(OuterState(4, "x").priority) == 4


def test_the_wrapper_offers_diloco_and_refuses_bad_options():
    model = make_model()
    with pytest.raises(ValueError, match="compression"):
        ddap.connect(model, torch.optim.SGD(model.parameters(), lr=0.1), [], "no-run", mode="diloco",
                     compression="zip")
    assert "diloco" in ddap.MODES


@pytest.mark.swarm
@pytest.mark.isolated
@pytest.mark.timeout(150)
def test_outer_rounds_equal_centralized_diloco_and_a_late_joiner_starts_from_the_outer_state(dhts, no_leaked_p2pd):
    models = [make_model() for _ in range(3)]
    peers = [start(dht, model, "diloco-test") for dht, model in zip(dhts, models)]
    joiner = None
    try:
        outer, momentum = params(models[0]), [torch.zeros_like(p) for p in params(models[0])]
        for round_index in range(2):
            records: list[list] = [[], [], []]
            # the replicas' parameters just before the boundary's step() equal those after H inner steps
            expected = []
            for i, model in enumerate(models):
                copy = make_model()
                copy.load_state_dict(model.state_dict())
                for s in range(H):
                    inner_step(copy, 100 * round_index + 10 * i + s)
                expected.append(params(copy))
            together([(run_inner, (peer, model, [100 * round_index + 10 * i + s for s in range(H)], records[i]))
                      for i, (peer, model) in enumerate(zip(peers, models))])
            assert [[r.outcome for r in rs] for rs in records] == [["success"]] * 3, records
            assert all(r.group_size == 3 for rs in records for r in rs)
            centralized_round(outer, momentum, expected, [H] * 3)
            for peer, model in zip(peers, models):
                assert peer.merges == round_index + 1
                for mine, reference in zip(peer.outer_params + peer.momentum, outer + momentum):
                    assert torch.allclose(mine, reference, atol=1e-6)
                for local, reference in zip(model.parameters(), outer):  # every replica restarts from it
                    assert torch.allclose(local.detach(), reference, atol=1e-6)
            assert len({peer.state for peer in peers}) == 1
        n = sum(p.numel() for p in models[0].parameters())
        for peer in peers:  # a third of the vector is reduced here, two thirds sent away, its averages sent back
            assert peer.sent_bytes == pytest.approx(2 * (2 * n / 3 + 2 * n / 3) * 4, rel=0.05)

        model = make_model()
        inner_step(model, 999)  # a joiner whose weights differ
        joiner = DilocoPeer.connect(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    [str(a) for a in dhts[0].get_visible_maddrs()], "diloco-test", host="127.0.0.1",
                                    inner_steps=H, outer=OUTER)
        assert joiner.state == peers[0].state and joiner.local_steps == 2 * H
        for mine, reference in zip(joiner.outer_params + joiner.momentum, outer + momentum):
            assert torch.allclose(mine, reference, atol=1e-6)
        assert all(torch.allclose(p.detach(), o, atol=1e-6) for p, o in zip(model.parameters(), outer))
        # the monitor reads the outer parameters without taking part
        watcher = make_model()
        metadata = load_merged_state(dhts[3], "diloco-test", watcher, None)
        assert metadata["outerStep"] == 2
        assert all(torch.allclose(p.detach(), o, atol=1e-6) for p, o in zip(watcher.parameters(), outer))
    finally:
        for peer in peers + ([joiner] if joiner else []):
            peer.shutdown()


@pytest.mark.swarm
@pytest.mark.isolated
@pytest.mark.timeout(150)
def test_a_replica_that_missed_a_round_catches_up_keeping_its_progress(dhts, no_leaked_p2pd):
    models = [make_model() for _ in range(3)]
    peers = [start(dht, model, "catch-up") for dht, model in zip(dhts, models)]
    try:
        records: list[list] = [[], [], []]
        together([(run_inner, (peers[i], models[i], [10 * i, 10 * i + 1], records[i])) for i in (0, 1)])
        assert [[r.outcome for r in records[i]] for i in (0, 1)] == [["success"]] * 2, records
        # Replica 2 reaches the boundary after the others took the outer step: it finds no one at
        # its round, keeps its progress, and adopts the outer state with its progress on top.
        before = params(models[2])
        run_inner(peers[2], models[2], [20], records[2])
        progress = [after - start_ for after, start_ in zip(params(models[2]), before)]
        inner_step(models[2], 21)
        mine = params(models[2])
        record = peers[2].step()
        assert record is not None and record.outcome == "failure"
        assert peers[2].state == peers[0].state
        initial = params(make_model())
        for local, outer, own, first in zip(models[2].parameters(), peers[0].outer_params, mine, initial):
            assert torch.allclose(local.detach(), outer + (own - first), atol=1e-6)
        assert progress  # (its first inner step is part of `own - first`)
        assert peers[2].since_sync == H  # its next pseudo-gradient covers both steps: weight 2
        # All three meet at the next round.
        records = [[], [], []]
        together([(run_inner, (peer, model, [30 + i, 40 + i], records[i]))
                  for i, (peer, model) in enumerate(zip(peers, models))])
        assert all(rs and rs[-1].outcome == "success" for rs in records), records
        assert len({peer.state for peer in peers}) == 1 and peers[0].merges == 2
    finally:
        for peer in peers:
            peer.shutdown()


@pytest.mark.swarm
@pytest.mark.isolated
@pytest.mark.timeout(150)
def test_an_overlapped_round_keeps_the_inner_steps_taken_meanwhile_and_float16_halves_the_bytes(dhts, no_leaked_p2pd):
    every = 40
    models = [make_model() for _ in range(2)]
    peers = [start(dht, model, "overlap", inner_steps=every, overlap=True, compression="float16",
                   target_group_size=2) for dht, model in zip(dhts, models)]
    try:
        outcomes: list = [None, None]

        def replica(i: int) -> None:
            model, peer = models[i], peers[i]
            for step in range(every):  # the last step() starts the round and returns at once
                inner_step(model, 10 * i + step)
                assert peer.step() is None
            snapshot, kept = params(model), 0
            while True:  # inner steps go on while the round runs
                time.sleep(0.05)
                inner_step(model, 1000 * i + kept)
                before = params(model)
                kept += 1
                record = peer.step()
                if record is not None:
                    outcomes[i] = (record, snapshot, before, kept)
                    return
        together([(replica, (0,)), (replica, (1,))])
        for i, (model, peer) in enumerate(zip(models, peers)):
            record, snapshot, before, kept = outcomes[i]
            assert record.outcome == "success" and peer.merges == 1 and 0 < kept < every
            for local, outer, b, s in zip(model.parameters(), peer.outer_params, before, snapshot):
                assert torch.allclose(local.detach(), outer + (b - s), atol=1e-6)  # the new outer + what came since
            assert peer.since_sync == kept  # the next pseudo-gradient's weight
        # float16 members' outer states agree to float16 rounding of the averaged pseudo-gradient
        for a, b in zip(peers[0].outer_params, peers[1].outer_params):
            assert torch.allclose(a, b, atol=1e-3)
        n = sum(p.numel() for p in models[0].parameters())
        for peer in peers:  # half its vector away, its half's average back, at 2 bytes an element
            assert peer.sent_bytes == pytest.approx((n / 2 + n / 2) * 2, rel=0.05)
    finally:
        for peer in peers:
            peer.shutdown()
