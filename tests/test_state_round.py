"""Parameter rounds on the gradient round's group (`hivemind_ext/state_round.py`): when members
agree to hold one, what a member takes from it, and a real group of gradient averagers running
both rounds on one matchmaking."""

from __future__ import annotations

import time

import pytest
import torch

from hivekeeper.hivemind_ext.state_round import StateRound, agreed_epoch, layout_digest
from test_planned_averaging import own_p2pd, shut_down

NODE, AUX, CLIENT = 0, 2, 1  # hivemind's AveragingMode values
LAYOUT = "abc"


@pytest.mark.parametrize("entries, modes, expected", [
    ([[7, LAYOUT], [7, LAYOUT]], [NODE, NODE], 7),
    ([[7, LAYOUT], [7, LAYOUT], [None, LAYOUT]], [NODE, CLIENT, AUX], 7),  # an auxiliary names no epoch
    ([[7, LAYOUT], [8, LAYOUT]], [NODE, NODE], None),  # a step apart: never averaged together
    ([[7, LAYOUT], [None, LAYOUT]], [NODE, NODE], None),  # one member is out of sync or not due
    ([[7, LAYOUT], [7, "other"]], [NODE, NODE], None),  # different parameter shapes
    ([[7, LAYOUT], [None, LAYOUT]], [NODE, AUX], None),  # one sender: nothing to average
    ([[7, LAYOUT], None], [NODE, NODE], None),  # a member without a state round
    ([[7, LAYOUT], "garbage"], [NODE, NODE], None),
    ([[7, LAYOUT], [True, LAYOUT]], [NODE, NODE], None),
    ([[7, LAYOUT], [7.0, LAYOUT]], [NODE, NODE], None),
    ([], [], None),
])
def test_members_hold_a_parameter_round_only_when_all_senders_name_one_step(entries, modes, expected):
    assert agreed_epoch(entries, modes, LAYOUT) == expected


def test_the_layout_names_the_shapes():
    assert layout_digest([torch.zeros(2, 3)]) == layout_digest([torch.ones(2, 3)])
    assert layout_digest([torch.zeros(2, 3)]) != layout_digest([torch.zeros(3, 2)])


def test_a_member_takes_the_average_only_from_a_complete_round_of_its_loaded_step():
    params = [torch.nn.Parameter(torch.full((4,), 1.0)), torch.nn.Parameter(torch.full((2, 2), 2.0))]
    state = StateRound(params, due=lambda: 3)
    assert state.entry() == [3, state.layout]

    # no round ran for the loaded step (the report still names none): nothing taken
    state.load(params, epoch=3)
    assert state.weight(3) == 1.0 and state.weight(4) == 0.0
    assert state.take(params) is None

    # a complete round: the averaged copies become the parameters
    state.load(params, epoch=3)
    for buffer in state.tensors:
        buffer.add_(0.5)  # what the all-reduce wrote
    state.report(3, complete=True)
    assert state.take(params) == "averaged"
    assert torch.equal(params[0].detach(), torch.full((4,), 1.5)) and torch.equal(params[1].detach(),
                                                                                  torch.full((2, 2), 2.5))
    assert state.take(params) is None  # taken once

    # an incomplete round, or one whose average is not finite, leaves the parameters alone
    state.load(params, epoch=4)
    state.report(4, complete=False)
    assert state.take(params) == "failed"
    state.load(params, epoch=5)
    state.tensors[0][0] = float("nan")
    state.report(5, complete=True)
    assert state.take(params) == "failed"
    assert torch.equal(params[0].detach(), torch.full((4,), 1.5))

    # the report of another step's round is not this one's
    state.load(params, epoch=6)
    state.report(5, complete=True)
    assert state.take(params) is None
    # a discarded step takes nothing, and weighs nothing in a late round
    state.load(params, epoch=7)
    state.discard()
    assert state.weight(7) == 0.0
    state.report(7, complete=True)
    assert state.take(params) is None


@pytest.mark.swarm
@pytest.mark.isolated  # forks hivemind averagers from the test process
@pytest.mark.timeout(240)
def test_gradient_averagers_average_parameters_on_the_gradient_rounds_group():
    """Three planned gradient averagers in one group. Round 1: two members loaded the step's
    parameters, the third loaded another step's (it would bring stale ones): the parameters are
    the mean of the two, at both, and the third takes nothing; the gradients are averaged as
    ever. Round 2: one member is not due: no parameter round anywhere."""
    import hivemind
    from hivemind.optim.grad_averager import GradientAverager

    from hivekeeper.hivemind_ext.allreduce import planned

    size, epoch = 3000, 5
    due = [epoch, epoch, epoch]
    dhts, averagers, params, states, others = [], [], [], [], own_p2pd()
    try:
        for k in range(3):
            initial = [str(m) for m in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
            params.append(torch.nn.Parameter(torch.randn(size, generator=torch.Generator().manual_seed(10 + k))))
            states.append(StateRound([params[-1]], due=lambda k=k: due[k]))
            averagers.append(planned(GradientAverager)(
                [params[-1]], dht=dhts[-1], prefix="state_round_test", start=True, target_group_size=3,
                min_group_size=3, min_matchmaking_time=1.0, request_timeout=0.5, state_round=states[-1],
                next_chunk_timeout=10.0, allreduce_timeout=30.0))
        before = [p.detach().clone() for p in params]
        grads = [torch.randn(size, generator=torch.Generator().manual_seed(k)) for k in range(3)]

        def round_trip(load_epochs):
            for averager, param, grad, state, loaded in zip(averagers, params, grads, states, load_epochs):
                param.grad = grad.clone()
                averager.accumulate_grads_(batch_size=1)
                state.load([param], epoch=loaded)
            controls = [averager.step(wait=False, timeout=60) for averager in averagers]
            for control in controls:
                control.result(timeout=90)
            return [state.take([param]) for state, param in zip(states, params)]

        assert round_trip([epoch, epoch, epoch - 1]) == ["averaged", "averaged", None]
        mean = (before[0] + before[1]) / 2
        assert torch.allclose(params[0].detach(), mean, atol=1e-6)
        assert torch.allclose(params[1].detach(), mean, atol=1e-6)
        assert torch.equal(params[2].detach(), before[2])
        for averager in averagers:
            with averager.use_averaged_gradients() as (averaged,):
                assert torch.allclose(averaged, sum(grads) / 3, atol=1e-5)
        assert [state.rounds for state in states] == [1, 1, 1]

        due[1] = None
        time.sleep(0.5)
        assert round_trip([epoch, epoch, epoch]) == [None, None, None]
        assert [state.rounds for state in states] == [1, 1, 1]
    finally:
        shut_down(averagers, dhts, others)


def test_a_parameter_round_never_outlives_the_steps_all_reduce_timeout():
    from hivekeeper.hivemind_ext.allreduce import parameter_round_budget

    assert parameter_round_budget(20.0, elapsed=0.5, gradient_seconds=0.1) == 2.0  # the floor
    assert parameter_round_budget(20.0, elapsed=2.0, gradient_seconds=1.5) == 4.5  # a few gradient rounds
    assert parameter_round_budget(20.0, elapsed=16.0, gradient_seconds=5.0) == 3.0  # what the timeout leaves
    assert parameter_round_budget(20.0, elapsed=19.5, gradient_seconds=5.0) < 0  # none: skipped as failed
    assert parameter_round_budget(None, elapsed=100.0, gradient_seconds=5.0) == 15.0
