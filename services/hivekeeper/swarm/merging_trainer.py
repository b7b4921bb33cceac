"""The trainer role when a Swarm's replicas train alone (averaging.mode parameters, ties or
diloco): each replica steps a local optimizer and, every mergeEvery steps, merges its weights
with the others (DDAP, through `MergingPeer`), or every innerSteps steps takes one DiLoCo outer
step with them (`DilocoPeer`). Reports the same fields as the gradient trainer, with `epoch`
counting this replica's optimizer steps."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from hivekeeper.swarm.merging_peer import MergeRecord, MergingPeer, WrapperPeer
from hivekeeper.swarm.optimizer import averaging_group_size, robust_aggregation
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

    bytes_counted = [0.0]

    def record(merge: MergeRecord) -> None:
        metrics.averaging_rounds.labels(merge.outcome).inc()
        sent = peer.sent_bytes
        metrics.averaging_sent_bytes.inc(max(0.0, sent - bytes_counted[0]))
        metrics.averaging_received_bytes.inc(max(0.0, sent - bytes_counted[0]))  # a butterfly round is symmetric
        bytes_counted[0] = sent
        if merge.outcome == "success":
            metrics.averaging_round_duration.observe(merge.seconds)
            metrics.averaging_group_size.set(merge.group_size)
        else:
            log.warning("merge failed", extra={"fields": {"step": merge.step, "error": merge.error}})

    peer = _peer(ctx, task, model, optimizer, dht, batch_size, record)
    try:
        joined = peer.join()
        log.info("merging trainer started", extra={"fields": {
            "mode": averaging.mode, "merge_every": float(getattr(peer, "inner_steps", None) or peer.schedule.interval),
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
            metrics.outer_step.set(peer.merges)
            if ctx.args.step_delay:
                time.sleep(ctx.args.step_delay)
    finally:
        peer.shutdown()
    log.info("merging trainer stopped", extra={"fields": {"step": peer.local_steps, "merges": peer.merges}})


def _peer(ctx: SwarmContext, task, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dht, batch_size: int,
          record) -> WrapperPeer:
    averaging = ctx.spec.averaging
    common = dict(matchmaking_seconds=averaging.matchmaking_seconds, timeout_seconds=averaging.timeout_seconds,
                  on_merge=record, aggregation=robust_aggregation(averaging))
    if averaging.mode == "diloco":
        from hivekeeper.swarm.diloco import DEFAULT_INNER_STEPS, DilocoPeer, OuterOptimizer

        outer = averaging.outer_optimizer
        # a group of every trainer forms as soon as the last arrives, without waiting out matchmaking
        return DilocoPeer(model, optimizer, dht, ctx.run_id, inner_steps=averaging.inner_steps or DEFAULT_INNER_STEPS,
                          outer=OuterOptimizer(outer.learning_rate, outer.momentum, outer.nesterov),
                          compression=averaging.compression, overlap=averaging.overlap_outer_round,
                          target_group_size=averaging_group_size(ctx.spec), **common)
    return MergingPeer(model, optimizer, dht, ctx.run_id, mode=averaging.mode,
                       merge_every=averaging.merge_every_steps, merge_every_epochs=averaging.merge_every_epochs,
                       steps_per_epoch=task.train_size // batch_size,  # a pass drops its last partial batch
                       trim=averaging.trim, merge_optimizer_state=averaging.merge_optimizer_state,
                       shift_every=averaging.shift_every_steps, target_group_size=averaging.target_group_size,
                       **common)


def _report(ctx: SwarmContext, dht, peer: WrapperPeer, interval_loss: dict[str, Any], total_samples: int,
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
        shifts=getattr(peer, "shifts", 0),
        averagingBytesSent=round(peer.sent_bytes),
        lastRound=None if last is None else dict(outcome=last.outcome, groupSize=last.group_size,
                                                 seconds=round(last.seconds, 4), epoch=last.step, time=time.time()),
        computesGradients=True,
    )
    ctx.status.update(report)
    ctx.publish_report(dht, report)
