"""CenteredClip (hivemind_ext/robust.py): one hostile sender among honest ones moves the
result by at most the clipping radius, honest senders alone get (nearly) their mean, and the
reducer that applies it answers every sender with the same robust part; its disjoint form for
TIES's second round; the all-or-nothing merge runner keeps its failure rule when robust; and
the spec refuses clipping settings that cannot apply."""

from __future__ import annotations

import asyncio

import pytest
import torch
import yaml
from hivemind.averaging.partition import AllreduceException

from conftest import EXAMPLES, deep_update
from hivekeeper.errors import UserError
from hivekeeper.hivemind_ext.merging import AllOrNothingRunner
from hivekeeper.hivemind_ext.robust import CenteredClip, ClippingPartReducer, lower_median, robust_runner
from hivekeeper.spec import parse_manifest


def honest_parts(count: int, size: int = 4096, spread: float = 0.3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    true = torch.randn(size, generator=generator)
    return true, true + spread * torch.randn(count, size, generator=generator)


def relative_error(estimate: torch.Tensor, target: torch.Tensor) -> float:
    return float((estimate - target).norm() / target.norm())


def test_a_sign_flipped_scaled_sender_barely_moves_the_clipped_center():
    true, honest = honest_parts(3)
    attacked = torch.cat([honest, -10 * honest[:1]])
    weights = torch.ones(4)
    mean = attacked.mean(0)
    clipped = CenteredClip()(attacked, weights)
    assert relative_error(mean, true) > 2.0  # the plain mean points the wrong way
    assert relative_error(clipped, honest.mean(0)) < 0.35
    assert torch.nn.functional.cosine_similarity(clipped, true, dim=0) > 0.95


def test_honest_senders_get_nearly_their_mean():
    _, honest = honest_parts(4, spread=0.1)
    clipped = CenteredClip(iterations=5)(honest, torch.ones(4))
    assert relative_error(clipped, honest.mean(0)) < 0.02


def test_a_fixed_radius_bounds_each_senders_pull():
    _, honest = honest_parts(3, spread=0.0)  # three identical parts
    hostile = honest[:1] + 1000.0
    radius = 0.01
    clipped = CenteredClip(radius=radius, iterations=3)(torch.cat([honest, hostile]), torch.ones(4))
    per_element = (clipped - honest[0]).norm() / honest.shape[1] ** 0.5
    assert per_element <= 3 * radius / 4 + 1e-6  # three iterations, each pulled by a quarter of the radius


def test_a_claimed_weight_counts_no_more_than_the_median():
    true, honest = honest_parts(3)
    attacked = torch.cat([honest, -10 * honest[:1]])
    fair = CenteredClip()(attacked, torch.ones(4))
    inflated = CenteredClip()(attacked, torch.tensor([1.0, 1.0, 1.0, 1e6]))
    assert torch.allclose(fair, inflated)


@pytest.mark.parametrize("senders", [1, 2, 3, 4, 7, 16, 17])
def test_the_sorting_network_median_is_torchs_lower_median(senders):
    rows = torch.randn(senders, 1000, generator=torch.Generator().manual_seed(senders))
    rows[:, :10] = rows[:1, :10]  # ties
    assert torch.equal(lower_median(rows), rows.median(dim=0).values)


@pytest.mark.parametrize("radius, iterations", [(0.0, 3), (float("nan"), 3), (None, 0)])
def test_bad_settings_are_refused(radius, iterations):
    with pytest.raises(ValueError):
        CenteredClip(radius=radius, iterations=iterations)


def test_the_reducer_answers_every_sender_with_the_clipped_part():
    _, honest = honest_parts(3, size=64)
    parts = torch.cat([honest, -10 * honest[:1]]).reshape(4, 2, 32)  # two parts of 32 elements each
    aggregate = CenteredClip()

    async def run() -> list[list[torch.Tensor]]:
        reducer = ClippingPartReducer([torch.Size([32])] * 2, num_senders=4, aggregate=aggregate)

        async def sender(index: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(index, k, parts[index, k]) for k in range(2)]

        return await asyncio.gather(*(sender(i) for i in range(4)))

    answers = asyncio.run(run())
    for k in range(2):
        expected = aggregate(parts[:, k], torch.ones(4))
        assert all(torch.allclose(answer[k], expected, atol=1e-6) for answer in answers)  # arrival order: float sums


# --- TIES's second round: zeros abstain (CenteredClip(disjoint=True)) ----------------------------


def votes_of(parts: torch.Tensor, keep: float, seed: int) -> torch.Tensor:
    """`parts` with a random (1 - keep) of each sender's entries zeroed: abstentions."""
    generator = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(parts.shape, generator=generator) < keep, parts, torch.zeros_like(parts))


def test_without_clipping_the_disjoint_center_is_the_mean_of_each_coordinates_voters():
    _, honest = honest_parts(4, size=512)
    voted = votes_of(honest, keep=0.6, seed=1)
    voted[:, :3] = 0.0  # nobody voted on these
    center = CenteredClip(radius=1e6, iterations=1, disjoint=True)(voted, torch.ones(4))
    count = (voted != 0).sum(0)
    expected = torch.where(count > 0, voted.sum(0) / count.clamp(min=1), torch.zeros_like(count, dtype=torch.float32))
    assert torch.allclose(center, expected, atol=1e-6)
    assert torch.equal(center[:3], torch.zeros(3))


def test_a_hostile_voter_barely_moves_the_disjoint_center_even_where_it_votes_alone():
    _, honest = honest_parts(3, size=4096)
    voted = votes_of(0.1 * honest, keep=0.7, seed=2)  # offsets of a TIES merge: about 0.1
    hostile = torch.full((1, 4096), 50.0)  # votes everywhere, with a huge value
    aggregate = CenteredClip(disjoint=True)
    center = aggregate(torch.cat([voted, hostile]), torch.ones(4))
    honest_center = aggregate(voted, torch.ones(3))
    count = (voted != 0).sum(0)
    plain = torch.cat([voted, hostile]).sum(0) / (count + 1)  # TIES's disjoint mean

    def rms(x: torch.Tensor) -> float:
        return float(x.pow(2).mean().sqrt())

    alone = count == 0
    assert alone.any()
    assert float(center[alone].abs().max()) < 0.01 * 50  # a voters' median would give it 50 there
    assert rms(center - honest_center) < 0.75 * rms(honest_center) < 0.01 * rms(plain - honest_center)


# --- the robust runner keeps the all-or-nothing runner's failure rule (weight merges) -------------


class _P2P:  # what AllReduceRunner reads of its P2P before it communicates
    peer_id = "A"


@pytest.mark.parametrize("robust", [False, True])
def test_the_robust_all_or_nothing_runner_voids_the_round_when_a_sender_is_lost(robust):
    """hivemind_ext.merging's runner, plain and through robust_runner: parts finished before a
    sender is lost are answered (robustly, in the robust runner), and the part in progress
    and every later one fail instead of averaging over the senders left."""
    aggregate = CenteredClip()
    runner_class = robust_runner(AllOrNothingRunner) if robust else AllOrNothingRunner
    options = dict(aggregation=aggregate) if robust else {}
    _, parts = honest_parts(3, size=64)
    parts = parts.reshape(3, 2, 32)  # two parts of 32 elements, all aggregated by peer A

    async def run() -> tuple[torch.Tensor, BaseException, BaseException, bool]:
        runner = runner_class(p2p=_P2P(), servicer_type=AllOrNothingRunner, prefix=None, group_id=b"g",
                              tensors=[torch.zeros(64)], ordered_peer_ids=["A", "B", "C"],
                              peer_fractions=(64, 0, 0), part_size_bytes=32 * 4, **options)
        reducer = runner.tensor_part_reducer
        assert isinstance(reducer, ClippingPartReducer) == robust
        first = await asyncio.gather(*(reducer.accumulate_part(k, 0, parts[k, 0]) for k in range(3)))
        pending = [asyncio.ensure_future(reducer.accumulate_part(k, 1, parts[k, 1])) for k in (0, 1)]
        await asyncio.sleep(0)
        await runner._ban_sender("C")  # C never sends part 1
        failures = await asyncio.gather(*pending, return_exceptions=True)
        later = await asyncio.gather(reducer.accumulate_part(0, 1, parts[0, 1]), return_exceptions=True)
        return first[0], failures[0], later[0], runner.voided

    first, failure, later, voided = asyncio.run(run())
    expected = aggregate(parts[:, 0], torch.ones(3)) if robust else parts[:, 0].mean(0)
    assert torch.allclose(first, expected, atol=1e-6)
    assert isinstance(failure, AllreduceException) and "void" in str(failure)
    assert isinstance(later, Exception) and voided



def test_the_reducer_the_robust_runner_replaces_is_dropped_without_a_warning(monkeypatch):
    """hivemind warns "Reducer: received 0.0% of input tensors" when a reducer is collected
    unfinished; the one robust_runner replaces was never meant to receive anything."""
    import gc

    from hivemind.averaging import partition

    warned = []
    monkeypatch.setattr(partition.logger, "warning", lambda message, *a, **k: warned.append(message))

    async def make() -> None:
        runner = robust_runner(AllOrNothingRunner)(
            p2p=_P2P(), servicer_type=AllOrNothingRunner, prefix=None, group_id=b"g", tensors=[torch.zeros(64)],
            ordered_peer_ids=["A", "B", "C"], peer_fractions=(64, 0, 0), part_size_bytes=32 * 4,
            aggregation=CenteredClip())
        runner.tensor_part_reducer.finished.set()  # the reducer in use, as a completed round leaves it

    asyncio.run(make())
    gc.collect()
    assert not [m for m in warned if "Reducer: received" in m]

# --- the spec ---------------------------------------------------------------------------------


@pytest.mark.parametrize("averaging, error", [
    ({"centeredClip": {"radius": 0.1}}, "centeredClip: only for aggregation centeredClip"),
    ({"aggregation": "centeredClip", "targetGroupSize": 2}, "centeredClip needs groups of at least 3"),
])
def test_the_spec_refuses_clipping_settings_that_cannot_apply(averaging, error):
    document = deep_update(yaml.safe_load((EXAMPLES / "swarm-digits.yaml").read_text()),
                           {"spec": {"averaging": averaging}})
    with pytest.raises(UserError, match=error):
        parse_manifest(document)
    robust = deep_update(document, {"spec": {"averaging": {"aggregation": "centeredClip", "targetGroupSize": 3}}})
    assert parse_manifest(robust).spec.averaging.centered_clip.iterations == 3


# --- the state averager (averageStateEvery) ----------------------------------------------------


@pytest.mark.swarm
@pytest.mark.isolated  # forks hivemind averagers from the test process
@pytest.mark.timeout(120)
def test_a_hostile_members_parameters_barely_move_the_robust_state_average(no_leaked_p2pd):
    """The trainers' parameter averaging (hivemind's TrainingStateAverager, as the Swarm's
    optimizer makes it) with CenteredClip: three honest replicas and one far off."""
    from concurrent.futures import ThreadPoolExecutor

    import hivemind

    from hivekeeper.hivemind_ext.optimizer import FiniteStateAverager

    _, honest = honest_parts(3, size=2000, spread=0.01)
    replicas = [*honest, honest[0] + 1000.0]
    dhts, averagers = [], []
    try:
        for replica in replicas:
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
            averagers.append(FiniteStateAverager(
                dht=dhts[-1], params=[torch.nn.Parameter(replica.clone())], optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                prefix="robust_state", start=True, target_group_size=4, min_group_size=4, min_matchmaking_time=1.0,
                request_timeout=0.5, aggregation=CenteredClip()))
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(a.step, averaging_round=True, averaging_opts=dict(timeout=60)) for a in averagers]
            for future in futures:
                future.result(timeout=90)
        averaged = [a.main_parameters[0].detach().clone() for a in averagers]
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
    spread = float((honest - honest.mean(0)).pow(2).mean().sqrt())
    for result in averaged:
        assert float((result - honest.mean(0)).pow(2).mean().sqrt()) < spread  # the mean would be 250 off
        assert torch.allclose(result, averaged[0], atol=1e-3)  # float32: the far one adds (center - 1000) to 1000
