"""Auxiliary role: a CPU-only peer that takes part in gradient averaging (it aggregates a share
of the vector) but computes no gradients and holds no data."""

from __future__ import annotations

import argparse
import logging
import time

from hivekeeper.swarm.optimizer import make_collaborative_optimizer
from hivekeeper.swarm.plan_follower import PlanFollower
from hivekeeper.swarm.role import load_swarm_context
from hivekeeper.tasks import load_task

log = logging.getLogger("hivekeeper.auxiliary")



def run(args: argparse.Namespace) -> int:
    ctx = load_swarm_context("auxiliary", args)
    spec = ctx.spec
    ctx.start_endpoint()
    task = load_task(spec.task.name, spec.task.options, seed=spec.task.seed)
    model = task.build_model()  # only for the shapes of the vector to average
    dht = ctx.make_dht()
    opt = make_collaborative_optimizer(spec, ctx.run_id, dht, model, ctx.metrics, auxiliary=True)
    follower = PlanFollower(dht, ctx.run_id, args.plan_signer, opt.grad_averager, ctx.metrics)
    follower.probe_bandwidth(args.initial_peers)
    ctx.endpoint.ready.set()
    log.info("auxiliary up", extra={"fields": {"peer_id": str(dht.peer_id)}})
    last_report = 0.0
    try:
        while not ctx.stop.is_set():
            opt.step()  # joins the round when the collaboration is ready to step
            ctx.metrics.local_step.set(opt.local_epoch)
            ctx.metrics.global_step.set(opt.tracker.global_epoch)
            if time.monotonic() - last_report >= 1.0:
                last_report = time.monotonic()
                if ctx.stop_requested(dht) is not None:
                    break
                follower.observe_rounds()
                follower.poll()  # an auxiliary never computes, whatever the plan says
                report = dict(epoch=opt.local_epoch, lastRound=opt.last_round,
                              plan=follower.plan.digest if follower.plan else None,
                              plannedRounds=follower.planned_rounds, **follower.report())
                ctx.status.update(report)
                ctx.publish_report(dht, report)
            time.sleep(0.05)
    finally:
        opt.shutdown()
        dht.shutdown()
    return 0
