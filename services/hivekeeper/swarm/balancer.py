"""Balancer role: DeDLOC's adaptive averaging in a running Swarm.

Every `replanSeconds` it reads who is alive from the DHT and what each averaging peer
measures (samples/s, upload and download rates) from Prometheus or, without one, from the
peers' /metrics directly (every second instead while peers arrive, leave or measure their
rates: a new plan waits until the averaging peers alive have held still for SETTLE_SECONDS and
have measured, or for replanSeconds at most, since a peer outside the plan averages apart from
it and each switch of plan splits a round's groups); caps the rates by the manifest's declared limits; and re-solves the
averaging plan (`plan_averaging`) when peers joined or left or an input drifted by more than
`drift`. The plan is signed with the balancer's key and republished with a fresh expiry on
every pass, so peers drop it within `planTtlSeconds` if the balancer goes away. Its figures
(predicted steps/s, compute and aggregation bounds, each peer's role and share) are metrics
and /status.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from hivekeeper.planning.averaging_lp import (
    AveragingPlan,
    AveragingProblem,
    PeerCapacity,
    Throughput,
    throughput_of,
)
from hivekeeper.planning.group_size import optimal_group_size
from hivekeeper.planning.step_time import (FixedCosts, StepTime, fixed_costs, plan_whole_steps, predict_step,
                                           whole_steps_per_second)
from hivekeeper.runtime.reports import read_peer_reports
from hivekeeper.spec.swarm import SwarmSpec
from hivekeeper.swarm.role import SwarmContext, load_swarm_context
from hivekeeper.swarm.metrics_source import (
    MetricsSource,
    MetricsSourceError,
    PeerMeasurement,
    PrometheusSource,
    ScrapeSource,
    from_report,
)
from hivekeeper.hivemind_ext.allreduce import plan_digest
from hivekeeper.swarm.optimizer import WIRE_BYTES_PER_ELEMENT
from hivekeeper.swarm.plan_record import PeerAssignment, SignedPlan, load_signing_key, publish_plan
from hivekeeper.planning.step_clock import StepPhases

log = logging.getLogger("hivekeeper.balancer")
AVERAGING_ROLES = ("trainer", "auxiliary")
WAITING_RECHECK_SECONDS = 1.0  # how often inputs are read while peers arrive or measure
NO_PLAN_LOG_SECONDS = 30.0  # how often the balancer logs what its first plan still waits for
# A new plan waits until the averaging peers alive have been the same for this long: peers of a
# swarm that is starting arrive over seconds, and each switch of plan splits the groups of a round
SETTLE_SECONDS = 3.0
_BITS = 8 / 1e6  # Mbps in one byte per second


@dataclass(frozen=True)
class PlanInputs:
    problem: AveragingProblem  # peers named by peer ID
    names: dict[str, str]  # peer ID -> role name, for people
    waiting: tuple[str, ...]  # averaging peers left out: speed or bandwidth not measured (or declared) yet


def plan_inputs(spec: SwarmSpec, measurements: Sequence[PeerMeasurement], num_parameters: int,
                alive: Optional[set[str]] = None) -> Optional[PlanInputs]:
    """The LP's inputs from what peers measure, capped by the manifest's limits; None while
    no plan is possible (no computing peer, or none that accepts connections). A peer measured
    twice counts once: a restarted role's new report and its predecessor's, which lives on until
    it expires, name the same metrics address, so its one process is scraped twice."""
    peers, names, waiting = [], {}, []
    for m in measurements:
        if m.role not in AVERAGING_ROLES or (alive is not None and m.peer_id not in alive) or m.peer_id in names:
            continue
        limits = spec.trainers.bandwidth if m.role == "trainer" else spec.auxiliary.bandwidth
        upload = _capped(m.upload_bytes_per_second, limits.upload_mbps)
        download = _capped(m.download_bytes_per_second, limits.download_mbps)
        samples = m.samples_per_second if m.role == "trainer" else 0.0
        # a trainer that has not measured its speed yet is not a peer without compute: planning
        # it as one would make it a pure aggregator, and it would never measure a speed
        if upload is None or download is None or (m.role == "trainer" and samples <= 0):
            waiting.append(m.name)
            continue
        peers.append(PeerCapacity(name=m.peer_id, samples_per_second=samples, upload_mbps=upload,
                                  download_mbps=download, client_mode=m.client_mode))
        names[m.peer_id] = m.name
    if not any(p.samples_per_second > 0 for p in peers) or all(p.client_mode for p in peers):
        return None
    problem = AveragingProblem(target_batch_size=spec.target_batch_size, num_parameters=num_parameters,
                               peers=tuple(peers),
                               bytes_per_parameter=WIRE_BYTES_PER_ELEMENT[spec.averaging.compression])
    return PlanInputs(problem=problem, names=names, waiting=tuple(waiting))


def with_reported(measured: Sequence[PeerMeasurement], reports: Sequence[dict]) -> list[PeerMeasurement]:
    """`measured`, plus what the peers it lacks say of themselves in their DHT reports."""
    seen = {m.peer_id for m in measured}
    reported = [m for m in map(from_report, reports) if m is not None and m.peer_id not in seen]
    return [*measured, *sorted(reported, key=lambda m: m.peer_id)]


def _capped(measured_bytes: Optional[float], cap_mbps: Optional[float]) -> Optional[float]:
    measured = measured_bytes * _BITS if measured_bytes else None
    if measured is None:
        return cap_mbps
    return min(measured, cap_mbps) if cap_mbps else measured


def drifted(old: AveragingProblem, new: AveragingProblem, threshold: float) -> Optional[str]:
    """Why `new` may need another plan than `old`'s, or None. Membership changes always do
    ("peers ..."); drifted inputs ("inputs ...") only if a new plan is clearly better."""
    before = {p.name: p for p in old.peers}
    after = {p.name: p for p in new.peers}
    if before.keys() != after.keys():
        return f"peers {len(before)} -> {len(after)}"
    for name, peer in after.items():
        prev = before[name]
        if peer.client_mode != prev.client_mode:
            return f"peers: client mode of {name[-8:]} changed"
        for field in ("samples_per_second", "upload_mbps", "download_mbps"):
            a, b = getattr(prev, field), getattr(peer, field)
            if abs(b - a) > threshold * max(a, b, 1e-9):
                return f"inputs: {field} of {name[-8:]} {a:.3g} -> {b:.3g}"
    return None


def predicted_step(throughput: Throughput, fixed: Optional[FixedCosts], overlap: bool) -> Optional[StepTime]:
    """The plan's step with the fixed costs its computing peers measured; None before any has."""
    if fixed is None:
        return None
    return predict_step(throughput.compute_bound, throughput.aggregation_bound, fixed, overlap)


def with_step(plan: SignedPlan, step: Optional[StepTime]) -> SignedPlan:
    """`plan` predicting `step` (its steps/s the full model's), or the LP's figures alone."""
    if step is None:
        return replace(plan, step=None)
    return replace(plan, step=step.to_json(), steps_per_second=_finite(step.steps_per_second))


def signed_plan(swarm: str, inputs: PlanInputs, plan: AveragingPlan, issued: float, ttl: float,
                failure_probability: float = 0.0) -> SignedPlan:
    peers = tuple(sorted((PeerAssignment(peer_id=role.name, name=inputs.names[role.name],
                                         computes_gradients=role.computes_gradients, share=role.aggregation_share)
                          for role in plan.peers), key=lambda peer: peer.name))  # by name, for people
    return SignedPlan(
        swarm=swarm, digest=plan_digest({p.peer_id: p.share for p in peers}), issued=issued, expires=issued + ttl,
        steps_per_second=_finite(plan.steps_per_second), compute_bound=_finite(plan.compute_bound),
        aggregation_bound=_finite(plan.aggregation_bound),
        averaging_seconds=_finite(plan.averaging_seconds),
        group_size=optimal_group_size(len(peers), failure_probability), peers=peers)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0  # JSON has no infinity; 0 reads "unbounded" in a plan


def run(args: argparse.Namespace) -> int:
    ctx = load_swarm_context("balancer", args)
    return Balancer(ctx).run()


class Balancer:
    def __init__(self, ctx: SwarmContext):
        from hivekeeper.tasks import load_task

        self.ctx = ctx
        spec = ctx.spec
        if not ctx.args.identity:
            raise SystemExit("the balancer needs --identity: its key signs the plan")
        self.key = load_signing_key(ctx.args.identity)
        task = load_task(spec.task.name, spec.task.options, seed=spec.task.seed)
        self.num_parameters = sum(p.numel() for p in task.build_model().parameters() if p.requires_grad)
        self.inputs: Optional[PlanInputs] = None
        self.plan: Optional[SignedPlan] = None
        self.solve_seconds = 0.0
        self.plans_made = 0
        self.step_time: Optional[StepTime] = None
        self.waiting = True  # an averaging peer is alive that the plan does not name (or no plan yet)
        self.waiting_since: dict[str, float] = {}  # peer name: when it was first seen waiting
        self.alive_seen: set[str] = set()  # the averaging peers alive at the last pass...
        self.alive_changed_at = -math.inf  # ...and since when (DHT time)
        self.unsettled_since = -math.inf  # when the latest run of changes began
        self.no_plan_logged_at: Optional[float] = None  # the first wait starts the clock

    def source(self, dht) -> MetricsSource:
        url = self.ctx.spec.balancer.prometheus_url
        if url:
            return PrometheusSource(url, self.ctx.run_id)
        return ScrapeSource(self.ctx.run_id, lambda: [r["metrics"] for r in read_peer_reports(dht, self.ctx.run_id)
                                                      if r.get("role") in AVERAGING_ROLES and r.get("metrics")])

    def run(self) -> int:
        ctx = self.ctx
        ctx.start_endpoint()
        dht = ctx.make_dht()
        source = self.source(dht)
        ctx.endpoint.ready.set()
        log.info("balancer up", extra={"fields": {"peer_id": str(dht.peer_id), "parameters": self.num_parameters,
                                                  "source": type(source).__name__}})
        try:
            while not ctx.stop.is_set():
                if ctx.stop_requested(dht) is not None:
                    break
                self.step(dht, source)
                ctx.publish_report(dht, {"plan": self.plan.digest if self.plan else None})
                replan = ctx.spec.balancer.replan_seconds
                ctx.stop.wait(min(replan, WAITING_RECHECK_SECONDS) if self.waiting else replan)
        finally:
            dht.shutdown()
        return 0

    def step(self, dht, source: MetricsSource) -> None:
        from hivemind.utils import get_dht_time

        settings = self.ctx.spec.balancer
        reports = [r for r in read_peer_reports(dht, self.ctx.run_id) if r.get("role") in AVERAGING_ROLES]
        alive = {r.get("peerId") for r in reports}
        now = get_dht_time()
        if alive != self.alive_seen:
            if now - self.alive_changed_at >= SETTLE_SECONDS:
                self.unsettled_since = now  # the first change after a quiet spell
            self.alive_seen, self.alive_changed_at = alive, now
        # peers that keep coming and going (a role in a crash loop) hold nothing back for long
        unsettled = (now - self.alive_changed_at < SETTLE_SECONDS
                     and now - self.unsettled_since < settings.replan_seconds)
        try:
            measurements = source.measure()
        except MetricsSourceError as e:
            log.warning("planner inputs unavailable", extra={"fields": {"error": str(e)}})
            self.ctx.metrics.plan_input_errors.inc()
            self.ctx.status.update(inputsError=str(e))
            return  # the current plan runs out at its expiry; peers fall back to hivemind's split
        measurements = with_reported(measurements, reports)
        inputs = plan_inputs(self.ctx.spec, measurements, self.num_parameters, alive)
        self.waiting = inputs is None or bool(inputs.waiting) or unsettled
        if inputs is None:
            self.no_plan_yet("a computing peer with measured samples/s and bandwidth", reports, measurements, now)
            return
        held = self.newly_waiting(inputs.waiting, settings.replan_seconds, now)
        if unsettled:
            held.append(f"the averaging peers to hold still for {SETTLE_SECONDS:.0f} s")
        if held and self.plan is None:
            self.no_plan_yet(", ".join(held), reports, measurements, now)
            return
        overlap = self.ctx.spec.averaging.delayed_parameter_updates
        fixed = self.fixed_costs(inputs, reports)
        reason = "first plan" if self.inputs is None else drifted(self.inputs.problem, inputs.problem, settings.drift)
        # Peers that have just arrived measure their rates within seconds, and in a swarm that is
        # starting more arrive: they are planned with the rest then, in one switch of plan.
        solved = plan_whole_steps(inputs.problem, fixed, overlap, settings.drift) \
            if not held and (reason is not None or fixed is not None) else None
        if reason is None and solved is not None:
            # the inputs held, but with the fixed costs measured other roles make more whole steps
            reason = None if self.same_roles(solved) else "fixed costs: other roles make more whole steps"
            solved = solved if reason is not None else None
        elif solved is not None and reason.startswith("inputs") and not self.clearly_better(inputs, solved, fixed):
            solved = None
        if solved is not None:
            self.inputs, self.solve_seconds = inputs, solved.solve_seconds
            self.plan = signed_plan(self.ctx.run_id, inputs, solved, now, settings.plan_ttl_seconds,
                                    self.ctx.spec.averaging.peer_failure_probability)
            self.plans_made += 1
            self.ctx.metrics.plans.inc()
            log.info("new averaging plan", extra={"fields": {
                "reason": reason, "peers": len(inputs.problem.peers), "waiting": list(inputs.waiting),
                "steps_per_second": round(self.plan.steps_per_second, 4),
                "solve_ms": round(solved.solve_seconds * 1e3, 2)}})
        else:  # renew: same shares and digest, so groups that matched under it keep agreeing;
            # its figures are what those shares achieve under the latest inputs
            current = self.current_throughput(inputs)
            self.plan = replace(self.plan, issued=now, expires=now + settings.plan_ttl_seconds,
                                steps_per_second=_finite(current.steps_per_second),
                                compute_bound=_finite(current.compute_bound),
                                aggregation_bound=_finite(current.aggregation_bound),
                                averaging_seconds=_finite(current.averaging_seconds))
        # the fixed costs as measured under the plan peers followed until now (a new plan's
        # peers have not measured theirs yet)
        self.step_time = predicted_step(self.current_throughput(inputs), fixed or self.fixed_costs(inputs, reports),
                                        overlap)
        self.plan = with_step(self.plan, self.step_time)
        publish_plan(dht, self.plan, self.key)
        self.export(inputs)

    def no_plan_yet(self, waiting_for: str, reports: Sequence[dict], measured: Sequence[PeerMeasurement],
                    now: float) -> None:
        """Says in the status what the first plan waits for, and in the log every NO_PLAN_LOG_SECONDS
        while it does: a swarm that averages on hivemind's split for long wants an explanation."""
        self.ctx.status.update(waitingFor=waiting_for)
        if self.no_plan_logged_at is None:
            self.no_plan_logged_at = now
        elif now - self.no_plan_logged_at >= NO_PLAN_LOG_SECONDS:
            self.no_plan_logged_at = now
            log.info("no plan yet", extra={"fields": {
                "waiting_for": waiting_for, "averaging_reports": len(reports), "measured": len(measured),
                "unmeasured": sorted(m.name for m in measured if not m.samples_per_second and m.role == "trainer")}})

    def newly_waiting(self, waiting: Sequence[str], patience: float, now: float) -> list[str]:
        """The averaging peers left out for want of measurements that have been so for less than
        `patience` seconds (one that never measures does not hold the plan back for longer)."""
        self.waiting_since = {name: self.waiting_since.get(name, now) for name in waiting}
        return [name for name, since in self.waiting_since.items() if now - since < patience]

    def computing_phases(self, reports: Sequence[dict]) -> list[StepPhases]:
        """The step phases of the peers that compute under the current plan (every trainer before one)."""
        computing = {p.peer_id for p in self.plan.peers if p.computes_gradients} if self.plan else None
        return [phases for r in reports if r.get("role") == "trainer"
                and (computing is None or r.get("peerId") in computing)
                and (phases := StepPhases.from_json(r.get("stepPhases"))) is not None]

    def fixed_costs(self, inputs: PlanInputs, reports: Sequence[dict]) -> Optional[FixedCosts]:
        """What the computing peers measure beyond the current plan's compute and transfer; None
        before a plan or before any peer has measured steps."""
        if self.plan is None:
            return None
        current = predict_step(*self._bounds(self.current_throughput(inputs)), FixedCosts(), overlap=False)
        return fixed_costs(self.computing_phases(reports), current.compute, current.transfer)

    @staticmethod
    def _bounds(throughput: Throughput) -> tuple[float, float]:
        return throughput.compute_bound, throughput.aggregation_bound

    def same_roles(self, solved: AveragingPlan) -> bool:
        current = {p.peer_id: p.computes_gradients for p in self.plan.peers}
        return {r.name: r.computes_gradients for r in solved.peers} == current

    def current_throughput(self, inputs: PlanInputs) -> Throughput:
        return throughput_of(inputs.problem, {p.peer_id: p.computes_gradients for p in self.plan.peers},
                             self.plan.shares())

    def clearly_better(self, inputs: PlanInputs, solved: AveragingPlan, fixed: Optional[FixedCosts] = None) -> bool:
        """A fresh plan replaces the one peers follow only if it beats it under the new inputs by
        `drift` (steps/s, whole steps once the fixed costs are measured; then aggregation rate):
        every switch costs a round on hivemind's split (groups hold different plans meanwhile,
        and a peer that computes again reloads the state), and measurements are noisy."""
        margin = 1 + self.ctx.spec.balancer.drift
        current = self.current_throughput(inputs)
        overlap = self.ctx.spec.averaging.delayed_parameter_updates
        rate = (lambda t: t.steps_per_second) if fixed is None else (  # noqa: E731
            lambda t: whole_steps_per_second(t, fixed, overlap))
        better = rate(solved) > rate(current) * margin or (
            rate(solved) >= rate(current) and solved.aggregation_bound > current.aggregation_bound * margin)
        if not better:
            self.inputs = inputs  # drift is measured from here on
        return better

    def export(self, inputs: PlanInputs) -> None:
        plan, metrics = self.plan, self.ctx.metrics
        metrics.plan_steps_per_second.set(plan.steps_per_second)
        metrics.plan_compute_bound.set(plan.compute_bound)
        metrics.plan_aggregation_bound.set(plan.aggregation_bound)
        metrics.plan_averaging_seconds.set(plan.averaging_seconds)
        metrics.plan_step_seconds.clear()
        if self.step_time is not None:
            for part, seconds in self.step_time.parts().items():
                metrics.plan_step_seconds.labels(part).set(_finite(seconds))
        metrics.plan_solve_seconds.set(self.solve_seconds)
        metrics.plan_updated.set(time.time())
        metrics.plan_share.clear()
        metrics.plan_computes_gradients.clear()
        for peer in plan.peers:
            metrics.plan_share.labels(peer.name).set(peer.share)
            metrics.plan_computes_gradients.labels(peer.name).set(float(peer.computes_gradients))
        self.ctx.status.clear()
        self.ctx.status.update(plan=plan.to_json(), plansMade=self.plans_made, solveSeconds=self.solve_seconds,
                               waiting=list(inputs.waiting),
                               inputs=[{"name": inputs.names[p.name], "samplesPerSecond": p.samples_per_second,
                                        "uploadMbps": p.upload_mbps, "downloadMbps": p.download_mbps,
                                        "clientMode": p.client_mode} for p in inputs.problem.peers])
