"""All-reduce with an averaging plan's shares instead of hivemind's bandwidth split, and byte counting.

For every all-reduce group, hivemind's DecentralizedAverager decides which fraction of the
vector each member aggregates (`peer_fractions`, from `load_balance_peers` over bandwidths
typed in by hand). `PlannedAverager` takes them from a plan instead: a mapping
peer id -> share (DeDLOC eq. 6, from `hivekeeper.planning.averaging_lp.plan_averaging`).
The group's members keep their shares, client-mode members get 0 (they accept no
connections, and hivemind asserts it), and the rest is renormalized. hivemind's split is
used when a member holds no valid plan (none set, or expired), when the plan does not name
every member, or when members hold different plans.

Hand-off to the child. The plan is set in the parent process, the all-reduce runs in the
averager's forked child, and every member of the group must derive *identical* fractions,
or their partitions disagree and the round breaks. So `step()`, in the parent, checks the
plan's expiry and wraps this peer's entry (the plan's digest and its own share) into the
data hivemind already gathers in matchmaking. It reaches the child through hivemind's own
step pipe and every other member through the group's gathered data, which is the same at
all members; the child uses the plan only if all entries carry the same digest. The
decision is thus a pure function of data every member sees alike. Shared memory or the DHT
would also get the plan to the child, but each member would read its copy at its own
moment (an update or an expiry in between splits the group), and the members would still
need the gathered data to agree. A plan that changes costs at most one round on hivemind's
split. Members without this class gather no entry, so mixed groups fall back too.

Timing. hivemind delays the results for a member with a zero fraction until it has sent
everything (meant for client-mode peers behind asymmetric links); for a planned member that
aggregates nothing but accepts connections that serializes its upload and download and
doubles its time, which the plan does not assume. Planned rounds therefore delay results for
client-mode members only (`_PlannedRunner`), and pass the members' modes to the runner so
that auxiliary peers aggregate without sending zeros (hivemind 1.1.12 drops the modes).

Flow window. The plan assumes a peer uploads and downloads at once, at full rate. In
hivemind's all-reduce an aggregator answers part k only when every sender's part k has
arrived, and each sender pushes its flows to all aggregators as fast as TCP lets it, with
megabytes of buffers (p2pd, yamux, sockets) behind each flow. TCP splits a slow peer's
upload unevenly among its flows, so an aggregator's slowest sender holds back the answers to
everyone, and a slow peer's averages arrive after its upload has ended: on shaped links
(bench/bench_averaging_netns.py) planned rounds took 1.2-1.4x the plan's time. In planned
rounds a flow therefore keeps at most `window` parts unanswered (1/16 of the flow, at least
4): a sender that runs ahead at one aggregator waits, and its upload goes to the flows that
lag. The answers then clock the uploads, downloads overlap them, and the rounds took
0.95x the plan's time (measured inputs). Client-mode members, answered only after their last
part, are not windowed.

The child reports each finished round (planned or not, elements it aggregated, start and
end, elements whose average never arrived) through a small shared array created before the
fork: `last_round`.

Byte counting. `CountingGradientAverager` counts the bytes of tensor parts each all-reduce
moves, in counters that live in shared memory for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import json
import logging
import math
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import hagenbach_bishoff
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.control import StepControl
from hivemind.optim.grad_averager import GradientAverager
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import enter_asynchronously

from hivekeeper.hivemind_ext import check_hivemind_version
from hivekeeper.hivemind_ext.group_round import (AcknowledgingRunner, Group, abandon_on_failure, add_averages,
                                                   bandwidth_split, start_runner)
from hivekeeper.hivemind_ext.robust import CenteredClip, robust_runner
from hivekeeper.hivemind_ext.state_round import STATE_ROUND_SUFFIX, StateEntry, StateRound, agreed_epoch, group_verdict

check_hivemind_version(__name__)

__all__ = ["CountingGradientAverager", "PLAN_KEY", "PlannedAverager", "PlannedCountingGradientAverager",
           "PlannedRound", "plan_digest", "planned", "planned_fractions", "shares_by_peer_id"]

log = logging.getLogger("hivekeeper.planned_averaging")

MIN_WINDOW_PARTS = 4
NOTICE_TIMEOUT = 2.0  # seconds for a groupmate-began notice
PLAN_KEY = "hivekeeper.plan"  # marks a gathered entry: {PLAN_KEY: [digest, share, group size], "gather": user data}
STATE_KEY = "hivekeeper.state"  # the parameter round's entry beside it (`state_round.StateEntry`)
_CLIENT, _AUX = AveragingMode.CLIENT.value, AveragingMode.AUX.value
# fields of the shared report
_ROUNDS, _PLANNED, _ELEMENTS, _STARTED, _FINISHED, _GROUP, _MISSING, _PLANNED_ROUNDS, _DIVERGED, _GROUP_ID = range(10)


def plan_digest(shares: Mapping[str, float]) -> str:
    """Names a plan by its shares only, so republishing it with a later expiry keeps groups agreeing."""
    canonical = json.dumps(sorted((str(peer), float(share)) for peer, share in shares.items()))
    return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


def planned_fractions(entries: Sequence[Optional[Sequence[Any]]], modes: Sequence[int], total_size: int,
                      min_vector_size: int = 0) -> Optional[tuple[int, ...]]:
    """Elements each member aggregates, from the members' gathered entries ([digest, share]
    or None) and averaging modes; None means "use hivemind's split"."""
    if not entries or any(entry is None for entry in entries) or len({entry[0] for entry in entries}) != 1:
        return None  # someone holds no valid plan, or members hold different ones
    shares = [entry[1] for entry in entries]
    if any(share is None or not math.isfinite(share) or share < 0 for share in shares):
        return None  # the plan does not cover this group
    shares = [0.0 if mode == _CLIENT else float(share) for share, mode in zip(shares, modes)]
    total = sum(shares)
    if total <= 0:
        return None  # the plan's aggregators are not in this group
    shares = [share / total for share in shares]
    if min_vector_size and max(shares) * total_size >= min_vector_size:  # hivemind's rule for tiny parts
        shares = [share if share * total_size >= min_vector_size else 0.0 for share in shares]
    return tuple(hagenbach_bishoff(total_size, shares))


def shares_by_peer_id(plan, peer_ids: Mapping[str, str]) -> dict[str, float]:
    """An AveragingPlan's shares keyed by peer id instead of the plan's peer names."""
    return {peer_ids[role.name]: role.aggregation_share for role in plan.peers if role.name in peer_ids}


@dataclass(frozen=True)
class PlannedRound:
    rounds: int  # finished all-reduce rounds so far
    planned: bool  # the last one used the plan's shares
    aggregated_elements: int  # vector elements this peer aggregated in it
    started: float  # time.time() when its all-reduce began (after matchmaking) and ended
    finished: float
    group_size: int
    # elements whose average never arrived (a groupmate failed mid-round): hivemind keeps this
    # peer's own values there, logs "received 99.x% results" and still reports success
    missing_elements: int = 0
    planned_rounds: int = 0  # how many of `rounds` used a plan's shares
    # members (indices in the group's order) whose replica differed from the group's: they sent
    # their gradients with weight 0 and reload the state (see `state_round`)
    diverged: frozenset[int] = frozenset()
    group_id: str = ""  # the group's id (its first 6 bytes, hex): the same at every member of the round

    @property
    def seconds(self) -> float:
        return self.finished - self.started


_MASK_BITS = 52  # member indices a report's double holds exactly (groups are far smaller)


def _mask(indices: frozenset[int]) -> float:
    return float(sum(1 << i for i in indices if i < _MASK_BITS))


def _members(mask: int) -> frozenset[int]:
    return frozenset(i for i in range(_MASK_BITS) if mask >> i & 1)


class _PlannedRunner(AcknowledgingRunner):
    """Results wait for the end of sending only for client-mode members, and every flow to an
    aggregator keeps at most `window` parts unanswered (see the module docstring)."""

    def should_delay_results(self, peer_id) -> bool:
        return self.modes[self.ordered_peer_ids.index(peer_id)] == AveragingMode.CLIENT

    def window(self, peer_index: int) -> int:
        """Parts a flow may have unanswered: 1/16 of it, at least 4 (enough to keep a link
        busy while a part goes round; a part is hivemind's part_size_bytes)."""
        return max(MIN_WINDOW_PARTS, math.ceil(self.tensor_part_container.num_parts_by_peer[peer_index] / 16))

    async def _generate_input_for_peer(self, peer_index: int):
        messages = super()._generate_input_for_peer(peer_index)
        if self.should_delay_results(self.peer_id):  # answers come only after the last part
            async for message in messages:
                yield message
            return
        window, sent, parts = self.window(peer_index), 0, self.tensor_part_container
        async for message in messages:
            await parts.wait_for_answers(peer_index, sent - window + 1)
            yield message
            sent += 1


class PlannedAverager(DecentralizedAverager):
    """DecentralizedAverager whose groups split the vector per a plan; see the module
    docstring. Combine with other averager classes through `planned(cls)`."""

    def __init__(self, *args: Any, aggregation: Optional[CenteredClip] = None,
                 state_round: Optional[StateRound] = None, **kwargs: Any):
        # shares, expiry (DHT time), digest, group size
        self._plan: Optional[tuple[dict[str, float], float, str, Optional[int]]] = None
        self._static_group_size: Optional[int] = kwargs.get("target_group_size")
        self._aggregation = aggregation  # None: hivemind's weighted mean
        self.state_round = state_round  # parameters averaged on this averager's groups (see `state_round`)
        # created before super().__init__, which may fork the child: the child writes, the parent reads
        self._report = mp.get_context("fork").Array(ctypes.c_double, _GROUP_ID + 1)
        # the scheduled time of the step whose group a groupmate has begun averaging (see `groupmate_began`)
        self._groupmate_began = mp.get_context("fork").Value(ctypes.c_double, 0.0, lock=False)
        self._formed: Optional[tuple[bytes, StepControl]] = None  # in the child: the group awaiting our trigger
        self._notices: set = set()  # in the child: notices in flight
        super().__init__(*args, **kwargs)

    @classmethod
    def _collect_rpc_handlers(cls) -> None:
        """hivemind caches a servicer's handlers on the first class that collects them, and a
        subclass would inherit that list: collect this class's own (it adds a handler)."""
        if "_rpc_handlers" not in cls.__dict__:
            cls._rpc_handlers = None
        super()._collect_rpc_handlers()

    def groupmate_began(self, control: StepControl) -> bool:
        """In the parent: whether a member of the group formed for `control` has already begun
        its all-reduce while this peer has not. The collaboration then has its global batch (the
        member that began saw it), so this peer may step at once with what it accumulated
        instead of learning it from the DHT's progress records a fetch later (0.25-2 s)."""
        return not control.triggered and self._groupmate_began.value == control.scheduled_time

    def set_plan(self, shares: Mapping[str, float], expires_at: float, group_size: Optional[int] = None) -> None:
        """Use `shares` (peer id -> share) in groups that start matchmaking before `expires_at`
        (DHT time); later steps fall back to hivemind's split until the next plan. With
        `group_size` (the plan's), such a step's group is assembled as soon as that many
        members joined, instead of at the end of the matchmaking window."""
        shares = {str(peer): float(share) for peer, share in shares.items()}
        self._plan = (shares, float(expires_at), plan_digest(shares), group_size)

    def clear_plan(self) -> None:
        self._plan = None

    @property
    def last_round(self) -> Optional[PlannedRound]:
        with self._report.get_lock():
            report = list(self._report)
        if not report[_ROUNDS]:
            return None
        return PlannedRound(rounds=int(report[_ROUNDS]), planned=bool(report[_PLANNED]),
                            aggregated_elements=int(report[_ELEMENTS]), started=report[_STARTED],
                            finished=report[_FINISHED], group_size=int(report[_GROUP]),
                            missing_elements=int(report[_MISSING]), planned_rounds=int(report[_PLANNED_ROUNDS]),
                            diverged=_members(int(report[_DIVERGED])), group_id=f"{int(report[_GROUP_ID]):012x}")

    def step(self, gather: Any = None, *args: Any, **kwargs: Any):
        """hivemind's step; the gathered data carries this peer's plan entry while the plan is
        valid, and its parameter-round entry when it has a state round."""
        plan, entries = self._plan, {}
        if plan is not None and get_dht_time() < plan[1]:
            shares, _, digest, group_size = plan
            entries[PLAN_KEY] = [digest, shares.get(str(self.peer_id)), group_size]
        if self.state_round is not None:
            entries[STATE_KEY] = self.state_round.entry()
        if entries:
            gather = {**entries, "gather": gather}
        return super().step(gather, *args, **kwargs)

    async def _step(self, *, step, **kwargs: Any):
        """hivemind's step, in the averager's process; a step that carries a plan entry with a
        group size leads a group that starts as soon as the plan's group has joined. hivemind
        otherwise assembles only a group of `target_group_size` early, else waits out the whole
        matchmaking window (2 s of a demo step whose all-reduce takes 0.05 s)."""
        self._matchmaking.target_group_size = group_size_for_step(
            self._static_group_size, _unwrap(self.serializer.loads(self.serializer.loads(step.data_for_gather)[2])).plan)
        self._watch_formed_groups()
        return await super()._step(step=step, **kwargs)

    def _watch_formed_groups(self) -> None:
        """Remember the group matchmaking formed for the current step: hivemind registers it
        only once this peer is triggered, so a groupmate's notice before that needs this."""
        if getattr(self._matchmaking, "_hivekeeper_watched", False):
            return
        look_for_group = self._matchmaking.look_for_group

        async def watched(step: StepControl) -> Optional[GroupInfo]:
            self._formed = None
            group_info = await look_for_group(step)
            if group_info is not None:
                self._formed = (group_info.group_id, step)
            return group_info

        self._matchmaking.look_for_group = watched
        self._matchmaking._hivekeeper_watched = True

    def _announce_start(self, group: Group) -> None:
        """Tell every groupmate that accepts connections that this peer began the round."""
        request = averaging_pb2.AveragingData(group_id=group.info.group_id)
        for peer_id, mode in zip(group.info.peer_ids, group.mode_ids):
            if peer_id == self.peer_id or mode == _CLIENT:
                continue
            task = asyncio.create_task(self._notify(peer_id, request))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)

    async def _notify(self, peer_id: PeerID, request: averaging_pb2.AveragingData) -> None:
        try:
            await self.get_stub(self._p2p, peer_id, namespace=self.prefix).rpc_groupmate_began(
                request, timeout=NOTICE_TIMEOUT)
        except Exception as e:  # a notice only saves time: the groupmate's DHT fetch still triggers it
            log.debug("groupmate notice to %s failed: %r", peer_id, e)

    async def rpc_groupmate_began(self, request: averaging_pb2.AveragingData,
                                  context: P2PContext) -> averaging_pb2.AveragingData:
        """A groupmate began the round of the group this peer awaits its trigger in."""
        formed = self._formed
        if formed is not None and request.group_id == formed[0] and not formed[1].triggered:
            self._groupmate_began.value = formed[1].scheduled_time
        return averaging_pb2.AveragingData()

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """hivemind's, registering the parameter round's id as well (with a state round): a
        groupmate that begins that round first then waits for this peer's runner."""
        if self.state_round is None:
            with super()._register_allreduce_group(group_info):
                yield
            return
        state_id = group_info.group_id + STATE_ROUND_SUFFIX
        self._running_groups[state_id] = asyncio.Future()
        try:
            with super()._register_allreduce_group(group_info):
                yield
        finally:
            future = self._running_groups.pop(state_id, None)
            if future is not None and not future.done():
                future.cancel()  # no parameter round here: a groupmate waiting for one fails fast

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any):
        """hivemind's step (`group_round`), with the fractions from the members' plan entries when
        they agree, then the parameter round when the members agree on one."""
        began = time.monotonic()
        with abandon_on_failure(report=log.exception):
            group = Group.read(self, group_info)
            if all(mode == _AUX for mode in group.mode_ids):
                # Auxiliaries that met before any sender (two of them suffice for a group) would
                # "average" nothing and move on, leaving the senders without aggregators: fail the
                # group, so that they look again (hivemind retries until the step's deadline).
                raise MatchmakingException("no member of the group sends data")
            self._announce_start(group)
            gathered = [_unwrap(data) for data in group.gathered]
            user_data = [entry.user for entry in gathered]
            states = [StateEntry.read(entry.state) for entry in gathered]
            verdict = group_verdict(states, group.mode_ids) if self.state_round is not None else None
            me = group_info.peer_ids.index(self.peer_id)
            diverged = verdict is not None and me in verdict.diverged
            if diverged:  # its gradients were computed at other parameters: none of them in the average
                kwargs = dict(kwargs, weight=0.0)
            if verdict is not None and verdict.diverged:
                log.warning("replicas in the group differ", extra={"fields": {
                    "diverged": [str(group_info.peer_ids[i]) for i in sorted(verdict.diverged)],
                    "this_peer_diverged": diverged}})
            fractions = planned_fractions([entry.plan for entry in gathered], group.mode_ids, self.total_size,
                                          min_vector_size)
            planned_kwargs = {} if fractions is None else dict(modes=group.modes)
            if fractions is None:
                fractions = await bandwidth_split(self, group, min_vector_size)
            started = time.time()
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=fractions,
                                                   **planned_kwargs, **kwargs)
            aggregated, missing = self._aggregated_elements, self._missing_elements
            if verdict is not None:
                epoch = agreed_epoch(states, group.mode_ids, self.state_round.layout, verdict)
                if epoch is not None:
                    budget = parameter_round_budget(self._allreduce_timeout, time.monotonic() - began,
                                                    time.time() - started)
                    await self._average_parameters(epoch, group_info, fractions, planned_kwargs, kwargs, budget,
                                                   sends=not diverged)
            with self._report.get_lock():
                report = self._report
                report[_PLANNED], report[_STARTED], report[_FINISHED] = bool(planned_kwargs), started, time.time()
                report[_ELEMENTS], report[_GROUP] = aggregated, group.size
                report[_MISSING] = missing
                report[_DIVERGED] = _mask(verdict.diverged) if verdict is not None else 0
                report[_GROUP_ID] = int.from_bytes(group_info.group_id[:6], "big")  # exact in a double
                report[_ROUNDS] += 1
                report[_PLANNED_ROUNDS] += bool(planned_kwargs)
            return dict(zip(group_info.peer_ids, user_data))

    async def _average_parameters(self, epoch: int, group_info: GroupInfo, fractions: Sequence[int],
                                  planned_kwargs: dict, kwargs: dict, budget: float, sends: bool = True) -> None:
        """The parameter round on the gradient round's group and split (see `state_round`), given
        at most `budget` seconds. Its failure is reported, not raised: the gradient round
        succeeded, and the optimizer then keeps its own parameters. A member that does not send
        (its replica diverged) still aggregates its share, with weight 0 for its own parameters."""
        state = self.state_round
        weight = state.weight(epoch) if sends else 0.0
        kwargs = dict(kwargs, weight=weight, tensor_infos=state.tensor_infos)
        complete = False
        try:
            if budget <= 0:
                raise asyncio.TimeoutError("no time left in the step's all-reduce")
            await asyncio.wait_for(self._run_allreduce_inplace_(
                state.tensors, group_info, group_info.group_id + STATE_ROUND_SUFFIX, peer_fractions=fractions,
                **planned_kwargs, **kwargs), timeout=budget)
            complete = self._missing_elements == 0
        except Exception as e:  # asyncio.TimeoutError too
            log.warning("parameter round failed; keeping the local parameters: %r", e)
        state.report(epoch, complete)

    async def _run_allreduce_inplace_(self, tensors, group_info: GroupInfo, group_id: Optional[bytes] = None,
                                      **kwargs: Any):
        """hivemind's, but planned rounds (the ones that pass modes) use `_PlannedRunner`, a robust
        aggregation (CenteredClip) replaces the mean in planned and fallback rounds alike, and the
        elements this peer aggregates (and any it never got back) are reported."""
        runner_class = _PlannedRunner if kwargs.get("modes") is not None else AllReduceRunner
        if self._aggregation is not None:
            runner_class, kwargs = robust_runner(runner_class), dict(kwargs, aggregation=self._aggregation)
        runner = start_runner(self, tensors, group_info, group_id, runner_class, **kwargs)
        self._aggregated_elements = sum(part.numel() for part in runner.parts_for_local_averaging)
        await add_averages(self, runner, tensors, group_info)
        self._missing_elements = runner.tensor_part_container.failed_size


PARAMETER_ROUND_MIN_SECONDS = 2.0
PARAMETER_ROUND_MARGIN = 1.0  # seconds left for the step to return before hivemind's all-reduce timeout


def parameter_round_budget(allreduce_timeout: Optional[float], elapsed: float, gradient_seconds: float) -> float:
    """Seconds the parameter round may take: as long as a few gradient all-reduces of the same
    vector (at least `PARAMETER_ROUND_MIN_SECONDS`), and never so long that hivemind's timeout on
    the whole step (`allreduce_timeout`, `elapsed` of it spent) cancels it. A parameter round
    still running then would have failed the gradient round that had succeeded (seen: a round
    that lost a member stalled into the timeout, and every trainer reloaded)."""
    budget = max(PARAMETER_ROUND_MIN_SECONDS, 3.0 * gradient_seconds)
    if allreduce_timeout is not None:
        budget = min(budget, allreduce_timeout - elapsed - PARAMETER_ROUND_MARGIN)
    return budget


def group_size_for_step(static: Optional[int], entry: Optional[Sequence[Any]]) -> Optional[int]:
    """The group a step assembles early: the plan's group size (capped by a size set at start),
    or the size set at start for a step without a plan."""
    planned = entry[2] if entry is not None and len(entry) > 2 else None
    if not isinstance(planned, int) or planned < 2:
        return static
    return min(planned, static) if static else planned


class _Gathered(NamedTuple):
    plan: Optional[list]  # [digest, share, group size], or None: no valid plan
    state: Optional[list]  # [epoch or None, layout], or None: no state round
    user: Any  # the data hivemind's caller gathered


def _unwrap(data: Any) -> _Gathered:
    if isinstance(data, dict) and "gather" in data and (PLAN_KEY in data or STATE_KEY in data):
        return _Gathered(data.get(PLAN_KEY), data.get(STATE_KEY), data["gather"])
    return _Gathered(None, None, data)


def planned(averager_class: type) -> type:
    """`averager_class` (a DecentralizedAverager subclass, e.g. hivemind's GradientAverager) with
    PlannedAverager placed right above DecentralizedAverager in its MRO, so that the subclass's
    own overrides still run first; the one the Swarm uses is declared below, by name."""
    if issubclass(averager_class, PlannedAverager):
        return averager_class
    if averager_class is DecentralizedAverager:
        return PlannedAverager
    return type(f"Planned{averager_class.__name__}", (averager_class, PlannedAverager), {})


class CountingGradientAverager(GradientAverager):
    """Counts bytes of tensor parts moved in all-reduce. The all-reduce runs in the averager's
    forked child process, so the counters live in shared memory created before the fork."""

    def __init__(self, *args: Any, wire_bytes_per_element: float = 4.0, **kwargs: Any):
        ctx = mp.get_context("fork")
        self.sent_bytes, self.received_bytes = ctx.Value("d", 0.0), ctx.Value("d", 0.0)
        self.last_round_bytes = ctx.Value("d", 0.0)  # each way, in the latest step's rounds (with its parameters')
        self.wire_bytes_per_element = wire_bytes_per_element
        super().__init__(*args, **kwargs)

    async def _aggregate_with_group(self, *args: Any, **kwargs: Any):
        self.last_round_bytes.value = 0.0
        return await super()._aggregate_with_group(*args, **kwargs)

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
        self.last_round_bytes.value += outbound


class PlannedCountingGradientAverager(CountingGradientAverager, PlannedAverager):
    """The Swarm's gradient averager: counts bytes, splits per the plan (PlannedAverager sits right
    above DecentralizedAverager, so the subclasses' overrides run first). hivemind names RPC
    handlers after the class: every peer of a run must use this one (the name is the wire)."""
