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

Same group, all or nothing (`hivekeeper.hivemind_ext.merging`, the averager that runs a whole
merge as one hivemind step): both rounds run on the group that matchmaking formed, whose members
must agree on the kind of merge, the trim, the tensor layout and the base; a sender lost in
either round voids the merge. A peer thus ends with either the merge of the whole group (every
member completed both rounds) or, from `merge`, no result and its replica unchanged.
With `allow_retries` (hivemind's default) a failed attempt looks for a new group until the
step's timeout, so the survivors of a failure may still merge among themselves.

Precision. hivemind averages float32 tensors: the offsets are taken in float32 and the merged
model is base + merged offset. Results match the centralized merge within float32 rounding
(about 1e-7 relative), except where the summed offsets of a coordinate lie within rounding of
zero (about 1e-7 of the largest offset): there a float32 all-reduce, whose summation order
follows the arrival of parts, may elect either sign, as any float32 implementation may.
No compression is allowed: a lossy codec would change the elected signs and the counts.

Robust merges (`aggregation=CenteredClip(...)`, the Swarm's `averaging.aggregation:
centeredClip`): the aggregators replace every mean above by CenteredClip (Karimireddy et al.
2021, per part as in BTARD), so that a member sending huge or sign-flipped weights moves the
merge by at most the clipping radius. Simple averaging clips the replicas. TIES elects the sign
of the offsets' robust center, and round 2 takes, per coordinate, the robust mean of the
agreeing offsets only: a nonzero masked offset is its sender's vote, so the indicators are not
sent and the counts are never averaged (`hivekeeper.hivemind_ext.merging`). With honest members
the result is close to, not equal to, the plain merge (CenteredClip is not the mean); members
must agree on the aggregation, as on the trim.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hivekeeper.hivemind_ext.merging import DILOCO, SIMPLE, TIES, MergingAverager
from hivekeeper.hivemind_ext.robust import CenteredClip
from hivekeeper.spec.swarm import ROBUST_MIN_GROUP_SIZE

MATCHMAKING_SLACK = 5.0  # seconds a step may look for a group past its timeout before it is cancelled

__all__ = ["MergeResult", "PseudoGradientMerger", "SimpleMerger", "TiesMerger", "round_bits", "simple_average",
           "ties_merge", "trim_offsets"]



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


def tensors_digest(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().to(torch.float32).contiguous().reshape(-1).numpy().tobytes())
    return digest.hexdigest()


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
                 target_group_size: Optional[int] = None, min_group_size: Optional[int] = None,
                 min_matchmaking_time: float = 5.0, request_timeout: float = 3.0,
                 next_chunk_timeout: Optional[float] = 10.0, allreduce_timeout: float = 120.0,
                 aggregation: Optional[CenteredClip] = None, **averager_kwargs: Any):
        # a robust merge needs three members: of two, neither can be told hostile (spec.swarm)
        smallest = 2 if aggregation is None else ROBUST_MIN_GROUP_SIZE
        if min_group_size is None:
            min_group_size = smallest
        elif min_group_size < smallest:
            raise ValueError(f"min_group_size must be at least {smallest} for this aggregation, got {min_group_size}")
        self.shapes = [tuple(tensor.shape) for tensor in tensors_like]
        self.aggregation = aggregation
        self.allreduce_timeout, self.min_matchmaking_time = allreduce_timeout, min_matchmaking_time
        self._lock = threading.Lock()  # one merge at a time: the averager's tensors hold its input
        self.averager = self.averager_class(
            [torch.zeros(shape, dtype=torch.float32) for shape in self.shapes], dht, kind=self.kind,
            aggregation=aggregation, prefix=prefix, start=True, target_group_size=target_group_size,
            min_group_size=min_group_size, min_matchmaking_time=min_matchmaking_time, request_timeout=request_timeout,
            next_chunk_timeout=next_chunk_timeout, allreduce_timeout=allreduce_timeout, **averager_kwargs)
        self.peer_id = str(self.averager.peer_id)


    def _gathered(self, **fields: Any) -> dict[str, Any]:
        clip = self.aggregation
        aggregation = "mean" if clip is None else ["centeredClip", clip.radius, clip.iterations]
        return {"merge": self.kind, "layout": [list(shape) for shape in self.shapes], "aggregation": aggregation,
                **fields}

    def _run(self, inputs: Sequence[torch.Tensor], gather: dict[str, Any], timeout: float,
             allow_retries: bool, weight: float = 1.0) -> tuple[Optional[list[torch.Tensor]], MergeResult]:
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
            attempts_before = self.averager.last_attempt[0]
            error, peers, group = None, (), None
            try:
                control = self.averager.step(gather=gather, weight=weight, timeout=timeout,
                                             allow_retries=allow_retries, wait=False)
                started = time.monotonic()
                outcome = self._wait(control, matchmaking_deadline=started + timeout + MATCHMAKING_SLACK,
                                     deadline=started + timeout + self.allreduce_timeout + 10)
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

    def _wait(self, control: Any, matchmaking_deadline: float, deadline: float) -> Any:
        """The step's outcome. hivemind's own timeout does not always end matchmaking: a peer whose
        groupmates went on to other rounds was seen looking for a group for over 100 s on a
        loaded machine, so a step still matchmaking past its timeout is cancelled here."""
        from hivemind.averaging.control import AveragingStage

        while True:
            try:
                return control.result(timeout=0.5)
            except TimeoutError:
                if not self.averager.is_alive():
                    raise RuntimeError("the averager process died during the merge") from None
                now = time.monotonic()
                if now > deadline or (now > matchmaking_deadline and control.stage in (
                        AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)):
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
    `ties_merge(base, [replicas of the group], trim)` (with `aggregation`, its robust
    counterpart: see the module docstring)."""

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
        gather = self._gathered(trim=self.trim, base=base_id or tensors_digest(base))
        offsets, result = self._run(offsets, gather, timeout, allow_retries)
        if offsets is None:
            return result
        merged = [(b.detach().to(torch.float32) + offset).to(b.dtype) for b, offset in zip(base, offsets)]
        return dataclasses.replace(result, merged=merged)


class SimpleMerger(_Merger):
    """Simple averaging with the peers of one hivemind group (one all-reduce round): a
    successful `merge` returns the arithmetic mean of the group's replicas (with
    `aggregation`, their CenteredClip center)."""

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


def round_bits(round_index: int, bits: int = 16) -> str:
    """A matchmaking group key per outer round: peers at different rounds never meet."""
    return format(round_index % (1 << bits), f"0{bits}b")


class PseudoGradientMerger(_Merger):
    """DiLoCo's outer all-reduce (`hivekeeper.swarm.diloco`): the weighted mean of the members'
    pseudo-gradients over one all-or-nothing round, optionally through a lossy codec
    (`compression=`, `wire_bytes_per_element=` go to the averager). Matchmaking is keyed by the
    outer round, so only peers at the same round meet, and members must also agree on the outer
    state they started the round from (`state_id`), or the group is abandoned before any round."""

    kind = DILOCO

    def average(self, pseudo_gradients: Sequence[torch.Tensor], *, round_index: int, state_id: str,
                weight: float = 1.0, timeout: float = 30.0, allow_retries: bool = True) -> MergeResult:
        self._check(pseudo_gradients, "pseudo-gradients")
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight}")
        self.averager.set_group_bits(round_bits(round_index))
        inputs = [tensor.detach().to(torch.float32) for tensor in pseudo_gradients]
        mean, result = self._run(inputs, self._gathered(round=round_index, state=state_id), timeout, allow_retries,
                                 weight=weight)
        return result if mean is None else dataclasses.replace(result, merged=mean)
