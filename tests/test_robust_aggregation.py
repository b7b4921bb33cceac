"""CenteredClip (hivemind_ext/robust.py): one hostile sender among honest ones moves the
result by at most the clipping radius, honest senders alone get (nearly) their mean, and the
reducer that applies it answers every sender with the same robust part."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hivekeeper.hivemind_ext.robust import CenteredClip, ClippingPartReducer


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
