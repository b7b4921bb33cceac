"""All-reduce with an averaging plan's shares instead of hivemind's bandwidth split.

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
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import logging
import math
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import hagenbach_bishoff, load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously
from hivemind.utils.timed_storage import get_dht_time

__all__ = ["PLAN_KEY", "PlannedAverager", "PlannedRound", "plan_digest", "planned", "planned_fractions",
           "shares_by_peer_id"]

log = logging.getLogger("hivekeeper.planned_averaging")

MIN_WINDOW_PARTS = 4
PLAN_KEY = "hivekeeper.plan"  # marks a gathered entry: {PLAN_KEY: [digest, share], "gather": user data}
_CLIENT, _AUX = AveragingMode.CLIENT.value, AveragingMode.AUX.value
# fields of the shared report
_ROUNDS, _PLANNED, _ELEMENTS, _STARTED, _FINISHED, _GROUP, _MISSING, _PLANNED_ROUNDS = range(8)


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

    @property
    def seconds(self) -> float:
        return self.finished - self.started


class _PlannedRunner(AllReduceRunner):
    """Results wait for the end of sending only for client-mode members, and every flow to an
    aggregator keeps at most `window` parts unanswered (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        container = self.tensor_part_container
        self._answered = [0] * self.group_size  # averaged parts received back, per aggregator
        self._credit = [asyncio.Event() for _ in range(self.group_size)]
        register_processed, register_failed = container.register_processed_part, container.register_failed_reducer

        def processed(peer_index: int, part_index: int, part) -> None:
            register_processed(peer_index, part_index, part)
            self._answered[peer_index] += 1
            self._credit[peer_index].set()

        def failed(peer_index: int) -> None:
            register_failed(peer_index)
            self._answered[peer_index] = math.inf  # never block a flow whose aggregator is gone
            self._credit[peer_index].set()

        container.register_processed_part, container.register_failed_reducer = processed, failed

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
        window, sent = self.window(peer_index), 0
        async for message in messages:
            while sent - self._answered[peer_index] >= window:
                self._credit[peer_index].clear()
                await self._credit[peer_index].wait()
            yield message
            sent += 1


class PlannedAverager(DecentralizedAverager):
    """DecentralizedAverager whose groups split the vector per a plan; see the module
    docstring. Combine with other averager classes through `planned(cls)`."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._plan: Optional[tuple[dict[str, float], float, str]] = None  # shares, expiry (DHT time), digest
        # created before super().__init__, which may fork the child: the child writes, the parent reads
        self._report = mp.get_context("fork").Array(ctypes.c_double, 8)
        super().__init__(*args, **kwargs)

    def set_plan(self, shares: Mapping[str, float], expires_at: float) -> None:
        """Use `shares` (peer id -> share) in groups that start matchmaking before `expires_at`
        (DHT time); later steps fall back to hivemind's split until the next plan."""
        shares = {str(peer): float(share) for peer, share in shares.items()}
        self._plan = (shares, float(expires_at), plan_digest(shares))

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
                            missing_elements=int(report[_MISSING]), planned_rounds=int(report[_PLANNED_ROUNDS]))

    def step(self, gather: Any = None, *args: Any, **kwargs: Any):
        """hivemind's step; the gathered data carries this peer's plan entry while the plan is valid."""
        plan = self._plan
        if plan is not None and get_dht_time() < plan[1]:
            shares, _, digest = plan
            gather = {PLAN_KEY: [digest, shares.get(str(self.peer_id))], "gather": gather}
        return super().step(gather, *args, **kwargs)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any):
        """DecentralizedAverager's, with the fractions from the members' plan entries when they agree."""
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            if all(mode == _AUX for mode in mode_ids):
                # Auxiliaries that met before any sender (two of them suffice for a group) would
                # "average" nothing and move on, leaving the senders without aggregators: fail the
                # group, so that they look again (hivemind retries until the step's deadline).
                raise MatchmakingException("no member of the group sends data")
            entries, user_data = zip(*(_unwrap(self.serializer.loads(data)) for data in user_bytes))
            fractions = planned_fractions(entries, mode_ids, self.total_size, min_vector_size)
            if fractions is None:
                download = [bw if mode != _CLIENT else 0.0 for bw, mode in zip(bandwidths, mode_ids)]
                fractions = await asyncio.get_event_loop().run_in_executor(
                    None, load_balance_peers, self.total_size, download, min_vector_size)
                planned_kwargs = {}
            else:
                planned_kwargs = dict(modes=tuple(map(AveragingMode, mode_ids)))
            started = time.time()
            async with enter_asynchronously(self.get_tensors()) as local_tensors:
                await self._run_allreduce_inplace_(local_tensors, group_info, peer_fractions=fractions,
                                                   **planned_kwargs, **kwargs)
            with self._report.get_lock():
                report = self._report
                report[_PLANNED], report[_STARTED], report[_FINISHED] = bool(planned_kwargs), started, time.time()
                report[_ELEMENTS], report[_GROUP] = self._aggregated_elements, len(group_info.peer_ids)
                report[_MISSING] = self._missing_elements
                report[_ROUNDS] += 1
                report[_PLANNED_ROUNDS] += bool(planned_kwargs)
            return dict(zip(group_info.peer_ids, user_data))
        except MatchmakingException:
            raise
        except BaseException as e:
            if isinstance(e, Exception):
                log.exception(e)
            raise MatchmakingException(f"Unable to run All-Reduce: {e}")

    async def _run_allreduce_inplace_(self, tensors, group_info: GroupInfo, group_id: Optional[bytes] = None,
                                      **kwargs: Any):
        """DecentralizedAverager's, but planned rounds (the ones that pass modes) use `_PlannedRunner`,
        and the elements this peer aggregates (and any it never got back) are reported."""
        group_id = group_info.group_id if group_id is None else group_id
        runner_type = _PlannedRunner if kwargs.get("modes") is not None else AllReduceRunner
        runner = runner_type(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                             group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        self._aggregated_elements = sum(part.numel() for part in runner.parts_for_local_averaging)

        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
        self._missing_elements = runner.tensor_part_container.failed_size


def _unwrap(data: Any) -> tuple[Optional[list], Any]:
    if isinstance(data, dict) and PLAN_KEY in data:
        return data[PLAN_KEY], data.get("gather")
    return None, data


def planned(averager_class: type) -> type:
    """`averager_class` (a DecentralizedAverager subclass, e.g. hivemind's GradientAverager or
    hivekeeper's CountingGradientAverager) with PlannedAverager placed right above
    DecentralizedAverager in its MRO, so that the subclass's own overrides still run first."""
    if issubclass(averager_class, PlannedAverager):
        return averager_class
    if averager_class is DecentralizedAverager:
        return PlannedAverager
    return type(f"Planned{averager_class.__name__}", (averager_class, PlannedAverager), {})
