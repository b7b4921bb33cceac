"""hivemind's collaborative Optimizer, configured from the Swarm spec and instrumented:
every averaging round's outcome, duration, group size and bytes moved become metrics."""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any, Callable, Iterable, Optional

import torch

from hivekeeper.metrics import SwarmMetrics
from hivekeeper.spec.swarm import OptimizerSpec, SwarmSpec

log = logging.getLogger("hivekeeper.optimizer")

# Bytes a tensor element takes on the wire under each compression (hivemind's serializers).
WIRE_BYTES_PER_ELEMENT = {"none": 4.0, "float16": 2.0, "uniform8bit": 1.0, "blockwise8bit": 1.0}


def torch_optimizer_factory(spec: OptimizerSpec) -> Callable[[Iterable[Any]], torch.optim.Optimizer]:
    """The local optimizer. Gradient clipping happens inside its step, on the averaged global
    gradient, so clipping means the same as in single-process large-batch training."""
    base = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[spec.name]
    kwargs: dict[str, Any] = dict(lr=spec.learning_rate, weight_decay=spec.weight_decay)
    kwargs.update(momentum=spec.momentum) if spec.name == "sgd" else kwargs.update(betas=spec.betas)
    if spec.clip_grad_norm is None:
        return lambda params: base(params, **kwargs)
    max_norm = spec.clip_grad_norm

    class Clipped(base):  # type: ignore[valid-type, misc]
        def step(self, closure=None):
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            return super().step(closure)

    return lambda params: Clipped(params, **kwargs)


def scheduler_factory(spec: OptimizerSpec) -> Optional[Callable[[torch.optim.Optimizer], Any]]:
    if not spec.warmup_steps:
        return None
    warmup = spec.warmup_steps
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))


def compression(name: str):
    from hivemind.compression import BlockwiseQuantization, Float16Compression, NoCompression, Uniform8BitQuantization

    return {
        "none": NoCompression,
        "float16": Float16Compression,
        "uniform8bit": Uniform8BitQuantization,
        "blockwise8bit": BlockwiseQuantization,
    }[name]()


def averaging_group_size(spec: SwarmSpec) -> int:
    """The all-reduce group: as the spec says, else the size that reaches the global average
    fastest when each peer fails a round with `peerFailureProbability` (DeDLOC appendix C):
    every averaging peer (trainers and auxiliaries) at once when peers do not fail."""
    from hivekeeper.planning.group_size import optimal_group_size

    if spec.averaging.target_group_size:
        return spec.averaging.target_group_size
    peers = spec.trainers.replicas + spec.auxiliary.replicas
    return max(2, optimal_group_size(peers, spec.averaging.peer_failure_probability))


def make_instrumented_classes():
    """Subclasses of hivemind's Optimizer and GradientAverager that feed SwarmMetrics.

    Built lazily so that importing this module does not import hivemind."""
    import hivemind
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.state_averager import TrainingStateAverager
    from hivemind.optim.progress_tracker import ProgressTracker

    class BatchBoundTracker(ProgressTracker):
        """Steps only once the collaboration has really accumulated targetBatchSize samples
        (or a peer is already ahead). hivemind also steps when its *estimated* time of the next
        epoch has passed; right after start-up its throughput estimate is unbounded, so a lone
        peer takes dozens of steps on one small batch each. That breaks the promise that every
        optimizer step sees the global batch, which is what makes this large-batch SGD. The
        estimate still schedules matchmaking ahead of time.

        At start-up it also waits (at most `gather_seconds`) until it sees the trainers the spec
        asks for: each trainer only learns of the others from the DHT a fetch later, and until
        then it steps alone, many small steps a second; peers that meet after that are epochs
        apart, and hivemind re-synchronizes them slowly while their rounds fail."""

        def __init__(self, *args: Any, expected_peers: int = 1, gather_seconds: float = 60.0, **kwargs: Any):
            self.expected_peers = expected_peers
            self.gather_until = time.monotonic() + gather_seconds
            super().__init__(*args, **kwargs)

        @property
        def ready_to_update_epoch(self) -> bool:
            if self.global_epoch > self.local_progress.epoch:
                return True
            gathering = self.global_progress.num_peers < self.expected_peers and time.monotonic() < self.gather_until
            return not gathering and self.global_progress.samples_accumulated >= self.target_batch_size

    class CountingGradientAverager(GradientAverager):
        """Counts bytes of tensor parts moved in all-reduce. The all-reduce runs in the averager's
        forked child process, so the counters live in shared memory created before the fork."""

        def __init__(self, *args: Any, wire_bytes_per_element: float = 4.0, **kwargs: Any):
            ctx = mp.get_context("fork")
            self.sent_bytes = ctx.Value("d", 0.0)
            self.received_bytes = ctx.Value("d", 0.0)
            self.last_round_bytes = ctx.Value("d", 0.0)  # each way, in the latest round
            self.wire_bytes_per_element = wire_bytes_per_element
            super().__init__(*args, **kwargs)

        async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
            await super()._run_allreduce_inplace_(tensors, group_info, group_id=group_id, **kwargs)
            parts = kwargs.get("peer_fractions")  # despite the name: elements each peer aggregates
            modes = kwargs.get("modes")
            if not parts:
                return
            me = group_info.peer_ids.index(self.peer_id)
            sends_data = modes is None or modes[me].name != "AUX"
            senders = sum(1 for m in modes if m.name != "AUX") if modes is not None else len(parts)
            size = self.total_size * self.wire_bytes_per_element
            # As a sender: my vector minus the part I aggregate goes out, and the averaged parts come back.
            # As an aggregator: every other sender's share of my part comes in, and the averages go back.
            own_part = parts[me] * self.wire_bytes_per_element
            outbound = (size - own_part if sends_data else 0.0) + own_part * (senders - int(sends_data))
            with self.sent_bytes.get_lock():
                self.sent_bytes.value += outbound
            with self.received_bytes.get_lock():
                self.received_bytes.value += outbound  # all-reduce is symmetric: as much returns as goes out
            self.last_round_bytes.value = outbound

    class FiniteStateAverager(TrainingStateAverager):
        """Refuses a non-finite parameter average (a group whose weights sum to 0 divides 0 by 0,
        as gradient averaging can) and keeps the local state instead."""

        def _apply_averaging_results_(self):
            with self.get_tensors() as averaged:
                finite = all(bool(torch.isfinite(tensor).all()) for tensor in averaged)
            if not finite:
                log.error("averaged parameters are not finite; keeping the local ones")
                return
            super()._apply_averaging_results_()

    class InstrumentedOptimizer(hivemind.Optimizer):
        def __init__(self, *args: Any, metrics: SwarmMetrics, expected_peers: int = 1, **kwargs: Any):
            self.metrics = metrics
            self.expected_peers = expected_peers
            self.last_round: dict[str, Any] = {}
            self._bytes_seen = (0.0, 0.0)
            self.state_loads = 0
            self._check_average = self._rejected_average = False
            super().__init__(*args, **kwargs)
            self.state_averager.__class__ = FiniteStateAverager  # same state, one more check

        def set_computes_gradients(self, computes: bool) -> None:
            """Follow the averaging plan's c_i. A trainer told not to compute becomes an auxiliary
            aggregator: it drops its accumulated gradients, sends nothing, aggregates its share,
            and stops sharing its parameters, which go stale while it aggregates. Told to compute
            again, it loads the current state from peers first."""
            if computes != self.auxiliary:
                return  # already in that role
            from hivemind.averaging.averager import AveragingMode

            if self.client_mode:
                return  # hivemind's client-mode peers cannot be auxiliaries; they keep computing
            if not computes:
                self.grad_averager.reset_accumulated_grads_()
                self.tracker.report_local_progress(self.local_epoch, 0)
                self.state_averager.allow_state_sharing = False
            self.auxiliary = not computes
            mode = AveragingMode.AUX if self.auxiliary else AveragingMode.NODE
            self.grad_averager.mode = self.state_averager.mode = mode
            if computes:
                self.load_state_from_peers()
                self.state_averager.allow_state_sharing = True
            log.info("plan role", extra={"fields": {"computes_gradients": computes}})

        def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
            return BatchBoundTracker(
                dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size, client_mode=self.client_mode,
                status_loglevel=self.status_loglevel, start=True, expected_peers=self.expected_peers, **kwargs,
            )

        def load_state_from_peers(self, **kwargs: Any) -> None:
            self.state_loads += 1
            self.metrics.state_loads.inc()
            super().load_state_from_peers(**kwargs)

        def _update_global_epoch(self, grad_scaler) -> None:
            self._round_recorded = False
            epoch = self.local_epoch
            super()._update_global_epoch(grad_scaler)
            if self.use_gradient_averaging and not self._round_recorded:
                # hivemind steps alone (no all-reduce) when it sees no other peer
                self._record_round("skipped", 1, 0.0, epoch)

        def _maybe_schedule_gradient_averaging(self) -> None:
            """hivemind's, but not while this peer is alone. Alone, hivemind schedules a round
            before each epoch's end only to cancel it at the end ("no other peers"), and a
            cancel that races the averager's matchmaking can leave the averager's matchmaking
            wedged: in 2 of about 10 runs of the volunteers suite the swarm's lone trainer,
            its first scheduled round cancelled, never formed a group again ("could not find
            a group" every round with the volunteer that joined later). With a second peer,
            rounds are scheduled as hivemind does."""
            if self.tracker.global_progress.num_peers > 1:
                super()._maybe_schedule_gradient_averaging()

        def _load_averaged_gradients_into_optimizer_(self):
            """hivemind's, refusing an average that is not finite: hivemind divides a part's sum by
            the senders' total weight, which is 0 when every sender in the group had no samples
            (a peer tagging along after a restart) or when every weighted sender failed mid-round,
            and a peer may send garbage. hivemind then steps on this peer's local gradients."""
            checking, self._check_average = self._check_average, False  # hivemind's fallback loads
            if not checking:  # local gradients through this same method: those pass unchecked
                return super()._load_averaged_gradients_into_optimizer_()
            with torch.no_grad(), self.grad_averager.get_tensors() as averaged:
                finite = all(bool(torch.isfinite(tensor).all()) for tensor in averaged)
            if not finite:
                self._rejected_average = True
                log.error("averaged gradients are not finite; stepping on local gradients instead")
                raise ValueError("averaged gradients are not finite")
            super()._load_averaged_gradients_into_optimizer_()

        def _average_gradients_and_load_into_optimizer(self, maybe_step_control):
            started = time.perf_counter()
            self._rejected_average, self._check_average = False, True
            super()._average_gradients_and_load_into_optimizer(maybe_step_control)
            self._check_average = False
            seconds = time.perf_counter() - started
            members: list[str] = []
            if maybe_step_control is None:
                outcome, group_size = "skipped", 1
            elif self._rejected_average:
                outcome, group_size = "failure", 0
            elif maybe_step_control.done() and maybe_step_control.exception() is None:
                members = sorted(str(peer) for peer in maybe_step_control.result())
                outcome, group_size = "success", len(members)
            else:
                outcome, group_size = "failure", 0
            self._record_round(outcome, group_size, seconds, self.local_epoch, members)

        def _record_round(self, outcome: str, group_size: int, seconds: float, epoch: int,
                          members: list[str] = ()) -> None:
            self._round_recorded = True
            self.metrics.averaging_rounds.labels(outcome).inc()
            if outcome == "success":
                self.metrics.averaging_round_duration.observe(seconds)
                self.metrics.averaging_group_size.set(group_size)
            self.last_round = {
                "outcome": outcome,
                "groupSize": group_size,
                "seconds": round(seconds, 4),
                "epoch": epoch,
                "time": time.time(),
                "members": list(members) or [str(self.dht.peer_id)],
            }
            self.sync_byte_counters()

        def sync_byte_counters(self) -> None:
            averager = self.grad_averager
            if not isinstance(averager, CountingGradientAverager):
                return
            sent, received = averager.sent_bytes.value, averager.received_bytes.value
            self.metrics.averaging_sent_bytes.inc(max(0.0, sent - self._bytes_seen[0]))
            self.metrics.averaging_received_bytes.inc(max(0.0, received - self._bytes_seen[1]))
            self._bytes_seen = (sent, received)

    return InstrumentedOptimizer, CountingGradientAverager


# how often a peer's progress record is refreshed in the DHT (hivemind's defaults are far slower)
TRACKER_REFRESH = dict(min_refresh_period=0.25, max_refresh_period=2.0)


def chunk_timeout(matchmaking_seconds: float, timeout_seconds: float) -> float:
    """How long a peer in a formed group may go silent between two parts before the others drop
    it from the round (its parts then stay local: peers step on different averages). hivemind
    ties it to the matchmaking time, so a 1 s matchmaking window drops a peer that a loaded host
    stalls for a second; a quarter of the round's timeout still leaves a hung peer's group the
    time to finish without it (the reducer's limit is twice this)."""
    return max(matchmaking_seconds, timeout_seconds / 4)


def averager_options(target_group_size: Optional[int], matchmaking_seconds: float) -> dict:
    """hivemind advises a request timeout below the matchmaking time (rare deadlocks otherwise)."""
    return dict(target_group_size=target_group_size, request_timeout=min(3.0, matchmaking_seconds / 2))


def make_collaborative_optimizer(
    spec: SwarmSpec,
    run_id: str,
    dht,
    model: torch.nn.Module,
    metrics: SwarmMetrics,
    *,
    auxiliary: bool = False,
    batch_size: Optional[int] = None,
):
    from functools import partial

    from hivekeeper.swarm.planned_averaging import planned

    InstrumentedOptimizer, CountingGradientAverager = make_instrumented_classes()
    averaging = spec.averaging
    grad_compression = compression(averaging.compression)
    optimizer = InstrumentedOptimizer(
        dht=dht,
        run_id=run_id,
        params=model.parameters(),
        optimizer=torch_optimizer_factory(spec.optimizer),
        scheduler=scheduler_factory(spec.optimizer),
        target_batch_size=spec.target_batch_size,
        batch_size_per_step=None if auxiliary else batch_size,
        matchmaking_time=averaging.matchmaking_seconds,
        averaging_timeout=averaging.timeout_seconds,
        next_chunk_timeout=chunk_timeout(averaging.matchmaking_seconds, averaging.timeout_seconds),
        delay_optimizer_step=averaging.delayed_parameter_updates,
        delay_grad_averaging=averaging.delayed_parameter_updates,
        average_state_every=averaging.average_state_every,
        auxiliary=auxiliary,
        client_mode=dht.client_mode,
        grad_compression=grad_compression,
        state_averaging_compression=grad_compression,
        grad_averager_factory=partial(
            planned(CountingGradientAverager), wire_bytes_per_element=WIRE_BYTES_PER_ELEMENT[averaging.compression]
        ),
        averager_opts=averager_options(averaging_group_size(spec), averaging.matchmaking_seconds),
        tracker_opts=TRACKER_REFRESH,
        metrics=metrics,
        expected_peers=spec.trainers.replicas,  # the progress tracker counts trainers only
        verbose=False,
    )
    reset_step_counters(optimizer.state_averager.optimizer)
    return optimizer


def reset_step_counters(optimizer: torch.optim.Optimizer) -> None:
    """hivemind creates the optimizer's state with one speculative step on zero gradients, which
    leaves Adam's step count at 1: the first real step then uses the bias correction of the
    second, a different update than single-process training makes. Start the count at 0."""
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0
