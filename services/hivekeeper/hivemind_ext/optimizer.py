"""hivemind's collaborative Optimizer, instrumented and guarded for the Swarm.

`InstrumentedOptimizer` records every averaging round's outcome, duration, group size and bytes
moved as metrics (and `last_round`), follows the averaging plan's role (`set_computes_gradients`),
steps only on a really accumulated global batch (`BatchBoundTracker`), schedules no rounds while
alone, and refuses averages that are not finite: gradients (it steps on local ones instead) and
parameters (`FiniteStateAverager`, which keeps the local ones). With `aggregation` (a
CenteredClip) the parameter averages are robust too, as the gradient averager's are (its
aggregation comes with the gradient averager's factory).

It also keeps replicas in lockstep and rounds at the wire's pace (issue 20): it looks for a
group as soon as its previous step's accumulation time says the batch is near, steps at once
when a groupmate began the round (`PlannedAverager.groupmate_began`), times each step's phases
(`StepClock`, the planner's fixed costs), averages the parameters on the gradient round's
group (`parameters_every`, see `state_round`; with DPU hivemind's own parameter rounds remain,
and a parameter average that arrives after the next optimizer step is refused), reloads the
state after a failed round, and loads a state again while it is behind the global step.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from typing import Any, Callable, Optional, Sequence

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager

from hivekeeper.hivemind_ext import check_hivemind_version
from hivekeeper.hivemind_ext.allreduce import CountingGradientAverager, PlannedAverager, PlannedRound
from hivekeeper.hivemind_ext.group_round import add_averages, bytes_sent, start_runner
from hivekeeper.hivemind_ext.robust import CenteredClip, robust_runner
from hivekeeper.hivemind_ext.state_round import StateRound
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.planning.step_clock import StepClock

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
        self.groupmate_began: Callable[[], bool] = lambda: False  # set by the optimizer
        super().__init__(*args, **kwargs)

    @property
    def ready_to_update_epoch(self) -> bool:
        if self.global_epoch > self.local_progress.epoch or self.groupmate_began():
            return True
        gathering = self.global_progress.num_peers < self.expected_peers and time.monotonic() < self.gather_until
        return not gathering and self.global_progress.samples_accumulated >= self.target_batch_size


class _LoadedEpoch(DecentralizedAverager):
    """Placed between TrainingStateAverager and DecentralizedAverager: records the epoch of the
    state the latest `load_state_from_peers` downloaded (None if it got none). hivemind's
    optimizer then overwrites the local epoch when it "catches up", and only this tells what
    the parameters really are.

    It also refuses a state that is not whole. hivemind takes whatever tensors a download
    stream delivered before it ended, and loads the optimizer's statistics by the indices in the
    metadata: a stream cut short raised IndexError out of `load_state_from_peers` (seen on the
    demo's monitor, whose final evaluation then crashed), and a donor may send anything."""

    loaded_epoch: Optional[int] = None

    def load_state_from_peers(self, *args: Any, **kwargs: Any):
        loaded = super().load_state_from_peers(*args, **kwargs)
        if loaded is not None and not self._whole(*loaded):
            log.warning("downloaded state is incomplete or malformed; not loading it",
                        extra={"fields": {"tensors": len(loaded[1]) if isinstance(loaded[1], (list, tuple)) else None}})
            loaded = None
        epoch = loaded[0].get("epoch") if loaded is not None else None
        self.loaded_epoch = epoch if isinstance(epoch, int) else None
        return loaded

    def _whole(self, metadata: Any, tensors: Any) -> bool:
        """Whether a downloaded (metadata, tensors) holds every parameter, extra tensor and
        optimizer statistic that a TrainingStateAverager's state has."""
        if not isinstance(metadata, dict) or not isinstance(tensors, (list, tuple)):
            return False
        parameters = sum(len(group["params"]) for group in self.optimizer.param_groups) + len(self.extra_tensors)
        statistics = metadata.get("optimizer_metadata")
        if not isinstance(statistics, list) or len(tensors) < parameters:
            return False
        indices = [entry.get("index") for entry in statistics if isinstance(entry, dict) and entry.get("type") == "tensor"]
        return all(isinstance(i, int) and 0 <= i < len(tensors) - parameters for i in indices)


class FiniteStateAverager(TrainingStateAverager, _LoadedEpoch):
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

    def step(self, *args: Any, averaging_round: bool = False, increment_epoch: bool = False, **kwargs: Any):
        if averaging_round:  # hivemind averages the state of the epoch this call moves to
            self._averaged_epoch = self.local_epoch + int(increment_epoch)
        return super().step(*args, averaging_round=averaging_round, increment_epoch=increment_epoch, **kwargs)

    def _apply_averaging_results_(self):
        """hivemind's, refusing two kinds of average. One that is not finite. And a stale one:
        hivemind applies a background round's average whenever it has finished, and one that
        finished after this peer's next optimizer step replaced that step's update with the
        parameters from before it (an exact replica then differed from its groupmates by one
        step's update, until later rounds pulled it back)."""
        if self.local_epoch != getattr(self, "_averaged_epoch", self.local_epoch):
            log.info("parameter average of an earlier step arrived late; keeping the local state",
                     extra={"fields": {"averaged_epoch": self._averaged_epoch, "epoch": self.local_epoch}})
            return
        with self.get_tensors() as averaged:
            finite = all(bool(torch.isfinite(tensor).all()) for tensor in averaged)
        if not finite:
            log.error("averaged parameters are not finite; keeping the local ones")
            return
        super()._apply_averaging_results_()


# hivemind names RPC handlers after the servicer's class: keep hivemind's name, so that peers
# (the monitor's plain TrainingStateAverager too) meet and download state from this one
FiniteStateAverager.__name__ = TrainingStateAverager.__name__


EXACT_STATE_SECONDS = 30.0  # how long a loading peer insists on the collaboration's current step
EXACT_STATE_RETRY = 0.25


def load_again(held: int, loaded: Optional[int], global_epoch: int) -> bool:
    """Whether a replica whose parameters were at epoch `held` before it downloaded a state at
    epoch `loaded` (None: it got none) should download again: only when it took the state
    (hivemind refuses one older than its own) and its donor is still finishing the
    collaboration's step. Donors are tried newest first, so a state further behind means that
    nobody holds a newer one, and waiting brings none."""
    return loaded is not None and held <= loaded == global_epoch - 1


def lost_steps(held: int, loaded: Optional[int], global_epoch: int) -> bool:
    """Whether the newest state any peer could give is more than a step behind the
    collaboration: whoever held the current one left (a restarted trainer's peers may hold
    only the state it started from). hivemind then loads state at every step, forever."""
    return loaded is not None and max(held, loaded) < global_epoch - 1


class InstrumentedOptimizer(hivemind.Optimizer):
    """hivemind's Optimizer feeding SwarmMetrics, with the guards in the module docstring."""

    def __init__(self, *args: Any, metrics: SwarmMetrics, expected_peers: int = 1,
                 state_aggregation: Optional[CenteredClip] = None, parameters_every: Optional[int] = None,
                 **kwargs: Any):
        self.metrics = metrics
        # average parameters on the gradient round's group every this many steps (`StateRound`);
        # hivemind's own parameter rounds (average_state_every) are then to be off
        self.parameters_every = parameters_every
        self.state_aggregation = state_aggregation  # the parameter averages' (None: hivemind's mean)
        self.expected_peers = expected_peers
        self.last_round: dict[str, Any] = {}
        self._bytes_seen = (0.0, 0.0)
        self.state_loads = 0
        self._check_average = self._rejected_average = False
        self.clock = StepClock(time.time())  # where this peer's steps spend their time
        self._out_of_sync = False  # its latest round failed: reload before computing again
        self.stalled_seconds = 0.0  # in steps and state loads: the time this peer did not compute
        self._accumulation: Optional[float] = None  # seconds this peer's latest step took to accumulate
        super().__init__(*args, **kwargs)
        self.tracker.groupmate_began = self._groupmate_began

    def _groupmate_began(self) -> bool:
        """A member of this step's formed group began its all-reduce: step now (see
        `PlannedAverager.groupmate_began`)."""
        control, averager = self.scheduled_grads, self.grad_averager
        return control is not None and isinstance(averager, PlannedAverager) and averager.groupmate_began(control)

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

    def _make_gradient_averager(self, factory, **kwargs: Any):
        """hivemind's, with the parameter round on its groups when `parameters_every` is set."""
        if self.parameters_every is not None:
            kwargs["state_round"] = StateRound(self.state_averager.main_parameters, due=self._parameters_due,
                                               epoch=lambda: self.local_epoch)
        return super()._make_gradient_averager(factory, **kwargs)

    def _parameters_due(self) -> Optional[int]:
        """The epoch whose step this peer would also average parameters at, if it scheduled its
        round now; None when not due, for an auxiliary (it has no replica to share), and for a
        replica out of sync (it reloads before it computes again)."""
        epoch = self.local_epoch
        if self.auxiliary or self._out_of_sync or (epoch + 1) % self.parameters_every:
            return None
        return epoch

    @property
    def _state_round(self) -> Optional[StateRound]:
        return getattr(self.grad_averager, "state_round", None)

    def _make_progress_tracker(self, target_batch_size: int, **kwargs: Any) -> ProgressTracker:
        return BatchBoundTracker(
            dht=self.dht, prefix=self.run_id, target_batch_size=target_batch_size, client_mode=self.client_mode,
            status_loglevel=self.status_loglevel, start=True, expected_peers=self.expected_peers, **kwargs,
        )

    def load_state_from_peers(self, **kwargs: Any) -> None:
        """hivemind's, but only the collaboration's current state will do. hivemind accepts a
        state one step behind the global step and just renumbers it ("catching up"), so a
        peer that joins or restarts while its donor is still finishing a step computes on the
        previous parameters: its gradients then averaged with a step it never took, and in a
        demo run with a restarted trainer most later rounds lost it. Here a state behind the
        global step is downloaded again (its donor has usually finished the step by then),
        for up to `EXACT_STATE_SECONDS`; after that hivemind's catching up stands. A state
        older than this replica's own, which hivemind refuses, ends the wait: donors are tried
        newest first, so nobody holds a newer one (say a peer restarted from scratch while the
        one that held the current state died)."""
        self.state_loads += 1
        self.metrics.state_loads.inc()
        began, deadline = time.perf_counter(), time.monotonic() + EXACT_STATE_SECONDS
        held = self.local_epoch  # the epoch this replica's parameters are at
        super().load_state_from_peers(**kwargs)
        while True:
            loaded = self.state_averager.loaded_epoch
            if not load_again(held, loaded, self.tracker.global_epoch) or time.monotonic() > deadline:
                break
            held = loaded
            log.info("the state loaded is behind the collaboration; loading it again",
                     extra={"fields": {"loaded_epoch": loaded, "global_epoch": self.tracker.global_epoch}})
            time.sleep(EXACT_STATE_RETRY)
            self.state_averager.local_epoch = loaded  # undo the renumbering, or the next state is refused
            super().load_state_from_peers(**kwargs)
        if lost_steps(held, self.state_averager.loaded_epoch, self.tracker.global_epoch):
            log.warning("no peer holds the collaboration's state any more; going on from the newest one held",
                        extra={"fields": {"epoch": self.local_epoch, "global_epoch": self.tracker.global_epoch}})
            self._renumber(self.tracker.global_epoch)
        if self._out_of_sync:
            self._out_of_sync = False
            self.state_averager.allow_state_sharing = not self.auxiliary
        self.stalled_seconds += time.perf_counter() - began
        self.clock.restart(time.time())

    def _renumber(self, epoch: int) -> None:
        """This replica's state counts as the collaboration's at `epoch` (as hivemind's catching up)."""
        self.state_averager.local_epoch = epoch
        self.tracker.report_local_progress(local_epoch=epoch, samples_accumulated=0)
        if not self.client_mode:
            self.state_averager.state_sharing_priority = epoch
            if self.use_gradient_averaging:
                self.grad_averager.state_sharing_priority = epoch

    def _should_load_state_from_peers(self) -> bool:
        return self._out_of_sync or super()._should_load_state_from_peers()

    def _update_global_epoch(self, grad_scaler) -> None:
        if self._missed_the_step():
            # The collaboration took the step this replica accumulated for without it: its
            # gradients were computed at parameters the others have left. hivemind would let it
            # "catch up" into the next round with them, stepping from its old parameters (the
            # replicas then drift apart); instead it drops them and takes the current state.
            log.info("the collaboration stepped without this replica; loading its state",
                     extra={"fields": {"epoch": self.local_epoch, "global_epoch": self.tracker.global_epoch}})
            self.load_state_from_peers()
            return
        self._round_recorded = False
        epoch = self.local_epoch
        self._accumulation = self.clock.triggered(time.time())
        state_round = self._state_round
        if state_round is not None and self._parameters_due() == epoch:
            state_round.load(self.state_averager.main_parameters, epoch)
        rounds_before, began = self._rounds_done(), time.perf_counter()
        super()._update_global_epoch(grad_scaler)
        self.stalled_seconds += time.perf_counter() - began
        if self.use_gradient_averaging and not self._round_recorded:
            # hivemind steps alone (no all-reduce) when it sees no other peer
            self._record_round("skipped", 1, 0.0, epoch)
        last = self._planned_round
        allreduce = (last.started, last.finished) if last is not None and last.rounds > rounds_before else None
        self.clock.ended(time.time(), allreduce if self.last_round.get("outcome") == "success" else None)
        outcome = self.last_round.get("outcome")
        if outcome == "resync" or (outcome == "failure" and self.tracker.global_progress.num_peers > 1):
            # hivemind stepped on this peer's local gradients (the others stepped on their group's
            # average), or the group found this replica apart from theirs: take their state before
            # the next batch, and share none meanwhile.
            self._out_of_sync = True
            self.state_averager.allow_state_sharing = False
        if self.clock.median is not None:
            for name, value in self.clock.median.to_json().items():
                self.metrics.step_phase_seconds.labels(name).set(value)

    def _missed_the_step(self) -> bool:
        """Whether the collaboration is past this replica's epoch while replicas are kept in
        lockstep (parameter rounds on the gradient rounds' groups; with DPU, updates are late
        by design and hivemind's catching up stands)."""
        return (self.parameters_every is not None and not self.auxiliary
                and self.tracker.global_epoch > self.local_epoch and self.tracker.global_progress.num_peers > 1)

    @property
    def _planned_round(self) -> Optional[PlannedRound]:
        """The gradient averager's latest round, as its process reported it (None before one)."""
        return self.grad_averager.last_round if isinstance(self.grad_averager, PlannedAverager) else None

    def _rounds_done(self) -> int:
        last = self._planned_round
        return last.rounds if last is not None else 0

    def _maybe_schedule_gradient_averaging(self) -> None:
        """hivemind's rule (look for a group once the step's end is under `matchmaking_time`
        away), with the end also estimated from how long this peer's previous step took to
        accumulate, and not while this peer is alone.

        hivemind's estimate comes from the progress records alone, and right after a step it is
        unknown until the next fetch: on a swarm whose steps accumulate in under a second, every
        peer began matchmaking only when its step was due, and the round waited for the last
        groupmate to find the group (0.4-0.8 s of a demo step). Begun early, the group is whole
        when the batch is (see `PlannedAverager._step`).

        Alone, hivemind schedules a round before each epoch's end only to cancel it at the end
        ("no other peers"), and a cancel that races the averager's matchmaking can leave the
        averager's matchmaking wedged: in 2 of about 10 runs of the volunteers suite the swarm's
        lone trainer, its first scheduled round cancelled, never formed a group again ("could not
        find a group" every round with the volunteer that joined later)."""
        if self.tracker.global_progress.num_peers <= 1:
            return
        control = self.scheduled_grads
        free = control is None or control.triggered or control.done()
        if free and self._accumulation is not None:
            if self.clock.accumulating_for(time.time()) + self.matchmaking_time >= self._accumulation:
                self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
                return
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
        diverged: list[str] = []
        group_id: Optional[str] = None
        missing = 0
        if maybe_step_control is None:
            outcome, group_size = "skipped", 1
        elif self._rejected_average:
            outcome, group_size = "failure", 0
        elif maybe_step_control.done() and maybe_step_control.exception() is None:
            ordered = list(maybe_step_control.result())  # the group's order: the round's report indexes it
            members = sorted(str(peer) for peer in ordered)
            outcome, group_size = "success", len(members)
            last = self._planned_round
            diverged = sorted(str(ordered[i]) for i in (last.diverged if last is not None else ()) if i < len(ordered))
            group_id = last.group_id if last is not None else None
            missing = self._missing_elements()
            if str(self.dht.peer_id) in diverged:
                # the group found this replica apart from the one most members hold: its gradients
                # went in with weight 0; it steps on nothing and reloads the state
                outcome = "resync"
                self._drop_update()
                self.metrics.replica_resyncs.inc()
                log.warning("this replica differs from its group's; it skips the update and reloads the state",
                            extra={"fields": {"members": len(members)}})
            elif missing:
                # hivemind keeps this peer's own values where a part of the average never came
                # back and calls the round a success. A failure for this peer: it steps on nothing
                # (see _drop_update) and reloads before computing again.
                outcome = "failure"
                self._drop_update()
                log.warning("part of the averaged gradients never came back; this replica skips the "
                            "update and reloads the state",
                            extra={"fields": {"missing_elements": missing, "members": len(members)}})
        else:
            outcome, group_size = "failure", 0
        parameters = self._take_averaged_parameters(outcome)
        self._record_round(outcome, group_size, seconds, self.local_epoch, members, missing, parameters, diverged,
                           group_id)

    def _take_averaged_parameters(self, outcome: str) -> Optional[str]:
        """After a successful round, this replica's parameters become the group's average when
        the step's parameter round completed here; returns that round's outcome (None: none ran)."""
        state_round = self._state_round
        if state_round is None:
            return None
        if outcome != "success":  # this replica reloads (or stepped alone): the average is not for it
            state_round.discard()
            return None
        result = state_round.take(self.state_averager.main_parameters)
        if result is not None:
            self.metrics.parameter_rounds.labels(result).inc()
        if result == "failed":
            log.info("parameter round incomplete here; keeping the local parameters")
        return result

    def _drop_update(self) -> None:
        """Zero the gradients the optimizer is about to step on. On a mix of the average and its
        own gradients (what hivemind leaves) this replica would step apart from every other; on
        nothing, it stays equal to every member that lost a part too. Where some members got the
        whole average, this one reloads their state; where every member lost a part (seen in
        CI: the replicas then drifted apart for good, with no state left to reload), the
        replicas all skip the step and stay equal."""
        self.state_averager.optimizer.zero_grad(set_to_none=False)

    def _missing_elements(self) -> int:
        """Elements of the latest all-reduce's average that this peer never got back."""
        last = self._planned_round
        return last.missing_elements if last is not None else 0

    def _record_round(self, outcome: str, group_size: int, seconds: float, epoch: int,
                      members: list[str] = (), missing_elements: int = 0, parameters: Optional[str] = None,
                      diverged: Sequence[str] = (), group_id: Optional[str] = None) -> None:
        self._round_recorded = True
        self.metrics.averaging_rounds.labels(outcome).inc()
        if outcome == "success":
            self.metrics.averaging_round_duration.observe(seconds)
            self.metrics.averaging_group_size.set(group_size)
        self.last_round = {"outcome": outcome, "groupSize": group_size, "seconds": round(seconds, 4), "epoch": epoch,
                           "time": time.time(), "members": list(members) or [str(self.dht.peer_id)]}
        if missing_elements:  # a round the group finished but this peer got only part of
            self.last_round["missingElements"] = missing_elements
        if parameters is not None:  # the step's parameter round: "averaged" or "failed"
            self.last_round["parameters"] = parameters
        if diverged:  # members whose replica differed from the group's: their gradients had weight 0
            self.last_round["diverged"] = list(diverged)
        if group_id:  # names the round alike at every member
            self.last_round["group"] = group_id
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
