"""Weight merging for asynchronous training: simple averaging and TIES merge, centralized and decentralized.

Replicas train without synchronizing every step and merge their weights now and then (DDAP,
"Asynchronous Training of Deep Learning Models", sections 3.1 and 3.3). Optimizer moments are
merged the same way: pass them in the same tensor list as the parameters.

Centralized reference (`ties_merge`, TIES-merging by Yadav et al., as DDAP uses it): with the
last merged model as the base b and replicas r_k, the offsets are tau_k = r_k - b; an optional
trim keeps the top `trim` fraction of |tau_k| (per tensor, per replica) and zeroes the rest; the
elected sign is s = sign(sum_k tau_k); the disjoint mean averages, per coordinate, only the
offsets that are nonzero and agree with s; the result is b + that mean (b where none agree).
Where the summed offsets are exactly 0 nothing agrees and b is kept (the TIES reference code
fills those signs with the model-wide majority sign instead; it only matters on exact ties).

Decentralized (`TiesMerger`): no peer holds every replica, but every peer holds the same base,
so TIES is built from two all-reduce rounds (plain means, weight 1 per peer, n peers):

  round 1  all-reduce tau_k                      -> m = (1/n) sum_k tau_k
           sign(m) = sign(sum_k tau_k) = s        (n > 0), so every peer elects the same sign;
  round 2  all-reduce [a_k * tau_k, a_k] with a_k = 1 where tau_k != 0 and sign(tau_k) = s, else 0
                                                 -> (1/n) sum_k a_k tau_k  and  c / n, c = sum_k a_k
           merged offset = (sum_k a_k tau_k / n) * n / c = the disjoint mean (0 where c = 0).

Both vectors of round 2 travel as one all-reduce (one list of tensors). c is an integer, so it
is recovered exactly as round(n * mean) and the division is by the exact agreement count.

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
(every member completed both rounds) or, from `merge`, no result and its replica unchanged.
With `allow_retries` (hivemind's default) a failed attempt looks for a new group until the
step's timeout, so the survivors of a failure may still merge among themselves.

Precision. hivemind averages float32 tensors: the offsets are taken in float32 and the merged
model is base + merged offset. Results match the centralized merge within float32 rounding
(about 1e-7 relative), except where the summed offsets of a coordinate lie within rounding of
zero (about 1e-7 of the largest offset): there a float32 all-reduce, whose summation order
follows the arrival of parts, may elect either sign, as any float32 implementation may.
No compression is allowed: a lossy codec would change the elected signs and the counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ctypes
import hashlib
import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionInfo
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously

__all__ = ["AllOrNothingRunner", "MergeResult", "MergingAverager", "SimpleMerger", "TiesMerger",
           "agreeing_offsets", "disjoint_mean", "simple_average", "ties_merge", "trim_offsets"]

log = logging.getLogger("hivekeeper.merging")

TIES, SIMPLE = "ties", "simple"
_ROUND_2 = b".ties-round-2"  # group id suffix of TIES's second all-reduce
_ATTEMPTS, _ROUNDS_OK, _GROUP_SIZE = range(3)  # fields of the child's report on its last attempt


# --- the centralized reference -----------------------------------------------------------------


def trim_offsets(offsets: Sequence[torch.Tensor], trim: Optional[float]) -> list[torch.Tensor]:
    """Keeps, in each tensor, the `trim` fraction of its entries with the largest magnitude
    (at least one; entries tied with the smallest kept magnitude are kept too, as in the TIES
    reference code) and zeroes the rest. `trim=None` keeps everything."""
    if trim is None:
        return [offset.clone() for offset in offsets]
    _check_trim(trim)
    trimmed = []
    for offset in offsets:
        magnitude = offset.abs().reshape(-1)
        keep = max(1, round(trim * magnitude.numel())) if magnitude.numel() else 0
        if keep == 0 or keep >= magnitude.numel():
            trimmed.append(offset.clone())
            continue
        threshold = magnitude.kthvalue(magnitude.numel() - keep + 1).values
        trimmed.append(torch.where(offset.abs() >= threshold, offset, torch.zeros_like(offset)))
    return trimmed


def ties_merge(base: Sequence[torch.Tensor], replicas: Sequence[Sequence[torch.Tensor]],
               trim: Optional[float] = None) -> list[torch.Tensor]:
    """TIES merge of `replicas` (each a list of tensors shaped like `base`) around `base`:
    trim (optional), elect the sign of the summed offsets, average the offsets that agree."""
    if not replicas:
        raise ValueError("ties_merge needs at least one replica")
    _check_layout(base, replicas)
    merged = []
    for index, base_tensor in enumerate(base):
        dtype = torch.promote_types(base_tensor.dtype, torch.float32)
        offsets = torch.stack([trim_offsets([replica[index].to(dtype) - base_tensor.to(dtype)], trim)[0]
                               for replica in replicas])
        elected = torch.sign(offsets.sum(0))
        agree = (torch.sign(offsets) == elected) & (offsets != 0)
        count = agree.sum(0)
        total = torch.where(agree, offsets, torch.zeros_like(offsets)).sum(0)
        offset = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
        merged.append((base_tensor.to(dtype) + offset).to(base_tensor.dtype))
    return merged


def simple_average(replicas: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The arithmetic mean of the replicas, tensor by tensor (DDAP's simple averaging)."""
    if not replicas:
        raise ValueError("simple_average needs at least one replica")
    _check_layout(replicas[0], replicas)
    return [torch.stack([replica[index] for replica in replicas]).mean(0) for index in range(len(replicas[0]))]


def _check_trim(trim: Optional[float]) -> None:
    if trim is not None and not 0 < trim <= 1:
        raise ValueError(f"trim must be a fraction in (0, 1] of the offsets to keep, got {trim}")


def _check_layout(like: Sequence[torch.Tensor], others: Sequence[Sequence[torch.Tensor]]) -> None:
    shapes = [tuple(tensor.shape) for tensor in like]
    for other in others:
        if [tuple(tensor.shape) for tensor in other] != shapes:
            raise ValueError(f"tensor shapes differ: expected {shapes}, got {[tuple(t.shape) for t in other]}")


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


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().to(torch.float32).contiguous().reshape(-1).numpy().tobytes())
    return digest.hexdigest()


# --- all-or-nothing all-reduce -------------------------------------------------------------------


class AllOrNothingRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, except that a reducer that loses a sender before it has
    aggregated every part stops: the part in progress and all later ones fail (the remaining
    senders get an error instead of averages over fewer peers), and so does this peer's round.
    Parts finished before the loss included every sender, so whatever a peer receives in full
    is the mean over the whole group."""

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
    (`kind="simple"`). A step that succeeds replaces them with the merged offsets (or the
    mean); a failed attempt leaves them as they were, so hivemind's retries start clean.
    `last_attempt` tells how far the last attempt got. hivemind names RPC handlers after the
    servicer's class: mergers meet only averagers of this class name on the same prefix (a
    subclass must keep the name to join them)."""

    runner_class: type[AllReduceRunner] = AllOrNothingRunner

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, kind: str, **kwargs: Any):
        if kind not in (TIES, SIMPLE):
            raise ValueError(f"kind must be {TIES!r} or {SIMPLE!r}, got {kind!r}")
        if kwargs.get("compression") is not None or kwargs.get("auxiliary"):
            raise ValueError("merges must be exact: no compression, and no auxiliary peers (they send nothing)")
        self.kind = kind
        self._report = mp.get_context("fork").Array(ctypes.c_long, 3)  # before the fork in super().__init__
        self._shared_state: Optional[tuple[dict[str, Any], list[torch.Tensor]]] = None
        super().__init__(averaged_tensors, dht, **kwargs)

    def share_state(self, metadata: dict[str, Any], tensors: Sequence[torch.Tensor]) -> None:
        """What other peers' `load_state_from_peers` downloads from this one (the averaged
        tensors are only the merge's working buffer, so they are never shared)."""
        self._shared_state = (dict(metadata), [tensor.detach().clone() for tensor in tensors])

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
        try:
            bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            gathered = [self.serializer.loads(data) for data in user_bytes]
            if any(mode == AveragingMode.AUX.value for mode in mode_ids):
                raise MatchmakingException("an auxiliary peer joined a merge group")
            if any(entry != gathered[0] for entry in gathered) or not isinstance(gathered[0], dict):
                raise MatchmakingException(f"members disagree on the merge (kind, trim, layout or base): {gathered}")
            download = [bw if mode != AveragingMode.CLIENT.value else 0.0 for bw, mode in zip(bandwidths, mode_ids)]
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, download, min_vector_size)
            kwargs.pop("tensor_infos", None)  # round 2's tensors differ; no compression anyway
            kwargs["weight"] = 1.0  # plain means: the counts in round 2 rely on it
            async with enter_asynchronously(self.get_tensors()) as inputs:
                result = [tensor.clone() for tensor in inputs]
                await self._run_round(result, group_info, group_info.group_id, fractions, **kwargs)
                self._set_report(rounds_ok=1)
                if self.kind == TIES:  # result holds the mean offsets: their signs are the elected ones
                    masked, indicators = agreeing_offsets(inputs, result)
                    await self._run_round(masked + indicators, group_info, group_info.group_id + _ROUND_2,
                                          fractions, **kwargs)  # in place: now their means
                    self._set_report(rounds_ok=2)
                    result = disjoint_mean(masked, indicators, len(group_info.peer_ids))
                for tensor, merged in zip(inputs, result):
                    tensor.copy_(merged)
            return {"peers": [str(peer) for peer in group_info.peer_ids], "group": group_info.group_id.hex()}
        except MatchmakingException:
            raise
        except BaseException as e:
            if isinstance(e, Exception):
                log.debug("merge attempt failed: %r", e)
            raise MatchmakingException(f"merge abandoned: {e!r}") from e

    async def _run_round(self, tensors: list[torch.Tensor], group_info: GroupInfo, group_id: bytes,
                         peer_fractions: Sequence[int], **kwargs: Any) -> None:
        """One all-reduce of `tensors` in place, over every member of the group, or an exception."""
        runner = self.runner_class(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                                   group_id=group_id, ordered_peer_ids=group_info.peer_ids,
                                   peer_fractions=peer_fractions, **kwargs)
        self._running_groups[group_id].set_result(runner)
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update)
        failed = runner.tensor_part_container.failed_size
        if failed or getattr(runner, "voided", False):
            raise AllreduceException(f"round incomplete: {failed} elements never averaged, "
                                     f"senders lost: {sorted(map(str, runner.banned_senders))}")


# --- the mergers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeResult:
    """What one merge gave this peer. `merged` is None when it was abandoned (no group, a
    disagreeing group, or a failed round); the caller then keeps its replica unchanged."""

    merged: Optional[list[torch.Tensor]]
    group_size: int  # members of the last group this peer tried to merge with (0: none formed)
    rounds_ok: int  # all-reduce rounds that group completed in full (TIES needs 2, simple 1)
    peers: tuple[str, ...] = ()  # the group's members (peer ids) when the merge succeeded
    error: Optional[str] = None
    group: Optional[str] = None  # the group's id (hex) when the merge succeeded: names the merged state

    @property
    def ok(self) -> bool:
        return self.merged is not None


class _Merger:
    kind: str
    averager_class: type[MergingAverager] = MergingAverager

    def __init__(self, dht: Any, prefix: str, tensors_like: Sequence[torch.Tensor], *,
                 target_group_size: Optional[int] = None, min_group_size: int = 2,
                 min_matchmaking_time: float = 5.0, request_timeout: float = 3.0,
                 next_chunk_timeout: Optional[float] = 10.0, allreduce_timeout: float = 120.0,
                 **averager_kwargs: Any):
        self.shapes = [tuple(tensor.shape) for tensor in tensors_like]
        self.allreduce_timeout, self.min_matchmaking_time = allreduce_timeout, min_matchmaking_time
        self._lock = threading.Lock()  # one merge at a time: the averager's tensors hold its input
        self.averager = self.averager_class(
            [torch.zeros(shape, dtype=torch.float32) for shape in self.shapes], dht, kind=self.kind,
            prefix=prefix, start=True, target_group_size=target_group_size, min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
            next_chunk_timeout=next_chunk_timeout, allreduce_timeout=allreduce_timeout, **averager_kwargs)
        self.peer_id = str(self.averager.peer_id)


    def _gathered(self, **fields: Any) -> dict[str, Any]:
        return {"merge": self.kind, "layout": [list(shape) for shape in self.shapes], **fields}

    def _run(self, inputs: Sequence[torch.Tensor], gather: dict[str, Any], timeout: float,
             allow_retries: bool) -> tuple[Optional[list[torch.Tensor]], MergeResult]:
        """Writes `inputs` to the averager, runs one merge step; returns the averager's merged
        tensors (float32) or None, and the result without `merged`."""
        if timeout <= self.min_matchmaking_time:
            raise ValueError(f"timeout ({timeout} s) must exceed min_matchmaking_time ({self.min_matchmaking_time} s)")
        with self._lock:
            if not self.averager.is_alive():
                return None, MergeResult(None, 0, 0, error="the averager process is not running")
            with self.averager.get_tensors() as tensors:
                for tensor, value in zip(tensors, inputs):
                    tensor.copy_(value)
            attempts_before = self.averager.last_attempt[_ATTEMPTS]
            error, peers, group = None, (), None
            try:
                control = self.averager.step(gather=gather, weight=1.0, timeout=timeout,
                                             allow_retries=allow_retries, wait=False)
                outcome = self._wait(control, deadline=time.monotonic() + timeout + self.allreduce_timeout + 10)
                peers = tuple(outcome["peers"]) if isinstance(outcome, dict) else ()
                group = outcome.get("group") if isinstance(outcome, dict) else None
                if not peers:
                    error = "no group"
            except Exception as e:  # hivemind raises what ended the step (no group, a failed round, ...)
                error = repr(e)
            attempts, rounds_ok, group_size = self.averager.last_attempt
            if attempts == attempts_before:
                rounds_ok = group_size = 0  # no group formed in this merge
            result = MergeResult(None, group_size, rounds_ok, peers, error, group)
            if error is not None:
                return None, result
            with self.averager.get_tensors() as tensors:
                return [tensor.clone() for tensor in tensors], result

    def _wait(self, control: Any, deadline: float) -> Any:
        while True:
            try:
                return control.result(timeout=0.5)
            except TimeoutError:
                if not self.averager.is_alive():
                    raise RuntimeError("the averager process died during the merge") from None
                if time.monotonic() > deadline:
                    control.cancel()
                    raise

    def _check(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        if [tuple(tensor.shape) for tensor in tensors] != self.shapes:
            raise ValueError(f"{what}: expected tensors shaped {self.shapes}, got {[tuple(t.shape) for t in tensors]}")

    def shutdown(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class TiesMerger(_Merger):
    """TIES merge with the peers of one hivemind group (two all-reduce rounds, one step).

    Every peer passes the same `base` (the last merged model) and its own replica; a
    successful `merge` returns base + the disjoint mean of the sign-agreeing offsets of the
    whole group, identical (to float32 rounding) at every member and equal to
    `ties_merge(base, [replicas of the group], trim)`."""

    kind = TIES

    def __init__(self, dht: Any, prefix: str, tensors_like: Sequence[torch.Tensor], *,
                 trim: Optional[float] = None, **kwargs: Any):
        _check_trim(trim)
        self.trim = trim
        super().__init__(dht, prefix, tensors_like, **kwargs)

    def merge(self, base: Sequence[torch.Tensor], replica: Sequence[torch.Tensor], *, timeout: float = 30.0,
              allow_retries: bool = True, base_id: Optional[str] = None) -> MergeResult:
        """`base_id` names the base for the group's agreement check (default: a digest of its
        values). Merged results agree across members only to float32 rounding (each adds the
        averaged delta to its own values), so a peer that merges repeatedly names its base by
        the merge that made it (`MergeResult.group`) rather than by its bytes."""
        self._check(base, "base")
        self._check(replica, "replica")
        offsets = trim_offsets([r.detach().to(torch.float32) - b.detach().to(torch.float32)
                                for b, r in zip(base, replica)], self.trim)
        gather = self._gathered(trim=self.trim, base=base_id or _digest(base))
        offsets, result = self._run(offsets, gather, timeout, allow_retries)
        if offsets is None:
            return result
        merged = [(b.detach().to(torch.float32) + offset).to(b.dtype) for b, offset in zip(base, offsets)]
        return dataclasses.replace(result, merged=merged)


class SimpleMerger(_Merger):
    """Simple averaging with the peers of one hivemind group (one all-reduce round): a
    successful `merge` returns the arithmetic mean of the group's replicas."""

    kind = SIMPLE

    def merge(self, replica: Sequence[torch.Tensor], *, timeout: float = 30.0,
              allow_retries: bool = True) -> MergeResult:
        self._check(replica, "replica")
        inputs = [tensor.detach().to(torch.float32) for tensor in replica]
        mean, result = self._run(inputs, self._gathered(), timeout, allow_retries)
        if mean is None:
            return result
        merged = [value.to(tensor.dtype) for tensor, value in zip(replica, mean)]
        return dataclasses.replace(result, merged=merged)
