"""Parameter rounds held on the gradient round's group: one matchmaking, one step, every replica.

hivemind averages parameters (`averageStateEvery`) in rounds of their own: its
TrainingStateAverager matches them ahead, at each peer's *estimated* step end, under a group key
that says nothing of the step, and a peer skips a step's round while its previous one still runs.
Replicas then disagree about which step a round is for, and a round that groups replicas a step
apart leaves its members a fraction of an update apart: the equivalence test, with a parameter
round every step, failed 3 runs of 3. Keying hivemind's rounds by epoch stopped the mixing but
not the disagreement (4 runs of 6 passed).

Here the parameter round is a second all-reduce on the group that the gradient round formed,
right after it and before the optimizer step, as merges run their second round
(`hivemind_ext.merging`): no matchmaking of its own, its members are the gradient round's by
construction, and they all hold the same step.

Agreement. Whether it runs is decided from the data every member gathered alike in matchmaking,
so every member decides the same. Each member names the epoch it would average its parameters
at (None when not due, or when its replica is out of sync and must reload first), the layout of
its parameters (a digest of their shapes), its local epoch and a fingerprint of its parameters
(`hivekeeper.replicas`). The fingerprints give the group's replica verdict: members
whose replica differs from the one most members hold are *diverged*; they send their gradients
with weight 0, take nothing from the round, drop their update and reload the state before they
compute again, whatever the parameter round does. The parameter round runs iff every other
sending member named the same epoch, at least two of them send, and all layouts agree. Auxiliary
members aggregate their share of it, as of the gradient round, and send nothing; they are not
judged (they hold no replica of their own). Both rounds split the vector alike (the averaging
plan's shares, or hivemind's split).

Inputs and results. The round averages copies of the parameters (`StateRound.tensors`, in shared
memory: the all-reduce runs in the averager's forked process). The optimizer copies its
parameters in before the step's round begins (`load`) and takes the average back before its
optimizer step only if the round completed at this peer (`take`: every part came back, all of it
finite). A member whose copy is not of this step's parameters (it tagged along, or reloaded in
between) sends them with weight 0, so that stale parameters never reach the others' average. A
replica in lockstep loses nothing by keeping its own parameters when the round fails: they equal
the group's to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing as mp
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import CompressionInfo, TensorRole

from hivekeeper.hivemind_ext import check_hivemind_version
from hivekeeper.replicas import Fingerprint, ReplicaVerdict, fingerprint, replica_verdict

check_hivemind_version(__name__)

__all__ = ["STATE_ROUND_SUFFIX", "StateEntry", "StateRound", "agreed_epoch", "group_verdict"]

log = logging.getLogger("hivekeeper.state_round")

STATE_ROUND_SUFFIX = b".parameters"  # the parameter round's group id: the gradient round's plus this
_AUX = AveragingMode.AUX.value
_ROUNDS, _EPOCH, _COMPLETE = range(3)  # fields of the shared report on the latest round
_NONE = -1


def layout_digest(tensors: Sequence[torch.Tensor]) -> str:
    """Names the parameters' shapes: members whose vectors differ must not average them."""
    return hashlib.blake2b(repr([tuple(t.shape) for t in tensors]).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class StateEntry:
    """What one member gathered for the step: [due epoch or None, layout, local epoch, fingerprint]."""

    due: Optional[int]
    layout: str
    epoch: Optional[int]
    fingerprint: Optional[Fingerprint]

    @classmethod
    def read(cls, value: Any) -> Optional["StateEntry"]:
        """The entry a member gathered, or None for anything malformed (or none at all)."""
        if not isinstance(value, (list, tuple)) or len(value) != 4 or not isinstance(value[1], str):
            return None
        due, layout, epoch, print_ = value
        if not (due is None or _is_int(due)) or not (epoch is None or _is_int(epoch)):
            return None
        return cls(due, layout, epoch, Fingerprint.from_wire(print_))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def group_verdict(entries: Sequence[Optional[StateEntry]], mode_ids: Sequence[int]) -> ReplicaVerdict:
    """Which sending members hold a replica that differs from the group's (see the module docstring)."""
    return replica_verdict([e.fingerprint if e is not None else None for e in entries],
                           [e.epoch if e is not None else None for e in entries],
                           [mode != _AUX for mode in mode_ids])


def agreed_epoch(entries: Sequence[Optional[StateEntry]], mode_ids: Sequence[int], layout: str,
                 verdict: ReplicaVerdict = ReplicaVerdict(frozenset())) -> Optional[int]:
    """The epoch a group averages its parameters at, from its members' gathered entries and
    averaging modes, leaving out the members the verdict found diverged; None: no parameter round."""
    if not entries or any(entry is None or entry.layout != layout for entry in entries):
        return None
    senders = [entry for index, (entry, mode) in enumerate(zip(entries, mode_ids))
               if mode != _AUX and index not in verdict.diverged]
    epochs = {entry.due for entry in senders}
    if len(senders) < 2 or len(epochs) != 1 or None in epochs:
        return None
    return epochs.pop()


class StateRound:
    """The parameter round of one gradient averager: the shared copies it averages, the entry
    this peer gathers, and the report of the latest round. Create it before the averager forks."""

    def __init__(self, parameters: Sequence[torch.Tensor], due: Callable[[], Optional[int]] = lambda: None,
                 epoch: Callable[[], Optional[int]] = lambda: None):
        self.parameters = list(parameters)  # the live replica, fingerprinted for every step
        with torch.no_grad():
            self.tensors = [p.detach().to("cpu", torch.float32, copy=True).share_memory_() for p in parameters]
        self.tensor_infos = [CompressionInfo.from_tensor(t, key=i, role=TensorRole.PARAMETER)
                             for i, t in enumerate(self.tensors)]
        self.layout = layout_digest(self.tensors)
        self.due = due  # in the parent: the epoch this peer would average parameters at now (None: not due)
        self.epoch = epoch  # in the parent: this peer's local epoch
        context = mp.get_context("fork")
        self._loaded_epoch = context.Value(ctypes.c_long, _NONE, lock=False)  # whose parameters `tensors` hold
        self._report = context.Array(ctypes.c_long, 3)

    # --- in the parent (the optimizer's process) -------------------------------------------------

    def entry(self) -> list:
        """What this peer gathers for the step it schedules now (see `StateEntry`)."""
        return [self.due(), self.layout, self.epoch(), fingerprint(self.parameters).to_wire()]

    @torch.no_grad()
    def load(self, parameters: Sequence[torch.Tensor], epoch: int) -> None:
        """Copy this step's parameters in, before the step's round begins."""
        for buffer, parameter in zip(self.tensors, parameters):
            buffer.copy_(parameter.detach())
        with self._report.get_lock():
            self._report[_EPOCH] = _NONE
        self._loaded_epoch.value = epoch

    @torch.no_grad()
    def take(self, parameters: Sequence[torch.Tensor]) -> Optional[str]:
        """After the step's round: put the group's average into `parameters` if this peer's
        parameter round completed ("averaged"); "failed" if it ran and did not; None if no
        parameter round ran for the loaded step (or none was loaded)."""
        loaded, self._loaded_epoch.value = self._loaded_epoch.value, _NONE
        with self._report.get_lock():
            epoch, complete = self._report[_EPOCH], bool(self._report[_COMPLETE])
        if loaded == _NONE or epoch != loaded:
            return None
        if not complete or not all(bool(torch.isfinite(t).all()) for t in self.tensors):
            return "failed"
        for parameter, averaged in zip(parameters, self.tensors):
            parameter.copy_(averaged.to(parameter.device, parameter.dtype))
        return "averaged"

    def discard(self) -> None:
        """Forget the loaded step: its round's average, if any, is not to be taken."""
        self._loaded_epoch.value = _NONE

    # --- in the averager's process ---------------------------------------------------------------

    def weight(self, epoch: int) -> float:
        """This member's weight in the round: 0 unless its copy holds the parameters of `epoch`."""
        return 1.0 if self._loaded_epoch.value == epoch else 0.0

    def report(self, epoch: int, complete: bool) -> None:
        with self._report.get_lock():
            self._report[_ROUNDS] += 1
            self._report[_EPOCH], self._report[_COMPLETE] = epoch, int(complete)

    @property
    def rounds(self) -> int:
        """Parameter rounds this peer has run (complete or not)."""
        with self._report.get_lock():
            return int(self._report[_ROUNDS])
