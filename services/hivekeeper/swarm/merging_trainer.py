"""The trainer role when a Swarm merges weights (averaging.mode parameters or ties): each
replica trains alone with a local optimizer and merges with the others every mergeEvery
steps (DDAP), through `MergingPeer`. Reports the same fields as the gradient trainer, with
`epoch` counting this replica's optimizer steps."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from hivekeeper.swarm.merging_peer import MergeRecord, MergingPeer
from hivekeeper.swarm.optimizer import robust_aggregation
from hivekeeper.swarm.role import SwarmContext
from hivekeeper.training.loop import RateWindow, ReportCadence
from hivekeeper.training.optimizers import scheduler_factory, torch_optimizer_factory

log = logging.getLogger("hivekeeper.trainer")


def train_merging(ctx: SwarmContext, task, model: torch.nn.Module, dht, batch_size: int, device,
                  batches) -> None:
    spec, metrics = ctx.spec, ctx.metrics
    averaging = spec.averaging
    optimizer = torch_optimizer_factory(spec.optimizer)(model.parameters())
    make_scheduler = scheduler_factory(spec.optimizer)
    scheduler = make_scheduler(optimizer) if make_scheduler else None

    def record(merge: MergeRecord) -> None:
        metrics.averaging_rounds.labels(merge.outcome).inc()
        if merge.outcome == "success":
            metrics.averaging_round_duration.observe(merge.seconds)
            metrics.averaging_group_size.set(merge.group_size)
        else:
            log.warning("merge failed", extra={"fields": {"step": merge.step, "error": merge.error}})

    peer = MergingPeer(model, optimizer, dht, ctx.run_id, mode=averaging.mode,
                       merge_every=averaging.merge_every_steps, merge_every_epochs=averaging.merge_every_epochs,
                       steps_per_epoch=task.train_size // batch_size,  # a pass drops its last partial batch
                       trim=averaging.trim, merge_optimizer_state=averaging.merge_optimizer_state,
                       shift_every=averaging.shift_every_steps,
                       target_group_size=averaging.target_group_size,
                       matchmaking_seconds=averaging.matchmaking_seconds,
                       timeout_seconds=averaging.timeout_seconds, on_merge=record,
                       aggregation=robust_aggregation(averaging))
    try:
        joined = peer.join()
        log.info("merging trainer started", extra={"fields": {
            "mode": averaging.mode, "merge_every": float(peer.schedule.interval),
            "joined_at_step": peer.local_steps if joined else 0}})
        ctx.endpoint.ready.set()
        losses: list[float] = []
        interval_loss: dict[str, Any] = {}
        window, cadence = RateWindow(), ReportCadence(ctx)
        total_samples = 0
        model.train()
        while not ctx.stop.is_set():
            if cadence.due(dht):
                _report(ctx, dht, peer, interval_loss, total_samples, window)
            if cadence.stopped:
                break
            batch = task.to_device(task.train_batch(next(batches)), device)
            loss = task.loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
            merged = peer.step()
            if merged is not None:  # one loss figure per merge interval
                interval_loss.update(step=peer.local_steps, loss=float(np.mean(losses)))
                metrics.loss.set(interval_loss["loss"])
                losses.clear()
            metrics.samples.inc(batch_size)
            total_samples += batch_size
            window.add(batch_size)
            metrics.local_step.set(peer.local_steps)
            metrics.global_step.set(peer.local_steps)
            if ctx.args.step_delay:
                time.sleep(ctx.args.step_delay)
    finally:
        peer.shutdown()
    log.info("merging trainer stopped", extra={"fields": {"step": peer.local_steps, "merges": peer.merges}})


def _report(ctx: SwarmContext, dht, peer: MergingPeer, interval_loss: dict[str, Any], total_samples: int,
            window: RateWindow) -> None:
    rate = window.rate()
    ctx.metrics.samples_per_second.set(rate)
    last = peer.last_merge
    report = dict(
        epoch=peer.local_steps,
        globalEpoch=peer.local_steps,
        loss=interval_loss.get("loss"),
        lossStep=interval_loss.get("step"),
        samplesPerSecond=rate,
        samples=total_samples,
        merges=peer.merges,
        shifts=peer.shifts,
        lastRound=None if last is None else dict(outcome=last.outcome, groupSize=last.group_size,
                                                 seconds=round(last.seconds, 4), epoch=last.step, time=time.time()),
        computesGradients=True,
    )
    ctx.status.update(report)
    ctx.publish_report(dht, report)
