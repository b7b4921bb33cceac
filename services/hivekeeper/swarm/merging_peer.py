"""A plain PyTorch training loop as a weight-merging peer (DDAP's wrapper, over hivemind).

    with MergingPeer.connect(model, optimizer, initial_peers, prefix="my-run", mode="ties",
                             merge_every_epochs=0.25, steps_per_epoch=len(loader)) as peer:
        for epoch in range(num_epochs):  # starts from the swarm's latest merged state, if any
            for batch in loader:
                loss(model, batch).backward()
                optimizer.step(); optimizer.zero_grad()
                peer.step()              # merges with the peers that reach a merge too

(`hivekeeper.swarm.ddap.connect` takes the same arguments and also offers mode `gradients`.)
Every `merge_every` local optimizer steps, or at every `merge_every_epochs` mark of a pass of
`steps_per_epoch` steps, the peer merges its replica with whoever else is merging:
`parameters` takes the arithmetic mean, `ties` a TIES merge against the last merged model
(both from `hivekeeper.swarm.merging`, all or nothing). Optimizer moments travel in the same
tensor list as the weights when `merge_optimizer_state` is on; step counters stay local.
With `shift_every`, replicas also move one place around a ring every that many steps between
merges (model shifting, `hivekeeper.swarm.model_shifting`).

After each merge the peer shares the merged state (weights, moments, the TIES base, the step
and merge counts) for others to download: a late joiner starts from it, and a TIES peer whose
merge failed adopts its base. That matters: members must agree on the base (its name is in
the gathered data), so one peer left on an old base would make every group it joins abandon
the merge. The peer keeps its own weights; only the reference point moves. A base is named
by the merge group that made it, not by its bytes: members' merged tensors agree only to
float32 rounding.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Literal, Optional, Sequence

import torch

from hivekeeper.hivemind_ext.robust import CenteredClip
from hivekeeper.swarm.merging import MergeResult, SimpleMerger, TiesMerger
from hivekeeper.swarm.model_shifting import ModelShifter
from hivekeeper.swarm.optimizer import chunk_timeout, reset_step_counters

log = logging.getLogger("hivekeeper.merging_peer")

MergeMode = Literal["parameters", "ties"]
STATE_TIMEOUT = 30.0
DEFAULT_MERGE_EVERY = 10
NON_NEGATIVE_STATE = {"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"}  # Adam(W), RMSprop, Adagrad


def init_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's moments now (torch makes them at the first step), so that every
    peer's tensor layout is fixed from the start. One step on zero gradients, then the weights
    (weight decay moves them) and step counters are put back."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, value, grad in zip(params, saved, grads):
            p.copy_(value)
            p.grad = grad
    reset_step_counters(optimizer)


def state_tensors(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors a merge covers, in a fixed order: the parameters, then each parameter's
    floating-point optimizer moments by name (step counters excluded)."""
    tensors = [p for p in model.parameters()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                tensors += [state[k] for k in sorted(state) if k != "step"
                            and isinstance(state[k], torch.Tensor) and state[k].is_floating_point()]
    return tensors


@dataclass(frozen=True)
class MergeSchedule:
    """When a replica merges, and shifts, by its local step count. Merges fall every `interval`
    steps (a fraction): at steps ceil(k * interval), k = 1, 2, ..., so that an epoch fraction
    keeps its merges on the marks it names instead of drifting by rounding (a quarter of a
    10-step pass merges at steps 3, 5, 8, 10). Shifts fall every `shift_every` steps between."""

    interval: Fraction
    shift_every: Optional[int] = None

    @classmethod
    def of(cls, merge_every: Optional[int] = None, merge_every_epochs: Optional[float] = None,
           steps_per_epoch: Optional[int] = None, shift_every: Optional[int] = None) -> "MergeSchedule":
        """From a step count or an epoch fraction (the spec's mergeEverySteps or mergeEveryEpochs;
        a fraction under one step merges every step); `DEFAULT_MERGE_EVERY` steps without either."""
        if merge_every is not None and merge_every_epochs is not None:
            raise ValueError("set merge_every or merge_every_epochs, not both")
        if merge_every is not None and merge_every < 1:
            raise ValueError(f"merge_every must be at least 1, got {merge_every}")
        if merge_every_epochs is not None:
            if merge_every_epochs <= 0 or not steps_per_epoch or steps_per_epoch < 1:
                raise ValueError("merge_every_epochs needs a positive fraction and steps_per_epoch >= 1, got "
                                 f"{merge_every_epochs} and {steps_per_epoch}")
            interval = max(Fraction(1), Fraction(merge_every_epochs).limit_denominator(10**6) * steps_per_epoch)
        else:
            interval = Fraction(merge_every if merge_every is not None else DEFAULT_MERGE_EVERY)
        if shift_every is not None and not 1 <= shift_every < interval:
            raise ValueError(f"shift_every must be at least 1 and below the merge interval ({float(interval):g} "
                             f"steps), got {shift_every}")
        return cls(interval, shift_every)

    def merges_at(self, step: int) -> bool:
        return step >= 1 and step // self.interval > (step - 1) // self.interval

    def shifts_at(self, step: int) -> bool:
        return bool(self.shift_every) and step % self.shift_every == 0 and not self.merges_at(step)


class WrapperPeer(abc.ABC):
    """What the wrapper's peers share: `connect` with a DHT of their own, and `with` support.
    A subclass takes (model, optimizer, dht, prefix, **options), and its `shutdown` calls this one."""

    _own_dht: Any = None  # set by `connect`: `shutdown` stops it too
    last_merge: Optional[MergeRecord] = None
    on_merge: Optional[Callable[[MergeRecord], None]] = None

    @classmethod
    def connect(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer, initial_peers: Sequence[str],
                prefix: str, *, host: str = "0.0.0.0", **options: Any):
        """A peer with a DHT of its own, bootstrapped from `initial_peers` (e.g. a Swarm's backbone
        multiaddrs), that starts from the swarm's latest state (`join`)."""
        import hivemind

        dht = hivemind.DHT(initial_peers=list(initial_peers), host_maddrs=[f"/ip4/{host}/tcp/0"], start=True)
        try:
            peer = cls(model, optimizer, dht, prefix, **options)
        except BaseException:
            dht.shutdown()
            raise
        peer._own_dht = dht
        try:
            peer.join()
        except BaseException:
            peer.shutdown()
            raise
        return peer

    @abc.abstractmethod
    def join(self) -> bool:
        """Start from the swarm's latest state; False when there is none yet."""

    def _merged(self, record: MergeRecord) -> MergeRecord:
        """Keep and report one merge (or averaging round)."""
        self.last_merge = record
        if self.on_merge:
            self.on_merge(record)
        return record

    def shutdown(self) -> None:
        if self._own_dht is not None:
            self._own_dht.shutdown()
            self._own_dht = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


@dataclass(frozen=True)
class MergeRecord:
    """One merge attempt, for metrics and status."""

    outcome: str  # success | failure (mode gradients: also skipped, a step alone)
    group_size: int
    seconds: float
    step: int
    error: Optional[str] = None


class MergingPeer(WrapperPeer):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dht: Any, prefix: str, *,
                 mode: MergeMode = "parameters", merge_every: Optional[int] = None,
                 merge_every_epochs: Optional[float] = None, steps_per_epoch: Optional[int] = None,
                 trim: Optional[float] = None, merge_optimizer_state: bool = True,
                 shift_every: Optional[int] = None, target_group_size: Optional[int] = None,
                 matchmaking_seconds: float = 2.0, timeout_seconds: float = 30.0,
                 on_merge: Optional[Callable[[MergeRecord], None]] = None,
                 aggregation: Optional[CenteredClip] = None):
        if mode not in ("parameters", "ties"):
            raise ValueError(f"mode must be 'parameters' or 'ties', got {mode!r} "
                             "(mode 'gradients': hivekeeper.swarm.ddap.connect)")
        if trim is not None and mode != "ties":
            raise ValueError("trim applies to mode 'ties' only")
        self.schedule = MergeSchedule.of(merge_every, merge_every_epochs, steps_per_epoch, shift_every)
        self.model, self.optimizer, self.mode = model, optimizer, mode
        self.merge_optimizer_state = merge_optimizer_state
        # A peer that finds no group gives up soon and trains on (merging at its next point):
        # the others are busy merging, or gone. A formed group gets timeout_seconds to finish.
        self.timeout = 3 * matchmaking_seconds + 1.0
        self.on_merge = on_merge
        if merge_optimizer_state:
            init_optimizer_state(model, optimizer)
        tensors = self._tensors()
        self.base = [t.detach().clone() for t in tensors]  # the last merged state: TIES's reference point
        self.base_id = "initial"  # which merge made the base (members must agree on it, see the docstring)
        self.local_steps = 0
        self.merges = self.shifts = 0
        self.shifter = ModelShifter(dht, prefix, rendezvous_seconds=matchmaking_seconds,
                                    timeout=timeout_seconds) if shift_every else None
        options = dict(target_group_size=target_group_size, min_matchmaking_time=matchmaking_seconds,
                       request_timeout=min(3.0, matchmaking_seconds / 2), allreduce_timeout=timeout_seconds,
                       next_chunk_timeout=chunk_timeout(matchmaking_seconds, timeout_seconds),
                       aggregation=aggregation)  # a CenteredClip makes merges robust (swarm.merging)
        merger_prefix = f"{prefix}_merge"
        self.merger = (TiesMerger(dht, merger_prefix, tensors, trim=trim, **options) if mode == "ties"
                       else SimpleMerger(dht, merger_prefix, tensors, **options))
        self._share()

    def _tensors(self) -> list[torch.Tensor]:
        return state_tensors(self.model, self.optimizer if self.merge_optimizer_state else None)

    @property
    def sent_bytes(self) -> float:
        """Tensor bytes this peer has sent in merges."""
        return self.merger.averager.sent_bytes.value

    def join(self) -> bool:
        """Start from the latest merged state any peer shares; False when there is none yet."""
        state = self._download()
        if state is None:
            return False
        metadata, tensors = state
        count = len(self.base)
        self._assign(tensors[:count])
        self.base = [t.clone() for t in tensors[count:]]
        self.base_id = metadata["baseId"]
        self.local_steps, self.merges = int(metadata["step"]), int(metadata["merges"])
        self._share()
        log.info("joined from the merged state", extra={"fields": {"step": self.local_steps, "merges": self.merges}})
        return True

    def step(self) -> Optional[MergeRecord]:
        """Call after each optimizer step; merges when one is due and returns what happened."""
        self.local_steps += 1
        if self.schedule.merges_at(self.local_steps):
            return self.merge()
        if self.schedule.shifts_at(self.local_steps):
            self.shift()
        return None

    def shift(self) -> bool:
        """Continue from the ring predecessor's replica (model shifting); False if none came."""
        got = self.shifter.shift(self.local_steps, [t.detach().clone() for t in self._tensors()])
        if got is None:
            return False
        tensors, predecessor = got
        self._assign(tensors)
        self.shifts += 1
        log.info("shifted", extra={"fields": {"step": self.local_steps, "from": predecessor}})
        return True

    def merge(self) -> MergeRecord:
        started = time.perf_counter()
        replica = [t.detach().clone() for t in self._tensors()]
        result: MergeResult = (self.merger.merge(self.base, replica, timeout=self.timeout, base_id=self.base_id)
                               if self.mode == "ties"
                               else self.merger.merge(replica, timeout=self.timeout))
        if result.ok and not all(bool(torch.isfinite(t).all()) for t in result.merged):
            result = dataclasses.replace(result, merged=None, error="the merged state is not finite")
        if result.ok:
            self._assign(result.merged)
            self.base = [t.detach().clone() for t in result.merged]
            self.base_id = result.group
            self.merges += 1
            self._share()
        elif self.mode == "ties":
            self._adopt_base()
        return self._merged(MergeRecord("success" if result.ok else "failure", result.group_size if result.ok else 0,
                                        time.perf_counter() - started, self.local_steps, result.error))

    def _adopt_base(self) -> None:
        state = self._download()
        if state is not None:
            metadata, tensors = state
            base = tensors[len(self.base):]
            if int(metadata["merges"]) >= self.merges and base:
                self.base = [t.clone() for t in base]
                self.base_id = metadata["baseId"]
                self.merges = int(metadata["merges"])
                self._share()

    def _download(self) -> Optional[tuple[dict[str, Any], list[torch.Tensor]]]:
        loaded = self.merger.averager.load_state_from_peers(timeout=STATE_TIMEOUT)
        if loaded is None:
            return None
        metadata, tensors = loaded
        expected = [tuple(t.shape) for t in self.base] * 2
        if not isinstance(metadata, dict) or [tuple(t.shape) for t in tensors] != expected:
            log.warning("ignoring a peer's merged state with another layout")
            return None
        return metadata, list(tensors)

    def _assign(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for tensor, value in zip(self._tensors(), values):
                tensor.copy_(value)
            # A TIES merge keeps a second moment >= 0 in exact arithmetic (each replica's is),
            # but members' bases differ by float32 rounding, so a moment near 0 can come out
            # a hair below it, and Adam's sqrt would turn it into NaN.
            for state in self.optimizer.state.values():
                for key in NON_NEGATIVE_STATE & state.keys():
                    state[key].clamp_(min=0)

    def _share(self) -> None:
        """Offer (current weights and moments, base) to joiners, preferring the most merged peer."""
        tensors = [t.detach().clone() for t in self._tensors()] + self.base
        self.merger.averager.share_state({"step": self.local_steps, "merges": self.merges, "baseId": self.base_id},
                                         tensors)
        self.merger.averager.state_sharing_priority = float(self.merges) + 1.0

    def shutdown(self) -> None:
        self.merger.shutdown()
        super().shutdown()


def load_merged_state(dht: Any, prefix: str, model: torch.nn.Module,
                      optimizer: Optional[torch.optim.Optimizer]) -> Optional[dict[str, Any]]:
    """Download the latest merged weights into `model` (for a monitor: it takes no part in
    merges); `optimizer` (or None) must be what the trainers merge, for the layout. Returns
    the state's metadata (step, merges), or None when no peer shares one."""
    from hivekeeper.hivemind_ext.merging import SIMPLE, MergingAverager

    if optimizer is not None:
        init_optimizer_state(model, optimizer)
    tensors = state_tensors(model, optimizer)
    averager = MergingAverager([torch.zeros_like(t) for t in tensors], dht, kind=SIMPLE, prefix=f"{prefix}_merge",
                               client_mode=True, start=True)
    try:
        loaded = averager.load_state_from_peers(timeout=STATE_TIMEOUT)
    finally:
        averager.shutdown()
    if loaded is None:
        return None
    metadata, values = loaded
    if [tuple(v.shape) for v in values] != [tuple(t.shape) for t in tensors] * 2:
        raise ValueError("a peer shared merged state with another layout than this model's")
    with torch.no_grad():
        for tensor, value in zip(tensors, values):
            tensor.copy_(value)
    return dict(metadata)
