"""Weight merging inside hivemind's averager: one step runs a whole merge, all or nothing.

The merge itself (simple averaging, or TIES from two all-reduce rounds) is explained in
`hivekeeper.swarm.merging`, whose mergers drive this averager through its public `step`.

Same group, all or nothing. Both rounds run inside one hivemind step, on the group that
matchmaking formed (like hivemind's PowerSGD averager, round 2 uses the group id plus a
suffix): there is no second matchmaking, so round 2's members are round 1's by construction.
The members' gathered data must agree on the kind of merge, the trim, the tensor layout and a
digest of the base, or the group is abandoned before any round. hivemind's all-reduce is
fault tolerant the wrong way for a merge: a reducer that loses a sender averages the rest of
its part over the senders left, and a peer whose reducer failed keeps its own values there,
and both still report success. So a merge uses `AllOrNothingRunner`: a reducer that loses a
sender before it finished aggregates nothing more and fails its remaining results, so that
every peer still waiting for them sees a failed reducer; any failed part, in either round,
abandons the merge at that peer. A peer thus ends with either the merge of the whole group
(every member completed both rounds) or, from the step, an error and its tensors unchanged.

Robust merges (`aggregation`, a CenteredClip; see `hivekeeper.hivemind_ext.robust`). Each
aggregator replaces the mean of its part by CenteredClip, through the same all-or-nothing runner
(`robust_runner(AllOrNothingRunner)`: the clipping reducer keeps hivemind's failure rules, and a
lost sender voids the round as before). SIMPLE clips the replicas. TIES clips round 1's offsets
(the elected sign is that of their robust center), and round 2 sends the agreeing offsets only,
without the indicators: an offset is sent where it is nonzero and agrees, so its being nonzero
is its vote, and the aggregators take the robust mean over each coordinate's voters
(`CenteredClip(disjoint=True)`). The result is already the disjoint mean; the vote counts are
never averaged, so no rounding can touch them. A member's huge offsets then move each part of
the merge by at most the clipping radius per iteration, and in round 2 only where it voted.
Members must agree on the aggregation (it is in the gathered data): round 2's tensors differ.

DiLoCo's outer round (`kind="diloco"`) is one all-or-nothing round like SIMPLE, over the members'
pseudo-gradients, with two differences: the codec may be lossy (float16 or 8-bit: pseudo-gradients
are not a merge that must be exact), and the mean is weighted by each member's step weight (the
inner steps it took since its last outer step). Every kind counts the bytes its rounds put on the
wire (`sent_bytes`, as `CountingGradientAverager` does for gradients).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing as mp
from typing import Any, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionInfo
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously

from hivekeeper.hivemind_ext import check_hivemind_version
from hivekeeper.hivemind_ext.group_round import (AcknowledgingRunner, Group, abandon_on_failure, bandwidth_split,
                                                   bytes_sent, start_runner)
from hivekeeper.hivemind_ext.robust import CenteredClip, robust_runner

check_hivemind_version(__name__)

__all__ = ["AllOrNothingRunner", "DILOCO", "MergingAverager", "SIMPLE", "TIES", "agreeing_offsets", "disjoint_mean"]

log = logging.getLogger("hivekeeper.merging")

TIES, SIMPLE, DILOCO = "ties", "simple", "diloco"
_ROUND_2 = b".ties-round-2"  # group id suffix of TIES's second all-reduce
_ATTEMPTS, _ROUNDS_OK, _GROUP_SIZE = range(3)  # fields of the child's report on its last attempt


# --- the steps of the decentralized merge (run in the averager's process) -------------------------


def agreeing_offsets(offsets: Sequence[torch.Tensor], mean_offsets: Sequence[torch.Tensor]
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Round 2's inputs: this peer's offsets where they agree with the elected sign
    sign(mean of offsets) (else 0), and the agreement indicators (1.0 / 0.0)."""
    masked, indicators = [], []
    for offset, mean in zip(offsets, mean_offsets):
        agree = (torch.sign(offset) == torch.sign(mean)) & (offset != 0)
        masked.append(torch.where(agree, offset, torch.zeros_like(offset)))
        indicators.append(agree.to(offset.dtype))
    return masked, indicators


def disjoint_mean(mean_masked: Sequence[torch.Tensor], mean_indicators: Sequence[torch.Tensor],
                   group_size: int) -> list[torch.Tensor]:
    """(sum of agreeing offsets) / (their count), from their means over `group_size` peers."""
    merged = []
    for total_over_n, count_over_n in zip(mean_masked, mean_indicators):
        count = torch.round(count_over_n * group_size)  # an integer, recovered exactly
        offset = total_over_n * group_size / count.clamp(min=1)
        merged.append(torch.where(count > 0, offset, torch.zeros_like(offset)))
    return merged


# --- all-or-nothing all-reduce -------------------------------------------------------------------


class AllOrNothingRunner(AcknowledgingRunner):
    """hivemind's butterfly all-reduce, except that a reducer that loses a sender before it has
    aggregated every part stops: the part in progress and all later ones fail (the remaining
    senders get an error instead of averages over fewer peers), and so does this peer's round.
    Parts finished before the loss included every sender, so whatever a peer receives in full
    is the mean over the whole group. Senders end their streams only once answered in full
    (`AcknowledgingRunner`)."""

    voided = False

    async def _ban_sender(self, peer_id) -> None:
        reducer = self.tensor_part_reducer
        if not reducer.finished.is_set() and peer_id not in self.banned_senders:
            self.voided = True
            failure = AllreduceException(f"sender {peer_id} failed mid-round: the merge round is void")
            pending = reducer.current_part_future
            if not pending.done():  # fail it before on_sender_failed could complete it without the sender
                pending.set_exception(failure)
                pending.exception()  # retrieved here; waiters still get it
            self.finalize(exception=failure)
            if self._future.done() and not self._future.cancelled():
                self._future.exception()
        await super()._ban_sender(peer_id)


class MergingAverager(DecentralizedAverager):
    """A DecentralizedAverager whose step is one whole merge (see the module docstring).

    Its tensors carry the input: TIES offsets (`kind="ties"`) or the replica itself
    (`kind="simple"`); `aggregation` (a CenteredClip) makes the merge robust. A step that
    succeeds replaces them with the merged offsets (or the mean); a failed attempt leaves them
    as they were, so hivemind's retries start clean.
    `last_attempt` tells how far the last attempt got. hivemind names RPC handlers after the
    servicer's class: mergers meet only averagers of this class name on the same prefix (a
    subclass must keep the name to join them)."""

    runner_class: type[AllReduceRunner] = AllOrNothingRunner

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, kind: str,
                 aggregation: Optional[CenteredClip] = None, wire_bytes_per_element: float = 4.0, **kwargs: Any):
        if kind not in (TIES, SIMPLE, DILOCO):
            raise ValueError(f"kind must be {TIES!r}, {SIMPLE!r} or {DILOCO!r}, got {kind!r}")
        if kwargs.get("auxiliary"):
            raise ValueError("no auxiliary peers in merges: they send nothing")
        if kwargs.get("compression") is not None and kind != DILOCO:
            raise ValueError("merges must be exact: no compression (DiLoCo's pseudo-gradients may be compressed)")
        self.kind = kind
        self.aggregation = aggregation  # None: plain means
        self.wire_bytes_per_element = wire_bytes_per_element
        context = mp.get_context("fork")  # shared with the child super().__init__ forks
        self._report = context.Array(ctypes.c_long, 3)
        self.sent_bytes = context.Value("d", 0.0)  # tensor bytes this peer sent in rounds (after compression)
        self._shared_state: Optional[tuple[dict[str, Any], list[torch.Tensor]]] = None
        super().__init__(averaged_tensors, dht, **kwargs)

    def share_state(self, metadata: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        """What other peers' `load_state_from_peers` downloads from this one (the averaged
        tensors are only the merge's working buffer, so they are never shared)."""
        self._shared_state = (dict(metadata), [tensor.detach().clone() for tensor in tensors])

    def update_shared_metadata(self, **fields: Any) -> None:
        """Change fields of the shared metadata (a live step count) without copying the tensors."""
        if self._shared_state is not None:
            self._shared_state[0].update(fields)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[Any]]:
        if self._shared_state is None:
            raise RuntimeError("no merged state to share yet")
        metadata, tensors = self._shared_state
        return metadata, tensors, [CompressionInfo.from_tensor(tensor) for tensor in tensors]

    @property
    def last_attempt(self) -> tuple[int, int, int]:
        """(attempts so far, rounds that completed in the last one, that attempt's group size)."""
        with self._report.get_lock():
            return tuple(self._report)  # type: ignore[return-value]

    def _set_report(self, rounds_ok: Optional[int] = None, group_size: Optional[int] = None, new: bool = False):
        with self._report.get_lock():
            if new:
                self._report[_ATTEMPTS] += 1
                self._report[_ROUNDS_OK] = self._report[_GROUP_SIZE] = 0
            if rounds_ok is not None:
                self._report[_ROUNDS_OK] = rounds_ok
            if group_size is not None:
                self._report[_GROUP_SIZE] = group_size

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info: GroupInfo):
        """Registers both rounds' group ids up front, so that a groupmate that starts round 2
        first waits for our runner; leftovers are cancelled so that such a groupmate fails fast."""
        group_ids = [group_info.group_id] + ([group_info.group_id + _ROUND_2] if self.kind == TIES else [])
        try:
            for group_id in group_ids:
                self._running_groups[group_id] = asyncio.Future()
            self._pending_groups_registered.set()
            yield
        finally:
            for group_id in group_ids:
                future = self._running_groups.pop(group_id, None)
                if future is not None and not future.done():
                    future.cancel()
            self._pending_groups_registered.set()

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        self._set_report(new=True, group_size=len(group_info.peer_ids))
        with abandon_on_failure(report=lambda e: log.debug("merge attempt failed: %r", e),
                                message=lambda e: f"merge abandoned: {e!r}"):
            group = Group.read(self, group_info)
            if any(mode == AveragingMode.AUX.value for mode in group.mode_ids):
                raise MatchmakingException("an auxiliary peer joined a merge group")
            gathered = list(group.gathered)
            if any(entry != gathered[0] for entry in gathered) or not isinstance(gathered[0], dict):
                raise MatchmakingException(f"members disagree on the merge (kind, trim, layout or base): {gathered}")
            fractions = await bandwidth_split(self, group, min_vector_size)
            kwargs.pop("tensor_infos", None)  # round 2's tensors differ; DiLoCo's codec needs none
            if self.kind != DILOCO:
                kwargs["weight"] = 1.0  # plain means: the counts in round 2 rely on it
            async with enter_asynchronously(self.get_tensors()) as inputs:
                result = [tensor.clone() for tensor in inputs]
                await self._run_round(result, group_info, group_info.group_id, fractions, self.aggregation,
                                      **kwargs)
                self._set_report(rounds_ok=1)
                if self.kind == TIES:  # result holds the mean offsets: their signs are the elected ones
                    masked, indicators = agreeing_offsets(inputs, result)
                    round_2 = group_info.group_id + _ROUND_2
                    if self.aggregation is None:
                        await self._run_round(masked + indicators, group_info, round_2, fractions,
                                              **kwargs)  # in place: now their means
                        result = disjoint_mean(masked, indicators, group.size)
                    else:  # the voters' robust mean, per coordinate (see the module docstring)
                        await self._run_round(masked, group_info, round_2, fractions,
                                              dataclasses.replace(self.aggregation, disjoint=True), **kwargs)
                        result = masked
                    self._set_report(rounds_ok=2)
                for tensor, merged in zip(inputs, result):
                    tensor.copy_(merged)
            return {"peers": [str(peer) for peer in group_info.peer_ids], "group": group_info.group_id.hex()}

    async def _run_round(self, tensors: list[torch.Tensor], group_info: GroupInfo, group_id: bytes,
                         peer_fractions: Sequence[int], aggregation: Optional[CenteredClip] = None,
                         **kwargs: Any) -> None:
        """One all-reduce of `tensors` in place, over every member of the group, or an exception;
        `aggregation` replaces each part's mean (None: the mean)."""
        runner_class = self.runner_class
        if aggregation is not None:
            runner_class, kwargs = robust_runner(runner_class), dict(kwargs, aggregation=aggregation)
        runner = start_runner(self, tensors, group_info, group_id, runner_class, peer_fractions=peer_fractions,
                              **kwargs)
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update)
        outbound = bytes_sent(self, group_info, sum(t.numel() for t in tensors), peer_fractions,
                              self.wire_bytes_per_element)
        with self.sent_bytes.get_lock():
            self.sent_bytes.value += outbound
        failed = runner.tensor_part_container.failed_size
        if failed or getattr(runner, "voided", False):
            raise AllreduceException(f"round incomplete: {failed} elements never averaged, "
                                     f"senders lost: {sorted(map(str, runner.banned_senders))}")
