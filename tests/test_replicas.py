"""The replica fingerprint and the group's verdict (`hivekeeper.replicas`): rounding
noise agrees, a real difference does not, and every member reaches the same verdict."""

from __future__ import annotations

import pytest
import torch

from hivekeeper.replicas import TOLERANCE, Fingerprint, fingerprint, replica_verdict


def model_parameters(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 100, generator=generator), torch.randn(64, generator=generator),
            torch.randn(10, 64, generator=generator), torch.randn(10_000, 3, generator=generator)]


def test_replicas_equal_to_rounding_agree_and_a_step_apart_do_not():
    params = model_parameters()
    base = fingerprint(params)
    assert base == fingerprint([p.clone() for p in params])  # deterministic
    rounding = [p * (1 + 1e-7 * torch.randn_like(p)) for p in params]
    assert base.agrees_with(fingerprint(rounding))
    for relative in (1e-2, 3e-3):  # a step's update, a parameter round that half happened
        apart = [p + relative * p.abs().mean() * torch.randn_like(p) for p in params]
        assert not base.agrees_with(fingerprint(apart)), relative
    # one tensor moved, the others equal: still apart
    moved = [params[0] + 0.05, *params[1:]]
    assert not base.agrees_with(fingerprint(moved))


def test_the_fingerprint_reads_a_bounded_sample_on_any_device_and_dtype():
    params = [p.to(torch.float16) for p in model_parameters()]
    assert fingerprint(params).agrees_with(fingerprint([p.float() for p in params]))
    assert len(fingerprint(params).to_wire()) == 5


@pytest.mark.parametrize("wire", [None, "x", [1.0, 2.0], [1.0, 2.0, 3.0, 4.0, -1.0],
                                  [1.0, 2.0, float("nan"), 4.0, 1.0], [True, 2.0, 3.0, 4.0, 1.0]])
def test_a_malformed_fingerprint_is_none(wire):
    assert Fingerprint.from_wire(wire) is None


def test_the_reference_is_the_replica_most_members_hold_then_the_latest():
    a, b = fingerprint(model_parameters(0)), fingerprint(model_parameters(1))
    everyone = [True] * 4
    assert replica_verdict([a, a, b, a], [5, 5, 5, 5], everyone).diverged == {2}
    assert replica_verdict([a, b, None, a], [5, 5, 5, 5], everyone).diverged == {1}  # no fingerprint: not judged
    assert replica_verdict([a, b], [4, 5], everyone[:2]).diverged == {0}  # a tie: the later epoch wins
    assert replica_verdict([a, b], [5, 5], everyone[:2]).diverged == {1}  # then the group's order
    assert replica_verdict([a, b, b], [5, 5, 5], [True, False, True]).diverged == {2}  # the unjudged b counts for nothing
    assert replica_verdict([a, b], [5, 5], [True, False]).agreed  # the other is not judged (an auxiliary)
    assert replica_verdict([a, a], [5, 5], everyone[:2]).agreed
    assert TOLERANCE < 1e-2


def test_among_replicas_held_alike_the_reference_is_the_one_nearest_the_others():
    """After a round that failed for everyone, each member stepped alone: two honest members a
    small step apart, a hostile one far off (its gradient scaled by -10). However the epochs and
    the group's order fall, the reference is an honest replica, the one nearest the others."""
    params = model_parameters()
    step = [0.01 * torch.randn_like(p) for p in params]
    honest = fingerprint([p - s for p, s in zip(params, step)])
    other_honest = fingerprint([p - 1.2 * s for p, s in zip(params, step)])
    hostile = fingerprint([p + 10 * s for p, s in zip(params, step)])
    everyone = [True] * 3
    assert replica_verdict([hostile, honest, other_honest], [6, 5, 5], everyone).diverged == {0, 2}
    assert replica_verdict([other_honest, hostile, honest], [5, 5, 5], everyone).diverged == {0, 1}
    # two replicas held alike: nearer is no reason (each is as near the other), the epoch decides
    assert replica_verdict([hostile, honest], [6, 5], everyone[:2]).diverged == {1}
