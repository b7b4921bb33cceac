"""Monitor role: reads the collaboration's progress from the DHT, evaluates the averaged model
on held-out data, saves checkpoints, decides when the run is done, and serves the state that
`hivekeeper status` and `hivekeeper up` show."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from hivekeeper.runtime.reports import STOP_KEY, read_peer_reports
from hivekeeper.swarm.parties import export_parties, labs_of, parties_of
from hivekeeper.swarm.role import SwarmContext, load_swarm_context
from hivekeeper.tasks import load_task
from hivekeeper.training.checkpoint import checkpoint_steps, prune_checkpoints, save_checkpoint
from hivekeeper.training.optimizers import scheduler_factory, torch_optimizer_factory

log = logging.getLogger("hivekeeper.monitor")
POLL_SECONDS = 1.0
STATE_ATTEMPTS = 3  # state downloads per evaluation (a donor may be busy, leave, or send a partial state)



def run(args: argparse.Namespace) -> int:
    ctx = load_swarm_context("monitor", args)
    return Monitor(ctx).run()


class Monitor:
    def __init__(self, ctx: SwarmContext):
        self.ctx = ctx
        spec = ctx.spec
        self.run_dir = Path(ctx.args.run_dir)
        self.checkpoint_dir = Path(spec.monitor.directory(str(self.run_dir)))
        self.task = load_task(spec.task.name, spec.task.options, seed=spec.task.seed)
        self.model = self.task.build_model()
        self.started = time.time()
        self.eval_step = -1
        self.eval_metrics: dict[str, float] = {}
        # A restarted monitor whose directory outlived it (a claim) goes on from its last checkpoint.
        self.checkpoint_step = max(checkpoint_steps(self.checkpoint_dir), default=0)
        self.losses: dict[int, float] = {}
        self.history = open(self.run_dir / "history.jsonl", "a", buffering=1)
        self.steps_seen: list[tuple[float, int]] = []  # (time, global step), the last minute
        self.samples_seen: list[tuple[float, int]] = []  # (time, samples of all trainers), the last minute
        self.outer_steps: int | None = None  # replicas that train alone: the most any trainer took

    def run(self) -> int:
        import hivemind

        from hivekeeper.hivemind_ext.optimizer import FiniteStateAverager

        ctx = self.ctx
        ctx.start_endpoint()
        self.dht = ctx.make_dht(client_mode=True)  # it downloads state; nobody needs to dial it
        # it only downloads states (FiniteStateAverager refuses one that is not whole)
        self.state = None if ctx.spec.averaging.merges_weights else FiniteStateAverager(
            dht=self.dht,
            optimizer=torch_optimizer_factory(ctx.spec.optimizer),
            scheduler=scheduler_factory(ctx.spec.optimizer),
            params=self.model.parameters(),
            prefix=f"{ctx.run_id}_state_averager",
            start=True,
        )
        ctx.endpoint.ready.set()
        log.info("monitor up", extra={"fields": {"peer_id": str(self.dht.peer_id),
                                                 "checkpoint_dir": str(self.checkpoint_dir),
                                                 "last_checkpoint_step": self.checkpoint_step}})
        exit_code = 0
        try:
            while not ctx.stop.wait(POLL_SECONDS):
                snapshot = self.observe()
                if self.should_evaluate(snapshot["globalStep"]):
                    self.evaluate()
                    self.maybe_checkpoint()
                done = self.stopping_reason(snapshot["globalStep"])
                if done:
                    self.finish(done)
                    break
        except Exception:
            log.exception("monitor failed")
            exit_code = 1
        finally:
            self.history.close()
            if self.state is not None:
                self.state.shutdown()
            self.dht.shutdown()
            del hivemind
        return exit_code

    def observe(self) -> dict[str, Any]:
        reports = read_peer_reports(self.dht, self.ctx.run_id)
        trainers = [r for r in reports if r["role"] == "trainer"]
        global_step = max((r.get("globalEpoch") or r.get("epoch") or 0 for r in trainers), default=0)
        for step in {r.get("lossStep") for r in trainers if r.get("loss") is not None}:
            values = [r["loss"] for r in trainers if r.get("lossStep") == step and r.get("loss") is not None]
            self.losses[step] = sum(values) / len(values)
        latest_loss_step = max(self.losses, default=None)
        rounds = [r["lastRound"] for r in reports if r.get("lastRound")]
        last_round = max(rounds, key=lambda r: r.get("time", 0), default=None)
        alive = Counter(r["role"] for r in reports)
        alive["monitor"] = max(alive.get("monitor", 0), 1)
        samples = sum(r.get("samples") or 0 for r in trainers)
        plan = self.read_plan()
        achieved = self.steps_per_second(global_step)
        predicted = plan["stepsPerSecond"] if plan and plan.get("stepsPerSecond") else None
        snapshot = {
            "time": time.time(),
            "elapsedSeconds": round(time.time() - self.started, 1),
            "globalStep": global_step,
            "loss": self.losses.get(latest_loss_step) if latest_loss_step is not None else None,
            "lossStep": latest_loss_step,
            # achieved over the last minute (the trainers' own samples/s count computing time only)
            "samplesPerSecond": self.samples_per_second(samples),
            "samples": samples,
            # what a trainer has sent in averaging rounds or merges, on average (the wire's cost)
            "averagingBytesSentPerTrainer": round(sum(sent) / len(sent)) if (sent := [
                r["averagingBytesSent"] for r in trainers if isinstance(r.get("averagingBytesSent"), (int, float))]) else None,
            "outerSteps": max((r.get("merges") or 0 for r in trainers), default=0)
            if self.ctx.spec.averaging.merges_weights else None,
            "peersAlive": dict(alive),
            "labs": labs_of(reports, self.ctx.run_id),
            "lastRound": last_round,
            "evalStep": self.eval_step,
            "evalMetrics": self.eval_metrics,
            "checkpointStep": self.checkpoint_step,
            "stepsPerSecond": achieved,  # kept for readers of earlier runs' histories
            "achievedStepsPerSecond": achieved,
            "predictedStepsPerSecond": predicted,
            "efficiency": round(achieved / predicted, 3) if achieved is not None and predicted else None,
            "plan": plan,
        }
        metrics = self.ctx.metrics
        metrics.global_step.set(global_step)
        metrics.collaboration_samples_per_second.set(snapshot["samplesPerSecond"])
        export_parties(metrics, parties_of(reports, self.ctx.run_id))
        if snapshot["loss"] is not None:
            metrics.loss.set(snapshot["loss"])
        for role in ("backbone", "trainer", "auxiliary", "monitor", "balancer"):
            metrics.peers_alive.labels(role).set(alive.get(role, 0))
        self.outer_steps = snapshot["outerSteps"]
        self.ctx.status.clear()
        self.ctx.status.update(snapshot)
        self.history.write(json.dumps(snapshot) + "\n")
        return snapshot

    def steps_per_second(self, global_step: int) -> float | None:
        """Achieved optimizer steps/s over the last minute, to hold against the plan's prediction."""
        return _rate_over_last_minute(self.steps_seen, global_step, 4)

    def samples_per_second(self, samples: int) -> float:
        """The collaboration's samples/s over the last minute (0 until 5 s have passed)."""
        return _rate_over_last_minute(self.samples_seen, samples, 1) or 0.0

    def read_plan(self) -> dict[str, Any] | None:
        """The balancer's current plan, as peers see it (verified), for people and the operator."""
        from hivekeeper.swarm.plan_record import PlanRecordError, read_plan

        signer = self.ctx.args.plan_signer
        if not signer:
            return None
        try:
            plan = read_plan(self.dht, swarm=self.ctx.run_id, signer=signer)
        except PlanRecordError:
            return None
        return plan.to_json()

    def should_evaluate(self, global_step: int) -> bool:
        every = self.ctx.spec.monitor.eval_every_steps
        return global_step > 0 and global_step >= max(self.eval_step, 0) + every

    def load_latest_state(self) -> int:
        if self.state is None:  # replicas merge weights: the latest merged model
            from hivekeeper.swarm.merging_peer import load_merged_state

            spec = self.ctx.spec
            optimizer = torch_optimizer_factory(spec.optimizer)(self.model.parameters()) \
                if spec.averaging.shares_optimizer_state else None  # DiLoCo: outer parameters and momentum
            metadata = load_merged_state(self.dht, self.ctx.run_id, self.model, optimizer)
            return int(metadata["step"]) if metadata else max(self.eval_step, 0)
        for attempt in range(1, STATE_ATTEMPTS + 1):
            self.state.load_state_from_peers(timeout=30.0)
            if self.state.loaded_epoch is not None:
                break
            log.warning("no whole state downloaded from the trainers", extra={"fields": {"attempt": attempt}})
            time.sleep(1.0)
        return self.state.local_epoch

    def evaluate(self) -> dict[str, float]:
        step = self.load_latest_state()
        self.eval_metrics = {k: round(v, 6) for k, v in self.task.evaluate(self.model).items()}
        self.eval_step = step
        for name, value in self.eval_metrics.items():
            self.ctx.metrics.eval_metric.labels(name).set(value)
        log.info("evaluated", extra={"fields": {"step": step, **self.eval_metrics}})
        return self.eval_metrics

    def maybe_checkpoint(self) -> None:
        every = self.ctx.spec.monitor.checkpoint_every_steps
        if self.eval_step >= self.checkpoint_step + every:
            self.save(f"step-{self.eval_step}")
            prune_checkpoints(self.checkpoint_dir, self.ctx.spec.monitor.keep_checkpoints)

    def save(self, name: str) -> Path:
        path = save_checkpoint(self.checkpoint_dir, name, self.model, self.eval_step, self.eval_metrics,
                               self.ctx.manifest.model_dump(by_alias=True, mode="json"))
        self.checkpoint_step = self.eval_step
        self.ctx.metrics.checkpoints.inc()
        return path

    def stopping_reason(self, global_step: int) -> str | None:
        return self.ctx.spec.stopping.reached(global_step, self.eval_metrics, time.time() - self.started)

    def finish(self, reason: str) -> None:
        from hivemind.utils import get_dht_time

        # The evaluation that met the target is the run's result: the model it read becomes the
        # final checkpoint (evaluating again, a step or two later, can land under the target).
        # Otherwise the final checkpoint is the swarm's latest state.
        if not self.ctx.spec.stopping.metric_met(self.eval_metrics):
            self.evaluate()
        final = self.save("final")
        self.dht.store(self.ctx.run_id + STOP_KEY, {"step": self.eval_step, "reason": reason},
                       expiration_time=get_dht_time() + 3600)
        result = {"globalStep": self.eval_step, "reason": reason, "metrics": self.eval_metrics,
                  "checkpoint": str(final), "losses": {str(k): v for k, v in sorted(self.losses.items())}}
        if self.outer_steps is not None:  # replicas that train alone: their merges or outer steps
            result["outerSteps"] = self.outer_steps
        (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        log.info("run finished", extra={"fields": result | {"losses": len(self.losses)}})


def _rate_over_last_minute(seen: list[tuple[float, float]], value: float, digits: int) -> float | None:
    """Appends (now, value) to `seen`, drops what is older than a minute, and returns the rate
    of `value` over what is left (None until it spans 5 s)."""
    now = time.time()
    seen[:] = [(t, v) for t, v in seen if t >= now - 60.0] + [(now, value)]
    (t0, v0), (t1, v1) = seen[0], seen[-1]
    return round((v1 - v0) / (t1 - t0), digits) if t1 - t0 >= 5.0 else None
