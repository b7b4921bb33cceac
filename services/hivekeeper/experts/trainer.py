"""Trainer role: trains a classifier of DMoE layers on the digits, asynchronously (Learning@home
3.3): `batchesInFlight` batches are processed at once, each on a copy of the local parameters
taken when it starts, and each applies its gradients when it finishes (the experts update
themselves on the servers inside the backward requests). A batch whose examples cannot reach
kMin experts is dropped and training goes on. Trainer 0 evaluates, decides when the run is
done and writes RUN_DIR/result.json, as a Swarm's monitor does."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hivekeeper.experts.common import PoolContext, load_pool_context
from hivekeeper.experts.dmoe import ExpertClient, ExpertsUnavailable
from hivekeeper.experts.kind import SERVER, TRAINER
from hivekeeper.experts.model import DMoEClassifier
from hivekeeper.runtime.reports import announced_addresses, read_peer_reports
from hivekeeper.tasks import load_task
from hivekeeper.training.checkpoint import save_checkpoint
from hivekeeper.training.loop import RateWindow, index_stream, peer_seed
from hivekeeper.training.optimizers import torch_optimizer_factory

log = logging.getLogger("hivekeeper.experts.trainer")
REPORT_SECONDS = 1.0
RETRY_SECONDS = 0.5  # after a dropped batch: the DHT forgets a dead server's experts within their expiry
SEARCH_CACHE_SECONDS = 1.0  # beam searches run here over DHT prefix entries read at most this long ago


def run(args: argparse.Namespace) -> int:
    return ExpertTrainer(load_pool_context(TRAINER, args)).run()


class ExpertTrainer:
    def __init__(self, ctx: PoolContext):
        self.ctx = ctx
        self.spec = ctx.spec
        self.task = load_task(self.spec.task.name, self.spec.task.options, seed=self.spec.task.seed)
        self.run_dir = Path(ctx.args.run_dir)
        self.leader = ctx.args.index == 0  # the one whose result ends the run
        self.step = 0
        self.failed = 0
        self.losses: deque[float] = deque(maxlen=20)
        self.loss_history: dict[int, float] = {}
        self.window = RateWindow()
        self.eval_step = -1
        self.eval_metrics: dict[str, float] = {}
        self.in_flight = 0
        self.requests_reported = {"ok": 0, "failed": 0}  # expert requests already counted in the metric
        self.started = time.time()
        self._lock = threading.Lock()  # the local parameters, the optimizer and the counters
        self._done = threading.Event()

    def run(self) -> int:
        ctx, spec = self.ctx, self.spec
        torch.set_num_threads(1)  # batches in flight are threads; the servers need the cores too
        ctx.start_endpoint()
        self.dht = ctx.make_dht(client_mode=True)  # it only calls out: servers and the DHT
        self.client = ExpertClient(self.dht, request_seconds=ctx.metrics.expert_request_seconds,
                                   search_cache_seconds=SEARCH_CACHE_SECONDS, addresses=self.announced_addresses)
        self.model = DMoEClassifier(spec, self.client)
        self.optimizer = torch_optimizer_factory(spec.trainers.optimizer)(self.model.parameters())
        self.batches = index_stream(self.task.train_size, spec.trainers.batch_size,
                                    seed=peer_seed(spec.task.seed, ctx.args.index))
        history = open(self.run_dir / "history.jsonl", "a", buffering=1) if self.leader else None
        try:
            self.wait_for_experts()
            ctx.endpoint.ready.set()
            log.info("trainer started", extra={"fields": {"peer_id": str(self.dht.peer_id),
                                                          "in_flight": spec.trainers.batches_in_flight}})
            workers = [threading.Thread(target=self.work, name=f"batch-{i}", daemon=True)
                       for i in range(spec.trainers.batches_in_flight)]
            for worker in workers:
                worker.start()
            reason = None
            while reason is None and not ctx.stop.wait(REPORT_SECONDS):
                if self.step >= self.eval_step + spec.trainers.eval_every_steps:
                    self.evaluate()
                snapshot = self.report()
                if history:
                    history.write(json.dumps(snapshot) + "\n")
                reason = self.stopping_reason()
            self._done.set()
            for worker in workers:
                worker.join(timeout=spec.trainers.dmoe.forward_timeout_seconds + spec.trainers.dmoe.backward_timeout_seconds)
            if reason is not None:
                self.finish(reason)
        finally:
            self._done.set()
            if history:
                history.close()
            self.dht.shutdown()
        return 0

    def announced_addresses(self) -> dict[str, list[str]]:
        """Where the expert client dials a server its p2p daemon cannot find."""
        with self.client.dht_lock:
            return announced_addresses(self.dht, self.ctx.run_id)

    def wait_for_experts(self) -> None:
        """Start once the beam search finds kBest experts: the servers are up and announced."""
        k = self.spec.trainers.dmoe.k_best
        zeros = [torch.zeros(1, m) for m in self.spec.grid.dimensions]
        while not self.ctx.stop.is_set():
            found = self.client.find_best_experts(self.spec.grid.uid_prefix, zeros, k)
            if len(found[0]) >= k:
                return
            self.ctx.status.update(globalStep=0, state="waiting for experts", expertsFound=len(found[0]))
            time.sleep(1.0)

    def next_indices(self) -> list[int]:
        with self._lock:
            return next(self.batches)

    def work(self) -> None:
        """One batch in flight at a time per thread, on the parameters as they were when it started."""
        replica = DMoEClassifier(self.spec, self.client)  # this thread's copy of the local parameters
        while not self._done.is_set() and not self.ctx.stop.is_set():
            x, y = self.task.train_batch(self.next_indices())
            with self._lock:
                replica.load_state_dict(self.model.state_dict())
                self.in_flight += 1
            try:
                loss = F.cross_entropy(replica(x), y)
                grads = torch.autograd.grad(loss, list(replica.parameters()))
            except ExpertsUnavailable as e:
                self.dropped(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - a network error on one batch must not stop training
                self.dropped(repr(e))
                continue
            finally:
                with self._lock:
                    self.in_flight -= 1
            with self._lock:
                for p, g in zip(self.model.parameters(), grads):
                    p.grad = g
                self.optimizer.step()
                self.step += 1
                self.losses.append(loss.item())
            self.window.add(len(y))
            self.ctx.metrics.samples.inc(len(y))

    def dropped(self, why: str) -> None:
        with self._lock:
            self.failed += 1
        self.ctx.metrics.failed_batches.inc()
        log.warning("batch dropped", extra={"fields": {"reason": why[:300]}})
        time.sleep(RETRY_SECONDS)

    @torch.no_grad()
    def evaluate(self) -> None:
        step = self.step
        try:
            logits = self.model(self.task.x_test)
        except ExpertsUnavailable as e:
            log.warning("evaluation postponed", extra={"fields": {"reason": str(e)}})
            return
        self.eval_metrics = {"accuracy": round((logits.argmax(-1) == self.task.y_test).float().mean().item(), 6),
                             "loss": round(F.cross_entropy(logits, self.task.y_test).item(), 6)}
        self.eval_step = step
        for name, value in self.eval_metrics.items():
            self.ctx.metrics.eval_metric.labels(name).set(value)
        log.info("evaluated", extra={"fields": {"step": step, **self.eval_metrics}})

    def report(self) -> dict[str, Any]:
        metrics, stats = self.ctx.metrics, self.client.stats
        loss = statistics.fmean(self.losses) if self.losses else None
        if loss is not None:
            self.loss_history[self.step] = round(loss, 6)
            metrics.loss.set(loss)
        rate = self.window.rate()
        metrics.samples_per_second.set(rate)
        metrics.in_flight.set(self.in_flight)
        for outcome, count in (("ok", stats.ok), ("failed", stats.failed)):
            metrics.expert_calls.labels(outcome).inc(count - self.requests_reported[outcome])
            self.requests_reported[outcome] = count
        searches, stats.beam_search_seconds = stats.beam_search_seconds, []
        for seconds in searches:
            metrics.beam_search.observe(seconds)
        with self.client.dht_lock:
            reports = read_peer_reports(self.dht, self.ctx.run_id)
        alive: dict[str, int] = {}
        for r in reports:
            alive[r["role"]] = alive.get(r["role"], 0) + 1
        snapshot = {
            "time": time.time(),
            "elapsedSeconds": round(time.time() - self.started, 1),
            "globalStep": self.step,
            "loss": loss,
            "samplesPerSecond": round(rate, 2),
            "failedBatches": self.failed,
            "batchesInFlight": self.in_flight,
            "expertRequests": {"ok": stats.ok, "failed": stats.failed},
            "beamSearchSeconds": round(statistics.median(searches), 5) if searches else None,
            "peersAlive": alive,
            "expertsAlive": sum(len(r.get("experts") or ()) for r in reports if r["role"] == SERVER),
            "evalStep": self.eval_step,
            "evalMetrics": self.eval_metrics,
        }
        self.ctx.status.clear()
        self.ctx.status.update(snapshot)
        with self.client.dht_lock:
            self.ctx.publish_report(self.dht, {"step": self.step, "loss": loss, "samplesPerSecond": rate})
        return snapshot

    def stopping_reason(self) -> str | None:
        return self.spec.stopping.reached(self.step, self.eval_metrics, time.time() - self.started)

    def finish(self, reason: str) -> None:
        """Checkpoint the local parameters and write the result. The metrics are the latest
        evaluation (the one that met the target, if that is why the run ends); without one yet,
        evaluate now, retrying while a server restarts."""
        for _ in range(10):
            if self.eval_step >= 0:
                break
            self.evaluate()
            if self.eval_step < 0:
                time.sleep(1.0)
        checkpoint = save_checkpoint(self.run_dir / "checkpoints", f"trainer-{self.ctx.args.index}-final", self.model,
                                     self.step, self.eval_metrics, self.ctx.manifest.model_dump(by_alias=True, mode="json"))
        result = {"globalStep": self.step, "reason": reason, "metrics": self.eval_metrics, "evalStep": self.eval_step,
                  "checkpoint": str(checkpoint), "failedBatches": self.failed,
                  "losses": {str(k): v for k, v in sorted(self.loss_history.items())}}
        if self.leader:
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        log.info("run finished", extra={"fields": result | {"losses": len(self.loss_history)}})
