"""Where a collaborative step's time goes: the peers' step clock, the plan's prediction with the
fixed costs they measure, efficiency in the run's summary, and the progress view's warning."""

from __future__ import annotations

import json
import math
from dataclasses import astuple, replace
from unittest.mock import ANY

import pytest

from hivekeeper.local.progress import LOW_EFFICIENCY_SECONDS, EfficiencyWatch, describe_plan
from hivekeeper.local.runner import step_rates
from hivekeeper.planning.averaging_lp import AveragingProblem, PeerCapacity, plan_averaging
from hivekeeper.planning.step_time import (FixedCosts, fixed_costs, plan_whole_steps, predict_step,
                                           whole_steps_per_second)
from hivekeeper.planning.step_clock import StepClock, StepPhases


def test_the_clock_splits_a_step_into_its_phases():
    clock = StepClock(now=100.0)
    assert clock.triggered(100.4) == pytest.approx(0.4)  # accumulated 0.4 s
    phases = clock.ended(101.0, allreduce=(100.7, 100.9))
    assert astuple(phases) == pytest.approx((0.4, 0.3, 0.2, 0.1, 1.0))  # accumulate, wait, allreduce, after, step
    # a step without an all-reduce of its own (alone, or failed): its whole round is waiting
    clock.triggered(101.5)
    assert astuple(clock.ended(102.0, allreduce=None)) == pytest.approx((0.5, 0.5, 0.0, 0.0, 1.0))
    # an all-reduce from outside the step (a stale report) is not counted as this one's
    clock.triggered(102.5)
    assert clock.ended(103.0, allreduce=(99.0, 99.5)).allreduce == 0.0
    assert clock.median.step == pytest.approx(1.0)


def test_the_clock_ignores_an_end_without_a_trigger_and_restarts_after_a_state_load():
    clock = StepClock(now=0.0)
    assert clock.ended(1.0, None) is None and clock.median is None
    clock.restart(5.0)  # a state load: the time before it was not accumulation
    clock.triggered(5.5)
    assert clock.ended(6.0, None).accumulate == pytest.approx(0.5)


def test_the_median_keeps_the_recent_window():
    clock = StepClock(now=0.0, window=3)
    t = 0.0
    for accumulate in (9.0, 1.0, 2.0, 3.0):  # the first falls out of the window
        clock.triggered(t + accumulate)
        t += accumulate + 1.0
        clock.ended(t, None)
    assert clock.median.accumulate == 2.0


@pytest.mark.parametrize("report", [None, "x", {"accumulate": 1}, {**dict.fromkeys(
    ("accumulate", "wait", "allreduce", "after", "step"), 0.1), "wait": -1},
    dict.fromkeys(("accumulate", "wait", "allreduce", "after", "step"), True)])
def test_a_garbled_phase_report_is_ignored(report):
    assert StepPhases.from_json(report) is None


def test_fixed_costs_are_what_the_peers_measure_beyond_the_models_compute_and_transfer():
    phases = [StepPhases(accumulate=0.15, wait=0.3, allreduce=0.06, after=0.05, step=0.56),
              StepPhases(accumulate=0.10, wait=0.2, allreduce=0.04, after=0.04, step=0.38),
              StepPhases(accumulate=0.20, wait=0.4, allreduce=0.01, after=0.06, step=0.67)]
    fixed = fixed_costs(phases, compute=0.05, transfer=0.02)
    assert astuple(fixed) == pytest.approx((0.10, 0.3, 0.02, 0.05))  # lag, wait, round trips, after
    assert fixed_costs([], 0.05, 0.02) is None
    # never negative: an all-reduce faster than the model predicts costs no round trips
    assert fixed_costs(phases, compute=1.0, transfer=1.0).round_trips == 0.0


def test_a_step_is_compute_plus_transfer_plus_fixed_or_overlapped_with_delayed_updates():
    fixed = FixedCosts(lag=0.1, wait=0.2, round_trips=0.05, after=0.05)
    serial = predict_step(compute_bound=2.0, aggregation_bound=4.0, fixed=fixed, overlap=False)
    assert serial.seconds == pytest.approx(0.5 + 0.25 + 0.4)
    assert serial.steps_per_second == pytest.approx(1 / 1.15)
    assert serial.largest_cost() == ("compute", 0.5)
    overlapped = predict_step(compute_bound=2.0, aggregation_bound=4.0, fixed=fixed, overlap=True)
    assert overlapped.seconds == pytest.approx(max(0.5 + 0.1, 0.25 + 0.2 + 0.05) + 0.05)
    # a lone trainer exchanges nothing: the LP's aggregation bound is infinite
    alone = predict_step(compute_bound=2.0, aggregation_bound=math.inf, fixed=FixedCosts(), overlap=False)
    assert alone.transfer == 0.0 and alone.seconds == pytest.approx(0.5)
    assert json.loads(json.dumps(serial.to_json()))["fixed"] == {"lag": 0.1, "wait": 0.2, "roundTrips": 0.05,
                                                                 "after": 0.05}


def test_fixed_costs_read_from_json_refuse_nonsense():
    assert FixedCosts.from_json({"wait": 0.5}).wait == 0.5
    assert FixedCosts.from_json(None) == FixedCosts()
    with pytest.raises(ValueError, match="seconds >= 0"):
        FixedCosts.from_json({"lag": -1})


def test_a_runs_efficiency_is_its_steps_against_the_plans_median_prediction():
    plan = lambda rate: {"stepsPerSecond": rate}  # noqa: E731
    history = [{"elapsedSeconds": 0.0, "globalStep": 0},
               {"elapsedSeconds": 10.0, "globalStep": 1, "plan": plan(2.0)},
               {"elapsedSeconds": 20.0, "globalStep": 11, "plan": plan(1.0)},
               {"elapsedSeconds": 30.0, "globalStep": 21, "plan": plan(1.0)},
               {"elapsedSeconds": 40.0, "globalStep": 21, "plan": plan(9.0)}]  # after the last step: not counted
    achieved, predicted = step_rates(history)
    assert achieved == pytest.approx(1.0) and predicted == 1.0
    assert step_rates(history[:2]) == (None, None)


def test_the_progress_view_warns_after_a_minute_below_half_naming_the_largest_cost():
    step = {"compute": 0.02, "transfer": 0.03, "fixed": {"lag": 0.06, "wait": 0.3, "roundTrips": 0.04, "after": 0.05},
            "overlap": False, "seconds": 0.5}
    status = {"efficiency": 0.4, "plan": {"stepsPerSecond": 2.0, "step": step}}
    watch = EfficiencyWatch()
    assert watch.warning(status, now=0.0) is None
    assert watch.warning(status, now=LOW_EFFICIENCY_SECONDS - 1) is None
    warning = watch.warning(status, now=LOW_EFFICIENCY_SECONDS)
    assert warning and "efficiency 0.40" in warning and "wait (0.300 s of 0.500 s)" in warning
    assert watch.warning({**status, "efficiency": 0.9}, now=100.0) is None  # recovered: the minute starts over
    assert watch.warning(status, now=101.0) is None


def test_the_plan_line_shows_efficiency_and_where_a_step_goes():
    step = {"compute": 0.02, "transfer": 0.03, "fixed": {"lag": 0.06, "wait": 0.3, "roundTrips": 0.04, "after": 0.05},
            "overlap": False, "seconds": 0.5}
    plan = {"stepsPerSecond": 2.0, "computeBound": 50.0, "aggregationBound": 33.0, "step": step,
            "peers": [{"name": "trainer-0", "share": 1.0, "computesGradients": True}]}
    line = describe_plan(plan, achieved=1.5)
    assert "2.000 steps/s predicted, achieved 1.500 (efficiency 0.75)" in line
    assert "compute 0.020 + transfer 0.030 + fixed 0.450 (lag 0.060, wait 0.300" in line
    assert "fixed costs not measured yet" in describe_plan({**plan, "step": None}, achieved=None)


def test_roles_for_whole_steps_keep_every_peer_computing_when_that_makes_more_steps():
    """The LP maximizes min(compute rate, aggregation rate) and here ties (0.3125 steps/s) with
    p1 only aggregating; a step does compute, then averaging, then the fixed costs, and with
    every peer computing it is shorter. Without measured fixed costs the LP's plan stands."""
    peers = [PeerCapacity("p0", 40, 1, 1), PeerCapacity("p1", 40, 20, 20), PeerCapacity("p2", 40, 10, 10)]
    problem = AveragingProblem(target_batch_size=256, num_parameters=100_000, peers=peers)
    lp = plan_averaging(problem)
    assert not {r.name: r.computes_gradients for r in lp.peers}["p1"]
    fixed = FixedCosts(wait=0.3)
    chosen = plan_whole_steps(problem, fixed, overlap=False)
    assert all(r.computes_gradients for r in chosen.peers)
    assert whole_steps_per_second(chosen, fixed, False) > 1.1 * whole_steps_per_second(lp, fixed, False)
    assert plan_whole_steps(problem, None, overlap=False) == replace(lp, solve_seconds=ANY)
