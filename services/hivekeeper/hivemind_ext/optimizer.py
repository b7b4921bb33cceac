"""hivemind's collaborative Optimizer, instrumented and guarded for the Swarm.

`InstrumentedOptimizer` records every averaging round's outcome, duration, group size and bytes
moved as metrics (and `last_round`), follows the averaging plan's role (`set_computes_gradients`),
steps only on a really accumulated global batch (`BatchBoundTracker`), schedules no rounds while
alone, and refuses averages that are not finite: gradients (it steps on local ones instead) and
parameters (`FiniteStateAverager`, which keeps the local ones). With `aggregation` (a
CenteredClip) the parameter averages are robust too, as the gradient averager's are (its
aggregation comes with the gradient averager's factory).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any, Optional, Sequence

import hivemind
import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from hivekeeper.hivemind_ext import check_hivemind_version
from hivekeeper.hivemind_ext.allreduce import CountingGradientAverager
from hivekeeper.hivemind_ext.group_round import add_averages, bytes_sent, start_runner
from hivekeeper.hivemind_ext.robust import CenteredClip, robust_runner
from hivekeeper.metrics import SwarmMetrics

check_hivemind_version(__name__)

__all__ = ["BatchBoundTracker", "FiniteStateAverager", "InstrumentedOptimizer"]

log = logging.getLogger("hivekeeper.optimizer")


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


class FiniteStateAverager(TrainingStateAverager):
    """Refuses a non-finite parameter average (a group whose weights sum to 0 divides 0 by 0,
    as gradient averaging can) and keeps the local state instead; with `aggregation`, each
    part it aggregates is CenteredClip's center instead of the mean."""

    def __init__(self, *args: Any, aggregation: Optional[CenteredClip] = None, **kwargs: Any):
        self._aggregation = aggregation  # set before super().__init__ forks the averager's process
        self.sent_bytes = mp.get_context("fork").Value("d", 0.0)  # parameter-averaging bytes sent (uncompressed)
        super().__init__(*args, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: Optional[bytes] = None, **kwargs: Any) -> None:
        """hivemind's, with the robust runner when an aggregation is set."""
        runner_class: type[AllReduceRunner] = AllReduceRunner
        if self._aggregation is not None:
            runner_class, kwargs = robust_runner(AllReduceRunner), dict(kwargs, aggregation=self._aggregation)
        runner = start_runner(self, tensors, group_info, group_id, runner_class, **kwargs)
        await add_averages(self, runner, tensors, group_info)
        if kwargs.get("peer_fractions") and self.mode != AveragingMode.AUX:
            with self.sent_bytes.get_lock():
                self.sent_bytes.value += bytes_sent(self, group_info, sum(t.numel() for t in tensors),
                                                    kwargs["peer_fractions"], 4.0)

    def _apply_averaging_results_(self):
        with self.get_tensors() as averaged:
            finite = all(bool(torch.isfinite(tensor).all()) for tensor in averaged)
        if not finite:
            log.error("averaged parameters are not finite; keeping the local ones")
            return
        super()._apply_averaging_results_()


# hivemind names RPC handlers after the servicer's class: keep hivemind's name, so that peers
# (the monitor's plain TrainingStateAverager too) meet and download state from this one
FiniteStateAverager.__name__ = TrainingStateAverager.__name__


class InstrumentedOptimizer(hivemind.Optimizer):
    """hivemind's Optimizer feeding SwarmMetrics, with the guards in the module docstring."""

    def __init__(self, *args: Any, metrics: SwarmMetrics, expected_peers: int = 1,
                 state_aggregation: Optional[CenteredClip] = None, **kwargs: Any):
        self.metrics = metrics
        self.state_aggregation = state_aggregation  # the parameter averages' (None: hivemind's mean)
        self.expected_peers = expected_peers
        self.last_round: dict[str, Any] = {}
        self._bytes_seen = (0.0, 0.0)
        self.state_loads = 0
        self._check_average = self._rejected_average = False
        super().__init__(*args, **kwargs)

    def set_computes_gradients(self, computes: bool) -> None:
        """Follow the averaging plan's c_i. A trainer told not to compute becomes an auxiliary
        aggregator: it drops its accumulated gradients, sends nothing, aggregates its share,
        and stops sharing its parameters, which go stale while it aggregates. Told to compute
        again, it loads the current state from peers first."""
        if computes != self.auxiliary:
            return  # already in that role
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

    def _make_state_averager(self, **kwargs: Any) -> TrainingStateAverager:
        """hivemind's, with one more check on the averaged parameters."""
        return FiniteStateAverager(
            dht=self.dht, prefix=f"{self.run_id}_state_averager", min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout, shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer, custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel, next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode, auxiliary=self.auxiliary, aggregation=self.state_aggregation, start=True,
            **kwargs)

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
        self.last_round = {"outcome": outcome, "groupSize": group_size, "seconds": round(seconds, 4), "epoch": epoch,
                           "time": time.time(), "members": list(members) or [str(self.dht.peer_id)]}
        self.sync_byte_counters()

    @property
    def sent_bytes(self) -> float:
        """Tensor bytes this peer sent averaging gradients and (uncompressed) parameters."""
        grads = self.grad_averager.sent_bytes.value if isinstance(self.grad_averager, CountingGradientAverager) else 0.0
        state = getattr(self.state_averager, "sent_bytes", None)
        return grads + (state.value if state is not None else 0.0)

    def sync_byte_counters(self) -> None:
        averager = self.grad_averager
        if not isinstance(averager, CountingGradientAverager):
            return
        sent, received = averager.sent_bytes.value, averager.received_bytes.value
        self.metrics.averaging_sent_bytes.inc(max(0.0, sent - self._bytes_seen[0]))
        self.metrics.averaging_received_bytes.inc(max(0.0, received - self._bytes_seen[1]))
        self._bytes_seen = (sent, received)
