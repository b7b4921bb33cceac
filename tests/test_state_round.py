"""Parameter rounds on the gradient round's group (`hivemind_ext/state_round.py`): when members
agree to hold one, what a member takes from it, and a real group of gradient averagers running
both rounds on one matchmaking."""

from __future__ import annotations

import time

import pytest
import torch

from hivekeeper.hivemind_ext.state_round import StateEntry, StateRound, agreed_epoch, group_verdict, layout_digest
from test_planned_averaging import own_p2pd, shut_down

NODE, AUX, CLIENT = 0, 2, 1  # hivemind's AveragingMode values
LAYOUT = "abc"


def entry(due, layout=LAYOUT, epoch=7, print_=None):
    """A gathered entry as a member sends it: [due epoch, layout, local epoch, fingerprint]."""
    return [due, layout, epoch, print_ if print_ is not None else [1.0, 2.0, 3.0, 4.0, 10.0]]


@pytest.mark.parametrize("entries, modes, expected", [
    ([entry(7), entry(7)], [NODE, NODE], 7),
    ([entry(7), entry(7), entry(None)], [NODE, CLIENT, AUX], 7),  # an auxiliary names no epoch
    ([entry(7), entry(8)], [NODE, NODE], None),  # a step apart: never averaged together
    ([entry(7), entry(None)], [NODE, NODE], None),  # one member is out of sync or not due
    ([entry(7), entry(7, "other")], [NODE, NODE], None),  # different parameter shapes
    ([entry(7), entry(None)], [NODE, AUX], None),  # one sender: nothing to average
    ([entry(7), None], [NODE, NODE], None),  # a member without a state round
    ([entry(7), "garbage"], [NODE, NODE], None),
    ([entry(7), [7, LAYOUT]], [NODE, NODE], None),  # another version's entry
    ([entry(7), entry(True)], [NODE, NODE], None),
    ([entry(7), entry(7.0)], [NODE, NODE], None),
    ([], [], None),
])
def test_members_hold_a_parameter_round_only_when_all_senders_name_one_step(entries, modes, expected):
    states = [StateEntry.read(e) for e in entries]
    assert agreed_epoch(states, modes, LAYOUT, group_verdict(states, modes)) == expected


def test_a_diverged_replica_is_left_out_and_the_others_average():
    """Two members hold one replica, a third another one a step behind: the third is found
    apart, sends nothing, and the two still average their parameters."""
    same, other = [1.0, 2.0, 3.0, 4.0, 10.0], [1.5, 2.0, 3.0, 4.0, 10.0]
    states = [StateEntry.read(e) for e in (entry(7, print_=same), entry(7, print_=same), entry(6, epoch=6, print_=other))]
    verdict = group_verdict(states, [NODE, NODE, NODE])
    assert verdict.diverged == {2}
    assert agreed_epoch(states, [NODE, NODE, NODE], LAYOUT, verdict) == 7
    # an auxiliary's stale replica is never judged
    states = [StateEntry.read(e) for e in (entry(7, print_=same), entry(7, print_=same), entry(None, print_=other))]
    assert group_verdict(states, [NODE, NODE, AUX]).agreed


def test_the_layout_names_the_shapes():
    assert layout_digest([torch.zeros(2, 3)]) == layout_digest([torch.ones(2, 3)])
    assert layout_digest([torch.zeros(2, 3)]) != layout_digest([torch.zeros(3, 2)])


def test_a_member_takes_the_average_only_from_a_complete_round_of_its_loaded_step():
    params = [torch.nn.Parameter(torch.full((4,), 1.0)), torch.nn.Parameter(torch.full((2, 2), 2.0))]
    state = StateRound(params, due=lambda: 3, epoch=lambda: 3)
    assert state.entry()[:3] == [3, state.layout, 3] and StateEntry.read(state.entry()).fingerprint is not None

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
    ever. The replicas differ by noise far below the replica check's tolerance (rounding, in a
    real swarm), so the round is visible. Round 2: one member is not due: no parameter round
    anywhere. Round 3: the third member's replica is a real step apart: the group finds it, its
    gradients go in with weight 0, and the two others still average their parameters."""
    import hivemind
    from hivemind.optim.grad_averager import GradientAverager

    from hivekeeper.hivemind_ext.allreduce import planned

    size, epoch = 3000, 5
    due = [epoch, epoch, epoch]
    replica = torch.randn(size, generator=torch.Generator().manual_seed(1))
    dhts, averagers, params, states, others = [], [], [], [], own_p2pd()
    try:
        for k in range(3):
            initial = [str(m) for m in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
            noise = 1e-4 * torch.randn(size, generator=torch.Generator().manual_seed(10 + k))
            params.append(torch.nn.Parameter(replica * (1 + noise)))
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
        assert not torch.allclose(before[0], mean, atol=1e-6)  # the round is visible
        assert torch.allclose(params[0].detach(), mean, atol=1e-7)
        assert torch.allclose(params[1].detach(), mean, atol=1e-7)
        assert torch.equal(params[2].detach(), before[2])
        for averager in averagers:
            with averager.use_averaged_gradients() as (averaged,):
                assert torch.allclose(averaged, sum(grads) / 3, atol=1e-5)
        assert [state.rounds for state in states] == [1, 1, 1]

        assert all(averager.last_round.diverged == frozenset() for averager in averagers)

        due[1] = None
        time.sleep(0.5)
        assert round_trip([epoch, epoch, epoch]) == [None, None, None]
        assert [state.rounds for state in states] == [1, 1, 1]

        due[1] = epoch
        with torch.no_grad():
            params[2].add_(0.05)  # a step apart
        before = [p.detach().clone() for p in params]
        time.sleep(0.5)
        taken = round_trip([epoch, epoch, epoch])
        assert taken[:2] == ["averaged", "averaged"]
        assert torch.allclose(params[0].detach(), (before[0] + before[1]) / 2, atol=1e-7)
        for averager in averagers:
            with averager.use_averaged_gradients() as (averaged,):
                assert torch.allclose(averaged, (grads[0] + grads[1]) / 2, atol=1e-5)
        found = [averager.last_round.diverged for averager in averagers]
        assert all(len(f) == 1 for f in found) and len(set(found)) == 1  # one member, named alike everywhere
    finally:
        shut_down(averagers, dhts, others)


def test_a_parameter_round_never_outlives_the_steps_all_reduce_timeout():
    from hivekeeper.hivemind_ext.allreduce import parameter_round_budget

    assert parameter_round_budget(20.0, elapsed=0.5, gradient_seconds=0.1) == 2.0  # the floor
    assert parameter_round_budget(20.0, elapsed=2.0, gradient_seconds=1.5) == 4.5  # a few gradient rounds
    assert parameter_round_budget(20.0, elapsed=16.0, gradient_seconds=5.0) == 3.0  # what the timeout leaves
    assert parameter_round_budget(20.0, elapsed=19.5, gradient_seconds=5.0) < 0  # none: skipped as failed
    assert parameter_round_budget(None, elapsed=100.0, gradient_seconds=5.0) == 15.0
