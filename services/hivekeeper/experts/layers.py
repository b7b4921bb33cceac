"""Expert architectures (Learning@home 4.1 uses feed-forward and Transformer-encoder blocks).
Experts are deterministic (no dropout): a server recomputes the forward pass inside every
backward request, as hivemind's runtime does (gradient checkpointing, Learning@home 3.3)."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from hivekeeper.spec.expertpool import ExpertSpec


class FeedForwardExpert(nn.Module):
    """LayerNorm(x + W2 GELU(W1 x)): hiddenSize -> ffnMultiplier x hiddenSize -> hiddenSize."""

    def __init__(self, hidden_size: int, ffn_multiplier: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(hidden_size, ffn_multiplier * hidden_size), nn.GELU(),
                                 nn.Linear(ffn_multiplier * hidden_size, hidden_size))
        self.norm = nn.LayerNorm(hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.ffn(x))


class TransformerExpert(nn.Module):
    """A BERT-like encoder block over [batch, tokens, hiddenSize]."""

    def __init__(self, hidden_size: int, ffn_multiplier: int, num_heads: int):
        super().__init__()
        self.block = nn.TransformerEncoderLayer(hidden_size, num_heads, dim_feedforward=ffn_multiplier * hidden_size,
                                                dropout=0.0, activation="gelu", batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def example_shape(spec: ExpertSpec) -> tuple[int, ...]:
    """The shape of one example an expert takes and returns (the batch dimension excluded)."""
    if spec.type == "transformer":
        return (spec.sequence_length, spec.hidden_size)
    return (spec.hidden_size,)


def build_expert(spec: ExpertSpec, uid: str, seed: int = 0) -> nn.Module:
    """A fresh expert; its initial weights depend on its uid and the seed only, so every server
    that starts an expert without a checkpoint starts it the same way."""
    with torch.random.fork_rng():
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(uid.encode()))
        if spec.type == "transformer":
            return TransformerExpert(spec.hidden_size, spec.ffn_multiplier, spec.num_heads)
        return FeedForwardExpert(spec.hidden_size, spec.ffn_multiplier)
