"""DiLoCo (Douillard et al. 2023) over hivemind: replicas train alone with their inner optimizer
(AdamW in the paper) for H steps, then take one outer step together: the all-reduced
pseudo-gradient (outer parameters minus each replica's) drives an outer Nesterov-momentum SGD
(learning rate 0.7, momentum 0.9 in the paper), and every replica restarts from the new outer
parameters. OpenDiLoCo (Jaghouar et al. 2024) ran it over hivemind with float16 pseudo-gradients.

    with DilocoPeer.connect(model, inner_optimizer, initial_peers, prefix="my-run", inner_steps=50) as peer:
        for batch in loader:                 # starts from the swarm's latest outer state, if any
            loss(model, batch).backward()
            inner_optimizer.step(); inner_optimizer.zero_grad()
            peer.step()                       # an outer step every inner_steps steps

What every replica holds: the outer parameters (float32) and the outer momentum, which only
outer steps change and which every member of a round changes alike; its own parameters and
inner optimizer state, which stay local (the paper keeps inner moments local too).

One outer round (`PseudoGradientMerger`): matchmaking is keyed by the round's index, so only
replicas at the same outer step meet; members agree on the outer state they start from (its id:
the group that made it); the round is all or nothing; the mean is weighted by the inner steps
each member took since it last synced. Compression (float16, 8-bit) applies to pseudo-gradients
only: a lossy codec leaves members' outer states a rounding apart, which the next round's
pseudo-gradients (taken from each member's own outer state) carry along rather than compound.

A replica that misses a round (no group, a failed round) takes no outer step and keeps training:
its next pseudo-gradient covers every inner step since it last synced, so no work is lost. It
then downloads the most advanced outer state any peer shares; if that is ahead of its own (or
the same step made by another group, ranked by id so that all replicas pick the same one), it
adopts it (parameters and momentum), rebases its local progress onto it, and moves its step
count up to the sharer's, so that it meets the others at their next boundary. After a round
that succeeded it looks too (the DHT's list of sharers and their ranks, no download unless one
ranks higher): replicas that reached a boundary too far apart can pair off, and each pair would
otherwise go on at its own round forever. A late or restarted replica starts from the most
advanced state too, at the step its sharer has reached.

Overlap (`overlap=True`, as Streaming DiLoCo, Douillard et al. 2025, overlaps its fragments):
the outer all-reduce runs in the background while the next inner steps go on; when it ends, the
outer step is applied and the inner progress made meanwhile is kept on top of the new outer
parameters (a one-round-delayed outer step). A round still running at the next boundary is
waited for.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from hivekeeper.hivemind_ext.robust import CenteredClip
from hivekeeper.swarm.merging import MergeResult, PseudoGradientMerger, tensors_digest
from hivekeeper.swarm.merging_peer import STATE_TIMEOUT, MergeRecord, WrapperPeer
from hivekeeper.swarm.optimizer import WIRE_BYTES_PER_ELEMENT, chunk_timeout

log = logging.getLogger("hivekeeper.diloco")

DEFAULT_INNER_STEPS = 20
PSEUDO_GRADIENT_CODECS = ("none", "float16", "uniform8bit")


@dataclass(frozen=True)
class OuterOptimizer:
    """SGD with (Nesterov) momentum on pseudo-gradients, as torch.optim.SGD with dampening 0:
    buf = momentum * buf + g;  update = g + momentum * buf (Nesterov) or buf;  p -= lr * update."""

    learning_rate: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not self.learning_rate > 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"outer optimizer: learning rate must be > 0 and momentum in [0, 1), got "
                             f"{self.learning_rate} and {self.momentum}")

    def step(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor]) -> None:
        for param, buffer, grad in zip(params, buffers, grads):
            buffer.mul_(self.momentum).add_(grad)
            update = grad.add(buffer, alpha=self.momentum) if self.nesterov else buffer
            param.sub_(update, alpha=self.learning_rate)


@dataclass(frozen=True)
class OuterState:
    """What the swarm agrees on between outer steps, as a peer shares it."""

    step: int  # outer steps taken
    state_id: str  # the group that made it ("init-<digest>" before the first)

    @property
    def rank(self) -> tuple[int, int]:
        """Most advanced first; at equal steps (two groups made two states) a hash of the id
        decides, the same everywhere, so replicas converge on one."""
        return self.step, int.from_bytes(hashlib.blake2b(self.state_id.encode(), digest_size=4).digest(), "big")

    @property
    def priority(self) -> float:
        """hivemind hands a downloader the state of the peer with the highest priority: in rank order."""
        step, tiebreak = self.rank
        return step + 0.5 * tiebreak / 2**32


class DilocoPeer(WrapperPeer):
    """DiLoCo for a plain PyTorch loop (the module docstring); `optimizer` is the inner one,
    stepped by the caller. `aggregation` (a CenteredClip) makes outer rounds robust."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dht: Any, prefix: str, *,
                 inner_steps: int = DEFAULT_INNER_STEPS, outer: OuterOptimizer = OuterOptimizer(),
                 compression: str = "none", overlap: bool = False, target_group_size: Optional[int] = None,
                 matchmaking_seconds: float = 2.0, timeout_seconds: float = 30.0,
                 on_merge: Optional[Callable[[MergeRecord], None]] = None,
                 aggregation: Optional[CenteredClip] = None):
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be at least 1, got {inner_steps}")
        if compression not in PSEUDO_GRADIENT_CODECS:
            raise ValueError(f"compression must be one of {', '.join(PSEUDO_GRADIENT_CODECS)}, got {compression!r}")
        from hivekeeper.swarm.optimizer import compression as codec

        self.model, self.optimizer, self.outer = model, optimizer, outer
        self.inner_steps, self.overlap, self.on_merge = inner_steps, overlap, on_merge
        self.params = [p for p in model.parameters()]
        self.outer_params = [p.detach().to(torch.float32).clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.outer_params]
        self.state = OuterState(0, f"init-{tensors_digest(self.outer_params)}")
        self.local_steps = 0  # inner steps, as the swarm counts them (a joiner takes the sharer's count)
        self.since_sync = 0  # inner steps in this replica's next pseudo-gradient: its weight
        # A replica that finds no group gives up after this and trains on; a formed group gets
        # timeout_seconds to finish. Waiting for stragglers costs idle time only without overlap.
        self.timeout = max(3 * matchmaking_seconds + 1.0, timeout_seconds if overlap else 0.0)
        self.merger = PseudoGradientMerger(
            dht, f"{prefix}_merge", self.outer_params, target_group_size=target_group_size,
            min_matchmaking_time=matchmaking_seconds, request_timeout=min(3.0, matchmaking_seconds / 2),
            allreduce_timeout=timeout_seconds, next_chunk_timeout=chunk_timeout(matchmaking_seconds, timeout_seconds),
            aggregation=aggregation, compression=codec(compression),
            wire_bytes_per_element=WIRE_BYTES_PER_ELEMENT[compression])
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-outer") if overlap else None
        # an outer round running in the background (overlap): its future, the parameters it
        # started from, when and at which local step
        self._pending: Optional[tuple[concurrent.futures.Future, list[torch.Tensor], float, int]] = None
        self._share()

    # --- what the caller sees ---------------------------------------------------------------

    @property
    def merges(self) -> int:
        """Outer steps taken (the merging peers' name for the count, in reports)."""
        return self.state.step

    @property
    def sent_bytes(self) -> float:
        return self.merger.averager.sent_bytes.value

    def join(self) -> bool:
        """Start from the most advanced outer state any peer shares; False when there is none."""
        shared = self._download()
        if shared is None:
            return False
        state, live_step, outer_params, momentum = shared
        self._adopt(state, outer_params, momentum, rebase=False)
        self.local_steps = self._aligned(live_step)
        log.info("joined from the outer state", extra={"fields": {"outer_step": state.step, "step": live_step}})
        return True

    def step(self) -> Optional[MergeRecord]:
        """Call after each inner optimizer step; returns a record when an outer round ended."""
        self.local_steps += 1
        self.since_sync += 1
        self.merger.averager.update_shared_metadata(liveStep=self.local_steps)
        record = self._finish_pending(wait=False)
        if self.local_steps % self.inner_steps == 0:
            record = self._finish_pending(wait=True) or record
            record = self._start_round() or record
        return record

    def shutdown(self) -> None:
        if self._pool is not None:  # a round in flight ends when its averager stops, just below
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.merger.shutdown()
        super().shutdown()

    # --- outer rounds ------------------------------------------------------------------------

    def _start_round(self) -> Optional[MergeRecord]:
        snapshot = [p.detach().to(torch.float32).clone() for p in self.params]
        pseudo_gradients = [outer - local for outer, local in zip(self.outer_params, snapshot)]
        started, weight = time.perf_counter(), float(self.since_sync)

        def run() -> MergeResult:
            return self.merger.average(pseudo_gradients, round_index=self.state.step, state_id=self.state.state_id,
                                       weight=weight, timeout=self.timeout)
        if self._pool is None:
            return self._apply(run(), snapshot, started, self.local_steps)
        self._pending = (self._pool.submit(run), snapshot, started, self.local_steps)
        return None

    def _finish_pending(self, wait: bool) -> Optional[MergeRecord]:
        if self._pending is None or not (wait or self._pending[0].done()):
            return None
        future, snapshot, started, snapshot_step = self._pending
        self._pending = None
        try:
            result = future.result()
        except Exception as e:  # the merger returns failures; this is a bug or a dead averager
            result = MergeResult(None, 0, 0, error=repr(e))
        return self._apply(result, snapshot, started, snapshot_step)

    def _apply(self, result: MergeResult, snapshot: list[torch.Tensor], started: float,
               snapshot_step: int) -> MergeRecord:
        """The outer step from the averaged pseudo-gradient, or, after a failed round, catching
        up with a more advanced outer state if some peer shares one."""
        if result.ok and not all(bool(torch.isfinite(t).all()) for t in result.merged):
            result = MergeResult(None, result.group_size, result.rounds_ok, error="the averaged pseudo-gradient "
                                                                                 "is not finite")
        if result.ok:
            self.outer.step(self.outer_params, self.momentum, result.merged)
            self.state = OuterState(self.state.step + 1, result.group)
            self._restart_from_outer(snapshot)
            self.since_sync = self.local_steps - snapshot_step  # the inner steps kept on top
            self._share()
        if not result.ok or self._better_state_shared():
            self._catch_up()
        return self._merged(MergeRecord("success" if result.ok else "failure", result.group_size if result.ok else 0,
                                        time.perf_counter() - started, self.local_steps, result.error))

    def _restart_from_outer(self, snapshot: list[torch.Tensor]) -> None:
        """Local parameters := the outer ones, plus the inner progress made since `snapshot`
        (none without overlap)."""
        with torch.no_grad():
            for param, outer, before in zip(self.params, self.outer_params, snapshot):
                progress = param.detach().to(torch.float32) - before
                param.copy_((outer + progress).to(param.dtype))

    def _better_state_shared(self) -> bool:
        """Whether some peer declares a state ranked above this one's: a group that formed apart
        (peers that reached a boundary too far apart pair off, and each pair goes on at its own
        round) never meets the others again unless it looks. Reads the DHT only."""
        averager = self.merger.averager
        try:
            declared = averager.dht.get(f"{averager.prefix}.all_averagers", latest=True)
        except Exception:  # the DHT is unreachable: look again after the next round
            return False
        if declared is None or not isinstance(declared.value, dict):
            return False
        own = averager.peer_id.to_bytes()
        return any(isinstance(entry.value, (int, float)) and entry.value > self.state.priority
                   for subkey, entry in declared.value.items() if subkey != own)

    def _catch_up(self) -> None:
        shared = self._download()
        if shared is None:
            return
        state, live_step, outer_params, momentum = shared
        if state.rank > self.state.rank:
            self._adopt(state, outer_params, momentum, rebase=True)
            self.local_steps = self._aligned(max(self.local_steps, live_step))
            log.info("caught up with the outer state", extra={"fields": {"outer_step": state.step}})

    def _aligned(self, step: int) -> int:
        """`step`, kept before the boundary of this replica's next round: a state that has taken
        s outer steps has its next round at step H * (s + 1). A sharer that has reached that
        boundary is in that round right now, and a replica put on the boundary itself would pass
        it without a round and come to the next one a round behind, every time."""
        return min(step, self.inner_steps * (self.state.step + 1) - 1)

    def _adopt(self, state: OuterState, outer_params: list[torch.Tensor], momentum: list[torch.Tensor],
               rebase: bool) -> None:
        """Take `state`; with `rebase`, keep this replica's progress since its own outer state (the
        next pseudo-gradient then covers it), else restart from the outer parameters."""
        with torch.no_grad():
            for param, old, new in zip(self.params, self.outer_params, outer_params):
                local = param.detach().to(torch.float32)
                param.copy_((new + (local - old) if rebase else new).to(param.dtype))
            for mine, theirs in zip(self.outer_params + self.momentum, outer_params + momentum):
                mine.copy_(theirs)
        self.state = state
        if not rebase:
            self.since_sync = 0
        self._share()

    # --- the shared outer state ----------------------------------------------------------------

    def _share(self) -> None:
        self.merger.averager.share_state(
            {"step": self.local_steps, "liveStep": self.local_steps, "outerStep": self.state.step,
             "stateId": self.state.state_id, "innerSteps": self.inner_steps},
            self.outer_params + self.momentum)
        self.merger.averager.state_sharing_priority = self.state.priority

    def _download(self) -> Optional[tuple[OuterState, int, list[torch.Tensor], list[torch.Tensor]]]:
        loaded = self.merger.averager.load_state_from_peers(timeout=STATE_TIMEOUT)
        if loaded is None:
            return None
        metadata, tensors = loaded
        count = len(self.outer_params)
        expected = [tuple(t.shape) for t in self.outer_params] * 2
        try:
            state = OuterState(int(metadata["outerStep"]), str(metadata["stateId"]))
            live_step = int(metadata["liveStep"])
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring a peer's outer state without its step and id")
            return None
        if [tuple(t.shape) for t in tensors] != expected or not all(bool(torch.isfinite(t).all()) for t in tensors):
            log.warning("ignoring a peer's outer state with another layout or non-finite values")
            return None
        tensors = [t.to(torch.float32) for t in tensors]
        return state, live_step, tensors[:count], tensors[count:]
