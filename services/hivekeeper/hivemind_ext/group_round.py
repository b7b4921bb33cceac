"""hivemind's averager step for one formed group, in pieces that hivekeeper's averagers share.

In hivemind 1.1.12, `DecentralizedAverager._aggregate_with_group` and `_run_allreduce_inplace_`
do, once matchmaking has formed a group: read what every member gathered (its bandwidth, its
averaging mode and the user's data), split the vector among the members (`load_balance_peers`
over the download bandwidths, 0 for client-mode members), start an `AllReduceRunner` over the
averager's tensors and hand it to the groupmates' RPCs waiting under the group's id, add the
averages to the tensors, and turn any failure into the `MatchmakingException` that makes the
step retry or end. The planned averager (`allreduce`) changes the split and the runner; the
merging averager (`merging`) runs two all-or-nothing rounds on one group. Both build their step
from these pieces instead of each keeping a copy of hivemind's.

Both also run `AcknowledgingRunner`: a sender keeps its request stream to an aggregator open
until the aggregator's last reply has arrived. In hivemind the aggregator's handler ends, and
closes the stream, right after its last reply; libp2p's Close does not wait for delivery, p2pd
then resets the stream, and the sender's side drops a reply still in flight and reads the reset
as a clean end of stream. Under load that lost the last part of a healthy merge (CI: "7
elements never averaged", no sender lost; plain hivemind would keep the sender's own values
there and log "received 99.9% results"). Sent only after the last reply, the sender's end of
stream is the acknowledgment: the aggregator closes once everything has arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)

__all__ = ["AcknowledgingRunner", "Group", "ReplyCounter", "abandon_on_failure", "add_averages", "bandwidth_split",
           "bytes_sent", "start_runner"]

@dataclass(frozen=True)
class Group:
    """A formed group as matchmaking gathered it, members in the group's order."""

    info: GroupInfo
    bandwidths: tuple[float, ...]
    mode_ids: tuple[int, ...]  # AveragingMode values
    gathered: tuple[Any, ...]  # each member's user data

    @classmethod
    def read(cls, averager: DecentralizedAverager, info: GroupInfo) -> "Group":
        loads = averager.serializer.loads
        bandwidths, mode_ids, user_bytes = zip(*map(loads, info.gathered))
        return cls(info, bandwidths, mode_ids, tuple(map(loads, user_bytes)))

    @property
    def modes(self) -> tuple[AveragingMode, ...]:
        return tuple(map(AveragingMode, self.mode_ids))

    @property
    def size(self) -> int:
        return len(self.info.peer_ids)


async def bandwidth_split(averager: DecentralizedAverager, group: Group, min_vector_size: int) -> Sequence[int]:
    """hivemind's split: elements each member aggregates, by download bandwidth (none for client mode)."""
    download = [bw if mode != AveragingMode.CLIENT.value else 0.0 for bw, mode in zip(group.bandwidths, group.mode_ids)]
    return await asyncio.get_event_loop().run_in_executor(
        None, load_balance_peers, averager.total_size, download, min_vector_size)


class ReplyCounter:
    """An all-reduce's part container (hivemind's TensorPartContainer, which the runner builds
    itself) that also counts the averaged parts each aggregator has answered and wakes the flow
    to it: composition, everything else goes to the container."""

    def __init__(self, container: Any):
        self.container = container
        self.answered = [0] * container.group_size  # averaged parts received back, per aggregator
        self.credit = [asyncio.Event() for _ in range(container.group_size)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.container, name)

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor) -> None:
        self.container.register_processed_part(peer_index, part_index, part)
        self.answered[peer_index] += 1
        self.credit[peer_index].set()

    def register_failed_reducer(self, peer_index: int) -> None:
        self.container.register_failed_reducer(peer_index)
        self.release(peer_index)

    def release(self, peer_index: int) -> None:
        """Nothing more is awaited from this aggregator (it failed, or the round ended)."""
        self.answered[peer_index] = math.inf
        self.credit[peer_index].set()

    async def wait_for_answers(self, peer_index: int, count: float) -> None:
        """Until the aggregator has answered at least `count` parts (or was released)."""
        while self.answered[peer_index] < count:
            self.credit[peer_index].clear()
            await self.credit[peer_index].wait()


class AcknowledgingRunner(AllReduceRunner):
    """hivemind's runner whose senders end a request stream only after the aggregator's last
    reply (see the module docstring). A client-mode sender's results come only after its end of
    stream (hivemind's delayed results), so it does not wait for them."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tensor_part_container = ReplyCounter(self.tensor_part_container)

    async def _generate_input_for_peer(self, peer_index: int):
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
        if not self.should_delay_results(self.peer_id):
            parts = self.tensor_part_container
            await parts.wait_for_answers(peer_index, parts.num_parts_by_peer[peer_index])

    def finalize(self, **kwargs: Any) -> None:
        super().finalize(**kwargs)
        for peer_index in range(self.tensor_part_container.group_size):  # a finished round awaits nothing
            self.tensor_part_container.release(peer_index)


def start_runner(averager: DecentralizedAverager, tensors: Sequence[torch.Tensor], info: GroupInfo,
                 group_id: Optional[bytes] = None, runner_class: type[AllReduceRunner] = AllReduceRunner,
                 **kwargs: Any) -> AllReduceRunner:
    """An all-reduce of `tensors` among the group, handed to the groupmates' requests waiting under
    `group_id` (the group's id by default; registered by `_register_allreduce_group`)."""
    group_id = info.group_id if group_id is None else group_id
    runner = runner_class(p2p=averager._p2p, servicer_type=type(averager), prefix=averager.prefix, tensors=tensors,
                          group_id=group_id, ordered_peer_ids=info.peer_ids, **kwargs)
    assert group_id in averager._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
    averager._running_groups[group_id].set_result(runner)
    return runner


async def add_averages(averager: DecentralizedAverager, runner: AllReduceRunner, tensors: Sequence[torch.Tensor],
                       info: GroupInfo) -> None:
    """hivemind's: add the runner's averages to `tensors` (an auxiliary member receives none)."""
    if runner.modes[info.peer_ids.index(averager.peer_id)] != AveragingMode.AUX:
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=averager._averaging_alpha)
            averager.last_updated = get_dht_time()
            averager._state_updated.set()
    else:
        async for _ in runner:
            raise ValueError("aux peers should not receive averaged tensors")


@contextlib.contextmanager
def abandon_on_failure(report: Callable[[Exception], None],
                       message: Callable[[BaseException], str] = lambda e: f"Unable to run All-Reduce: {e}"
                       ) -> Iterator[None]:
    """hivemind's ending of a group's step: any failure (a cancellation too) becomes a
    MatchmakingException, which the averager's step retries or raises; `report` sees the errors."""
    try:
        yield
    except MatchmakingException:
        raise
    except BaseException as e:
        if isinstance(e, Exception):
            report(e)
        raise MatchmakingException(message(e)) from e


def bytes_sent(averager: DecentralizedAverager, info: GroupInfo, elements: int, peer_fractions: Sequence[int],
               wire_bytes_per_element: float) -> float:
    """What this member sends in one butterfly round of `elements` (every member a sender): its
    vector less the part it reduces, then that part's average to each other member."""
    total = sum(peer_fractions) or 1
    own = peer_fractions[info.peer_ids.index(averager.peer_id)] * elements / total
    return (elements - own + own * (len(info.peer_ids) - 1)) * wire_bytes_per_element
