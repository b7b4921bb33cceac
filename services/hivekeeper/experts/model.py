"""The trainer's model: local input and output layers around a stack of DMoE layers whose
experts live on the pool's servers. With Transformer experts an 8x8 digit becomes a sequence of
`sequenceLength` tokens (groups of pixels)."""

from __future__ import annotations

import torch
from torch import nn

from hivekeeper.experts.dmoe import DMoE, ExpertClient
from hivekeeper.spec.expertpool import DIGITS_PIXELS, ExpertPoolSpec

NUM_CLASSES = 10


class DMoEClassifier(nn.Module):
    def __init__(self, spec: ExpertPoolSpec, client: ExpertClient):
        super().__init__()
        expert, dmoe = spec.expert, spec.trainers.dmoe
        torch.manual_seed(spec.task.seed)
        self.tokens = expert.sequence_length if expert.type == "transformer" else None
        width_in = DIGITS_PIXELS // self.tokens if self.tokens else DIGITS_PIXELS
        self.embed = nn.Linear(width_in, expert.hidden_size)
        self.position = nn.Parameter(torch.zeros(self.tokens, expert.hidden_size)) if self.tokens else None
        # every layer draws on the same pool of experts with its own gating
        self.layers = nn.ModuleList(
            DMoE(client, spec.grid.uid_prefix, spec.grid.dimensions, expert.hidden_size, k_best=dmoe.k_best,
                 k_min=dmoe.k_min, forward_timeout=dmoe.forward_timeout_seconds,
                 timeout_after_k_min=dmoe.timeout_after_k_min_seconds, backward_timeout=dmoe.backward_timeout_seconds)
            for _ in range(dmoe.layers))
        self.head = nn.Linear(expert.hidden_size, NUM_CLASSES)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.tokens:
            h = self.embed(pixels.view(len(pixels), self.tokens, -1)) + self.position
        else:
            h = self.embed(pixels)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1) if self.tokens else h)
