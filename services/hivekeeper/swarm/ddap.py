"""DDAP's wrapper: a few lines turn a plain PyTorch training loop into a hivekeeper peer, in
any averaging mode of a Swarm (the seed's `DDAP(model, optimizer, steps_per_epoch, ...)`).

    peer = ddap.connect(model, optimizer, initial_peers, prefix="my-run", mode="ties",
                        steps_per_epoch=len(loader), merge_every_epochs=0.5)
    with peer:
        for epoch in range(num_epochs):
            for batch in loader:
                loss(model, batch).backward()
                peer.optimizer.step(); peer.optimizer.zero_grad()
                peer.step()

Modes: `parameters` and `ties` merge replicas that train alone (`MergingPeer`: merge_every
steps or merge_every_epochs, trim, merge_optimizer_state, shift_every); `diloco` takes an
outer step on the averaged pseudo-gradient every inner_steps steps (`DilocoPeer`: inner_steps,
outer=OuterOptimizer(learning_rate, momentum, nesterov), compression, overlap); `gradients` is
DeDLOC's collaborative large-batch SGD (`GradientPeer`: batch_size, target_batch_size, and
expected_peers to wait for at the start), whose `peer.optimizer` is the collaborative
optimizer around yours. Step `peer.optimizer` (your optimizer itself in the merging modes)
and the loop is the same in every mode.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from hivekeeper.swarm.diloco import DilocoPeer
from hivekeeper.swarm.gradient_peer import GradientPeer
from hivekeeper.swarm.merging_peer import MergingPeer

MODES = ("gradients", "parameters", "ties", "diloco")


def connect(model: torch.nn.Module, optimizer: torch.optim.Optimizer, initial_peers: Sequence[str], prefix: str,
            *, mode: str = "parameters", **options: Any) -> Union[GradientPeer, MergingPeer, DilocoPeer]:
    """A peer in `mode` with a DHT of its own, joined to the swarm at `initial_peers` and started
    from its latest state; `options` are the mode's (see `GradientPeer`, `MergingPeer` and `DilocoPeer`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "gradients":
        return GradientPeer.connect(model, optimizer, initial_peers, prefix, **options)
    if mode == "diloco":
        return DilocoPeer.connect(model, optimizer, initial_peers, prefix, **options)
    return MergingPeer.connect(model, optimizer, initial_peers, prefix, mode=mode, **options)
