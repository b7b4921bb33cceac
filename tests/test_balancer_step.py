"""One pass of the balancer (`Balancer.step`) against a stand-in DHT and metrics source: when
it publishes a new plan, when it only renews the one peers follow, and what it does when its
inputs cannot be read. The published record is checked as peers check it (`verify_plan`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import hivemind.utils
import pytest

from hivekeeper.local.identity import ensure_identity
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.planning.averaging_lp import plan_averaging, throughput_of
from hivekeeper.planning.step_time import FixedCosts, everyone_computes, whole_steps_per_second
from hivekeeper.runtime.context import RoleContext
from hivekeeper.runtime.reports import PEERS_KEY
from hivekeeper.spec import load_manifest
from hivekeeper.swarm.balancer import SETTLE_SECONDS, Balancer
from hivekeeper.swarm.metrics_source import MetricsSourceError, PeerMeasurement
from hivekeeper.swarm.plan_record import SignedPlan, plan_key, verify_plan

from conftest import write_manifest

MB = 1e6 / 8  # bytes/s in one Mbit/s
TTL = 60.0
FAST, SLOW = 1.0, 0.2  # Mbit/s: for the task's small model, averaging (not compute) bounds the steps


class FakeDHT:
    """What the balancer uses of a DHT: peer reports under the swarm's peers key, and the plan
    record it stores (with its expiry)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.reports: dict[str, dict] = {}
        self.stored: dict[str, tuple[Any, float]] = {}

    def get(self, key: str, latest: bool = False):
        if key == self.run_id + PEERS_KEY:
            return SimpleNamespace(value={k: SimpleNamespace(value=r) for k, r in self.reports.items()})
        if key in self.stored:
            return SimpleNamespace(value=self.stored[key][0])
        return None

    def store(self, key: str, value: Any, expiration_time: float, return_future: bool = False) -> None:
        self.stored[key] = (value, expiration_time)


@dataclass
class FakeSource:
    peers: dict[str, PeerMeasurement] = field(default_factory=dict)
    error: Optional[str] = None

    def measure(self) -> list[PeerMeasurement]:
        if self.error:
            raise MetricsSourceError(self.error)
        return list(self.peers.values())


@dataclass
class Swarm:
    balancer: Balancer
    dht: FakeDHT
    source: Any  # a MetricsSource; FakeSource where the test sets measurements
    signer: str
    clock: list[float]

    def join(self, name: str, samples: float, mbps: float) -> None:
        peer_id = f"id-{name}"
        self.dht.reports[peer_id] = {"peerId": peer_id, "role": "trainer", "name": name}
        self.source.peers[name] = PeerMeasurement(
            peer_id=peer_id, name=name, role="trainer", client_mode=False, samples_per_second=samples,
            upload_bytes_per_second=mbps * MB, download_bytes_per_second=mbps * MB)

    def change(self, name: str, **fields: float) -> None:
        self.source.peers[name] = replace(self.source.peers[name], **fields)

    def passes(self, seconds_later: float) -> None:
        """The balancer's passes until `seconds_later` than the last: one then, and one
        SETTLE_SECONDS before it if there is room (it reads its inputs every second while peers
        arrive; two passes are what its rules tell apart)."""
        if seconds_later > SETTLE_SECONDS:
            self.clock[0] += seconds_later - SETTLE_SECONDS
            self.balancer.step(self.dht, self.source)
            seconds_later = SETTLE_SECONDS
        self.clock[0] += seconds_later
        self.balancer.step(self.dht, self.source)

    def step(self, seconds_later: float = 10.0) -> SignedPlan:
        """The balancer's passes until `seconds_later` than the last; the plan as a peer reads it then."""
        self.passes(seconds_later)
        return self.published()

    def published(self) -> SignedPlan:
        record, expires = self.dht.stored[plan_key(self.dht.run_id)]
        plan = verify_plan(record, signer=self.signer, swarm=self.dht.run_id, now=self.clock[0])
        assert expires == plan.expires  # the DHT drops the record when the plan runs out
        return plan

    def counter(self, name: str) -> float:
        return self.balancer.ctx.metrics.registry.get_sample_value(name) or 0.0


def make_swarm(directory: Path, monkeypatch: pytest.MonkeyPatch, source: Any = None) -> Swarm:
    """A balancer of the digits swarm, on a stand-in DHT and a clock the test moves."""
    clock = [1000.0]
    monkeypatch.setattr(hivemind.utils, "get_dht_time", lambda: clock[0])
    identity = directory / "balancer.key"
    signer = ensure_identity(identity)
    manifest = load_manifest(write_manifest(directory, {"spec": {
        "targetBatchSize": 256, "balancer": {"planTtlSeconds": TTL, "drift": 0.25}}}))
    ctx = RoleContext(role="balancer", args=argparse.Namespace(identity=str(identity), index=0), manifest=manifest,
                      metrics=SwarmMetrics())
    return Swarm(Balancer(ctx), FakeDHT(ctx.run_id), source or FakeSource(), signer, clock)


@pytest.fixture
def swarm(tmp_path, monkeypatch) -> Swarm:
    return make_swarm(tmp_path, monkeypatch)


def test_the_first_plan_is_signed_published_and_exported(swarm):
    swarm.join("trainer-0", 50.0, FAST)
    swarm.join("trainer-1", 50.0, FAST)
    plan = swarm.step()
    assert {p.name for p in plan.peers} == {"trainer-0", "trainer-1"}
    assert plan.expires == swarm.clock[0] + TTL and sum(plan.shares().values()) == pytest.approx(1.0)
    assert swarm.counter("hivekeeper_plans_total") == 1
    assert swarm.counter("hivekeeper_plan_steps_per_second") == pytest.approx(plan.steps_per_second)
    assert swarm.balancer.ctx.status["plan"]["digest"] == plan.digest


def test_a_renewal_keeps_the_shares_with_a_fresh_expiry(swarm):
    swarm.join("trainer-0", 50.0, FAST)
    swarm.join("trainer-1", 50.0, SLOW)
    first = swarm.step()
    swarm.change("trainer-0", samples_per_second=55.0)  # noise, under the drift threshold
    renewed = swarm.step(seconds_later=30.0)
    assert (renewed.digest, renewed.shares()) == (first.digest, first.shares())
    assert renewed.expires == first.expires + 30.0
    assert swarm.counter("hivekeeper_plans_total") == 1


def test_a_peer_joining_or_leaving_gets_a_new_plan(swarm):
    swarm.join("trainer-0", 50.0, FAST)
    swarm.join("trainer-1", 50.0, FAST)
    first = swarm.step()
    swarm.join("trainer-2", 50.0, FAST)
    second = swarm.step()
    assert second.digest != first.digest and "id-trainer-2" in second.shares()
    del swarm.dht.reports["id-trainer-1"]  # its DHT record expired; its metrics may linger
    third = swarm.step()
    assert set(third.shares()) == {"id-trainer-0", "id-trainer-2"}
    assert swarm.counter("hivekeeper_plans_total") == 3


def test_a_plan_waits_for_peers_to_arrive_and_measure_and_switches_once(swarm):
    """Peers of a starting swarm arrive over seconds, and a trainer that has reported has not
    measured its speed yet: the plan waits until the averaging peers alive have held still for
    SETTLE_SECONDS and measured (for replanSeconds, 10 s, at most), since a plan without them,
    then one with them, would be two switches, and peers split their groups at each."""
    swarm.join("trainer-0", 50.0, FAST)
    swarm.join("trainer-1", 0.0, FAST)  # in the DHT, no samples/s yet
    swarm.passes(5.0)
    assert plan_key(swarm.dht.run_id) not in swarm.dht.stored
    assert "trainer-1" in swarm.balancer.ctx.status["waitingFor"] and swarm.balancer.waiting
    swarm.change("trainer-1", samples_per_second=50.0)
    first = swarm.step(seconds_later=1.0)
    assert {p.name for p in first.peers} == {"trainer-0", "trainer-1"} and not swarm.balancer.waiting
    # a peer leaves as another arrives: the plan holds while they settle and the newcomer measures...
    del swarm.dht.reports["id-trainer-1"]
    swarm.join("trainer-2", 0.0, FAST)
    assert swarm.step(seconds_later=1.0).digest == first.digest
    assert swarm.step(seconds_later=3.0).digest == first.digest
    # ...for replanSeconds at most: one that never measures holds nothing back longer
    later = swarm.step(seconds_later=10.0)
    assert {p.name for p in later.peers} == {"trainer-0"}
    assert swarm.counter("hivekeeper_plans_total") == 2


def test_peers_that_keep_coming_and_going_hold_the_plan_back_for_replan_seconds_at_most(swarm):
    swarm.join("trainer-0", 50.0, FAST)
    swarm.join("trainer-1", 50.0, FAST)
    swarm.passes(1.0)
    for second in range(2, 12):  # trainer-2 in a crash loop: there one second, gone the next
        if second % 2:
            del swarm.dht.reports["id-trainer-2"]
        else:
            swarm.join("trainer-2", 50.0, FAST)
        swarm.passes(1.0)
        if plan_key(swarm.dht.run_id) in swarm.dht.stored:
            break
    assert plan_key(swarm.dht.run_id) in swarm.dht.stored


def test_drifted_inputs_replace_the_plan_only_when_a_new_one_is_clearly_better(swarm):
    # alone, either trainer makes 80/256 steps/s; together they make more, as fast as they average
    swarm.join("trainer-0", 80.0, FAST)
    swarm.join("trainer-1", 80.0, FAST)
    first = swarm.step()
    assert all(p.computes_gradients for p in first.peers)
    # a trainer's speed drifts by more than 25 %, but averaging still bounds the steps: the plan
    # peers follow is as good as a new one would be, so it is only renewed
    swarm.change("trainer-0", samples_per_second=55.0)
    kept = swarm.step()
    assert kept.digest == first.digest and swarm.counter("hivekeeper_plans_total") == 1
    # trainer-0's link slows to a fifth: the faster trainer alone now beats the pair by far
    swarm.change("trainer-0", upload_bytes_per_second=SLOW * MB, download_bytes_per_second=SLOW * MB)
    replaced = swarm.step()
    assert replaced.digest != first.digest and swarm.counter("hivekeeper_plans_total") == 2
    assert not replaced.assignment("id-trainer-0").computes_gradients
    old_now = throughput_of(swarm.balancer.inputs.problem, {p.peer_id: p.computes_gradients for p in first.peers},
                            first.shares())
    assert replaced.steps_per_second > 1.25 * old_now.steps_per_second


def test_unreadable_inputs_leave_the_plan_to_expire(swarm):
    swarm.join("trainer-0", 50.0, FAST)
    swarm.join("trainer-1", 50.0, SLOW)
    first = swarm.step()
    swarm.source.error = "prometheus: connection refused"
    swarm.clock[0] += 10.0
    swarm.balancer.step(swarm.dht, swarm.source)
    swarm.balancer.step(swarm.dht, swarm.source)
    assert swarm.published() == first  # not renewed: peers drop it at its expiry
    assert swarm.counter("hivekeeper_plan_input_errors_total") == 2
    assert swarm.balancer.ctx.status["inputsError"] == "prometheus: connection refused"
    swarm.source.error = None
    assert swarm.step().expires == swarm.clock[0] + TTL  # readable again: renewed


def phases(accumulate: float, wait: float, allreduce: float, after: float) -> dict:
    return {"accumulate": accumulate, "wait": wait, "allreduce": allreduce, "after": after,
            "step": accumulate + wait + allreduce + after}


def test_measured_fixed_costs_make_the_plan_predict_whole_steps(swarm):
    """Once the trainers report their step phases, the plan predicts whole steps (compute and
    transfer from the LP, the rest measured) and its roles are the better of the LP's and
    everyone computing, in whole steps."""
    swarm.join("trainer-0", 40.0, SLOW)
    swarm.join("trainer-1", 40.0, FAST)
    swarm.join("trainer-2", 40.0, 5 * FAST)
    lp_only = swarm.step()
    assert lp_only.step is None  # nothing measured yet: the LP's figures
    for peer_id in swarm.dht.reports:
        swarm.dht.reports[peer_id]["stepPhases"] = phases(accumulate=9.0, wait=0.4, allreduce=30.0, after=0.05)
    whole = swarm.step()
    step = whole.step
    assert step["fixed"]["wait"] == pytest.approx(0.4) and step["fixed"]["after"] == pytest.approx(0.05)
    assert step["seconds"] == pytest.approx(step["compute"] + step["transfer"] + sum(step["fixed"].values()),
                                            abs=1e-3)
    assert whole.steps_per_second == pytest.approx(1 / step["seconds"], rel=1e-3)
    problem, fixed = swarm.balancer.inputs.problem, FixedCosts.from_json(step["fixed"])
    chosen = throughput_of(problem, {p.peer_id: p.computes_gradients for p in whole.peers}, whole.shares())
    for candidate in (plan_averaging(problem), everyone_computes(problem)):
        assert whole_steps_per_second(chosen, fixed, False) >= whole_steps_per_second(candidate, fixed, False) / 1.25
    registry = swarm.balancer.ctx.metrics.registry
    assert registry.get_sample_value("hivekeeper_plan_step_seconds", {"part": "wait"}) == pytest.approx(0.4)
    # a garbled report is ignored, not fatal
    swarm.dht.reports["id-trainer-0"]["stepPhases"] = {"wait": "soon"}
    assert swarm.step().step is not None
