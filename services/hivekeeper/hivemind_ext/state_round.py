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
so every member decides the same: each member names the epoch it would average its parameters
at (None when not due, or when its replica is out of sync and must reload first) and the layout
of its parameters (a digest of their shapes). The round runs iff every sending member named the
same epoch, at least two members send, and all layouts agree. Auxiliary members aggregate their
share of it, as of the gradient round, and send nothing. Both rounds split the vector alike (the
averaging plan's shares, or hivemind's split).

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
from typing import Any, Callable, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import CompressionInfo, TensorRole

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)

__all__ = ["STATE_ROUND_SUFFIX", "StateRound", "agreed_epoch"]

log = logging.getLogger("hivekeeper.state_round")

STATE_ROUND_SUFFIX = b".parameters"  # the parameter round's group id: the gradient round's plus this
_AUX = AveragingMode.AUX.value
_ROUNDS, _EPOCH, _COMPLETE = range(3)  # fields of the shared report on the latest round
_NONE = -1


def layout_digest(tensors: Sequence[torch.Tensor]) -> str:
    """Names the parameters' shapes: members whose vectors differ must not average them."""
    return hashlib.blake2b(repr([tuple(t.shape) for t in tensors]).encode(), digest_size=8).hexdigest()


def agreed_epoch(entries: Sequence[Any], mode_ids: Sequence[int], layout: str) -> Optional[int]:
    """The epoch a group averages its parameters at, from its members' gathered entries
    ([epoch or None, layout] each) and averaging modes; None: no parameter round."""
    if not entries or any(not _valid(entry) or entry[1] != layout for entry in entries):
        return None
    epochs = {entry[0] for entry, mode in zip(entries, mode_ids) if mode != _AUX}
    senders = sum(mode != _AUX for mode in mode_ids)
    if senders < 2 or len(epochs) != 1 or None in epochs:
        return None
    return epochs.pop()


def _valid(entry: Any) -> bool:
    return (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str)
            and (entry[0] is None or (isinstance(entry[0], int) and not isinstance(entry[0], bool))))


class StateRound:
    """The parameter round of one gradient averager: the shared copies it averages, the entry
    this peer gathers, and the report of the latest round. Create it before the averager forks."""

    def __init__(self, parameters: Sequence[torch.Tensor], due: Callable[[], Optional[int]] = lambda: None):
        with torch.no_grad():
            self.tensors = [p.detach().to("cpu", torch.float32, copy=True).share_memory_() for p in parameters]
        self.tensor_infos = [CompressionInfo.from_tensor(t, key=i, role=TensorRole.PARAMETER)
                             for i, t in enumerate(self.tensors)]
        self.layout = layout_digest(self.tensors)
        self.due = due  # in the parent: the epoch this peer would average parameters at now (None: not due)
        context = mp.get_context("fork")
        self._loaded_epoch = context.Value(ctypes.c_long, _NONE, lock=False)  # whose parameters `tensors` hold
        self._report = context.Array(ctypes.c_long, 3)

    # --- in the parent (the optimizer's process) -------------------------------------------------

    def entry(self) -> list:
        """What this peer gathers for the step it schedules now."""
        return [self.due(), self.layout]

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
