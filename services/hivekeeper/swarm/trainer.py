"""Trainer role: accumulates gradients at its own pace until the collaboration reaches
targetBatchSize, then averages with its peers and steps (hivemind.Optimizer). A peer that
falls behind loads the latest state from one that is up to date."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from hivekeeper.runtime.cpu import cores_given
from hivekeeper.swarm.merging_trainer import train_merging
from hivekeeper.swarm.optimizer import make_collaborative_optimizer
from hivekeeper.swarm.plan_follower import PlanFollower
from hivekeeper.swarm.role import SwarmContext, load_swarm_context
from hivekeeper.tasks import load_task
from hivekeeper.training.loop import RateWindow, ReportCadence, index_stream, peer_seed

log = logging.getLogger("hivekeeper.trainer")
AGGREGATOR_POLL = 0.05  # while the plan has this peer only aggregate

class Trace:
    """What a trainer did, for checking the collaboration against single-process training:
    every batch (examples, loss, whether it was accumulated), every averaging round, and the
    parameters each time they change (a snapshot file beside the trace)."""

    def __init__(self, path: Optional[str]):
        self._path = Path(path) if path else None
        self._file = open(path, "a", buffering=1) if path else None
        self._snapshots = 0
        self._digest: Optional[float] = None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, **record: Any) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")

    def snapshot_if_changed(self, model: torch.nn.Module) -> None:
        """Parameters change at a step, a state load, or when hivemind applies a delayed state
        averaging result (at the start of a later step): compare a digest before every batch."""
        if not self._file:
            return
        with torch.no_grad():
            digest = sum(float(p.double().square().sum()) + float(p.double().sum()) for p in model.parameters())
        if digest == self._digest:
            return
        self._digest = digest
        self._snapshots += 1
        path = self._path.with_name(f"{self._path.stem}-params-{self._snapshots}.pt")
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, path)
        self.write(type="params", file=path.name)

    def close(self) -> None:
        if self._file:
            self._file.close()


def run(args: argparse.Namespace) -> int:
    ctx = load_swarm_context("trainer", args)
    return train(ctx)


def train(ctx: SwarmContext) -> int:
    spec, args = ctx.spec, ctx.args
    batch_size = args.batch_size or spec.trainers.batch_size
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # as many threads as cores it is given (its container's limit, else its CPU request): torch's
    # default of every core, in each of 3 trainers on 2 cores, starved the averagers' processes
    torch.set_num_threads(cores_given(spec.trainers.resources.cpu))
    ctx.start_endpoint()
    task = load_task(spec.task.name, spec.task.options, seed=spec.task.seed)
    model = task.build_model().to(device)
    dht = ctx.make_dht(client_mode=spec.trainers.client_mode)
    if spec.averaging.merges_weights:
        try:
            train_merging(ctx, task, model, dht, batch_size, device, _batches(ctx, task, batch_size))
        finally:
            dht.shutdown()
        return 0
    opt = make_collaborative_optimizer(spec, ctx.run_id, dht, model, ctx.metrics, batch_size=batch_size)
    follower = PlanFollower(dht, ctx.run_id, args.plan_signer, opt.grad_averager, ctx.metrics)
    trace = Trace(args.trace)
    log.info("trainer started", extra={"fields": {"peer_id": str(dht.peer_id), "batch_size": batch_size,
                                                  "device": str(device)}})
    try:
        opt.load_state_from_peers()  # join an ongoing collaboration at its current step
        follower.probe_bandwidth(args.initial_peers)
        ctx.endpoint.ready.set()
        _loop(ctx, dht, opt, follower, task, model, batch_size, device, trace)
    finally:
        trace.close()
        opt.shutdown()
        dht.shutdown()
    log.info("trainer stopped", extra={"fields": {"epoch": opt.local_epoch, "planned_rounds": follower.planned_rounds}})
    return 0


def _batches(ctx: SwarmContext, task, batch_size: int) -> Iterator[list[int]]:
    return index_stream(task.train_size, batch_size, seed=peer_seed(ctx.spec.task.seed, ctx.args.index))


def _loop(ctx: SwarmContext, dht, opt, follower: PlanFollower, task, model, batch_size: int, device,
          trace: Trace) -> None:
    metrics = ctx.metrics
    batches = _batches(ctx, task, batch_size)
    epoch_losses: list[float] = []  # losses of this peer's batches in the current step
    step_loss: dict[str, Any] = {}  # mean loss of the latest step this peer completed
    total_samples = 0
    window = RateWindow()
    cadence = ReportCadence(ctx)
    last_round_seen: dict[str, Any] = {}
    model.train()
    while not ctx.stop.is_set():
        if cadence.due(dht):
            follower.observe_rounds()
            follower.poll()
            opt.set_computes_gradients(follower.computes_gradients)
            _report(ctx, dht, opt, follower, step_loss, total_samples, window)
        if cadence.stopped:
            break

        if opt.auxiliary:  # the plan has this peer aggregate only; it joins rounds without data
            opt.step()
            metrics.local_step.set(opt.local_epoch)
            metrics.global_step.set(opt.tracker.global_epoch)
            time.sleep(AGGREGATOR_POLL)
            continue
        trace.snapshot_if_changed(model)
        began, stalled_before = time.perf_counter(), opt.stalled_seconds
        indices = next(batches)
        batch = task.to_device(task.train_batch(indices), device)
        loss = task.loss(model, batch)
        loss.backward()
        epoch = opt.local_epoch
        loads_before = opt.state_loads
        opt.step()
        opt.zero_grad(set_to_none=False)

        accumulated = opt.state_loads == loads_before
        trace.write(type="batch", epoch=epoch, indices=indices, loss=loss.item(), accumulated=accumulated)
        if opt.last_round is not last_round_seen and opt.last_round:
            last_round_seen = opt.last_round
            trace.write(type="round", peer=str(dht.peer_id), **{**last_round_seen, "epoch": epoch})
        if accumulated:
            epoch_losses.append(loss.item())
        if opt.local_epoch != epoch:
            if epoch_losses:
                step_loss.update(step=epoch, loss=float(np.mean(epoch_losses)))
                metrics.loss.set(step_loss["loss"])
            epoch_losses.clear()
        metrics.samples.inc(batch_size)
        total_samples += batch_size
        # the planner's s_i: samples per second of computing, not counting this peer's share of
        # the step (averaging, optimizer step, state loads), which the plan models apart
        window.add(batch_size, time.perf_counter() - began - (opt.stalled_seconds - stalled_before))
        metrics.local_step.set(opt.local_epoch)
        metrics.global_step.set(opt.tracker.global_epoch)
        if ctx.args.step_delay:
            time.sleep(ctx.args.step_delay)


def _report(ctx: SwarmContext, dht, opt, follower: PlanFollower, step_loss: dict[str, Any], total_samples: int,
            window: RateWindow) -> None:
    computing = not opt.auxiliary
    last_rate = ctx.status.get("samplesPerSecond", 0.0)
    if computing:
        # no batch in the window means the step was blocked in an averaging round (or loading
        # state), not that this peer stopped computing: a 0 would drop it from the balancer's plan
        rate = window.rate() or last_rate
        ctx.metrics.samples_per_second.set(rate)
    else:  # an aggregator keeps its last rate: the balancer needs it to plan it back in
        rate = last_rate
    report = dict(
        epoch=opt.local_epoch,
        globalEpoch=opt.tracker.global_epoch,
        loss=step_loss.get("loss"),
        lossStep=step_loss.get("step"),
        samplesPerSecond=rate,
        samples=total_samples,
        averagingBytesSent=round(opt.sent_bytes),
        lastRound=opt.last_round,
        computesGradients=computing,
        stepPhases=opt.clock.median.to_json() if opt.clock.median else None,
        plan=follower.plan.digest if follower.plan else None,
        plannedRounds=follower.planned_rounds,
        **follower.report(),
    )
    ctx.status.update(report)
    ctx.publish_report(dht, report)
