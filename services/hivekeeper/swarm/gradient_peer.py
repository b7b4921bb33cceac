"""The wrapper's `gradients` mode: a plain PyTorch loop as a DeDLOC trainer (collaborative
large-batch SGD), with the Swarm trainer's optimizer (`hivekeeper.swarm.optimizer`).

The peer's `optimizer` is hivemind's collaborative Optimizer around the user's own: its
`step()` accumulates this peer's gradients until the collaboration has `target_batch_size`
samples, then every peer that contributed averages the gradients and takes the same step
with the user's optimizer. Replicas therefore hold the same weights after every global step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from hivemind.utils.crypto import RSAPrivateKey

from hivekeeper.hivemind_ext.allreduce import CountingGradientAverager
from hivekeeper.hivemind_ext.optimizer import InstrumentedOptimizer
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.swarm.merging_peer import MergeRecord, WrapperPeer
from hivekeeper.swarm.optimizer import TRACKER_REFRESH, averager_options, chunk_timeout, reset_step_counters

log = logging.getLogger("hivekeeper.gradient_peer")


class GradientPeer(WrapperPeer):
    """`step()` after each `optimizer.step()` (this peer's optimizer, not the user's) counts the
    local batch and returns a `MergeRecord` of the averaging round when a global step was taken."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dht: Any, prefix: str, *,
                 batch_size: int, target_batch_size: int, expected_peers: int = 1,
                 target_group_size: Optional[int] = None, matchmaking_seconds: float = 2.0,
                 timeout_seconds: float = 30.0, on_merge: Optional[Callable[[MergeRecord], None]] = None):
        self.model, self.on_merge = model, on_merge
        self.metrics = SwarmMetrics()
        self.optimizer = InstrumentedOptimizer(
            dht=dht, run_id=prefix, optimizer=optimizer,  # pre-built: it steps the model's own parameters
            target_batch_size=target_batch_size, batch_size_per_step=batch_size,
            matchmaking_time=matchmaking_seconds, averaging_timeout=timeout_seconds,
            next_chunk_timeout=chunk_timeout(matchmaking_seconds, timeout_seconds),
            client_mode=dht.client_mode, grad_averager_factory=CountingGradientAverager,
            averager_opts=averager_options(target_group_size, matchmaking_seconds),
            # a key of its own: by default every tracker in a process signs its progress with one
            # process-wide key, so two wrapper peers in one process would count as one peer
            tracker_opts={**TRACKER_REFRESH, "private_key": RSAPrivateKey()},
            metrics=self.metrics, expected_peers=expected_peers, verbose=False)
        reset_step_counters(optimizer)
        self.local_steps = 0  # batches this peer contributed
        self._epoch = self.optimizer.local_epoch
        self._round_seen: dict[str, Any] = {}

    @property
    def epoch(self) -> int:
        """Global steps this replica has taken (hivemind's epoch, shared by the collaboration)."""
        return self.optimizer.local_epoch

    def join(self) -> bool:
        """Catch up with the collaboration's latest state; False when no peer is ahead."""
        before = self.optimizer.local_epoch
        self.optimizer.load_state_from_peers()
        self._epoch = self.optimizer.local_epoch
        return self._epoch > before

    def step(self) -> Optional[MergeRecord]:
        self.local_steps += 1
        if self.optimizer.local_epoch == self._epoch:
            return None
        self._epoch = self.optimizer.local_epoch
        round_ = self.optimizer.last_round
        if not round_ or round_ is self._round_seen:  # caught up by loading a peer's state: no round
            return None
        self._round_seen = round_
        return self._merged(MergeRecord(round_["outcome"], round_["groupSize"], round_["seconds"], self.local_steps))

    def shutdown(self) -> None:
        self.optimizer.shutdown()
        super().shutdown()
