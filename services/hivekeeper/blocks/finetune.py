"""Parameter-efficient fine-tuning through block servers (Petals section 2.2): the trainable
parameters live on the client (soft prompts, a low-rank adapter); the servers run forward and
backward of their frozen blocks for anyone, keep nothing between requests, and never change
their weights, so clients training different tasks at once cannot interfere."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from hivekeeper.blocks.client import RemoteCausalLM


class SoftPrompt(nn.Module):
    """Prompt tuning: `length` trainable embeddings put before every input."""

    def __init__(self, length: int, hidden_size: int, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embeddings = nn.Parameter(torch.randn(1, length, hidden_size, generator=generator) * 0.02)

    def forward(self) -> torch.Tensor:
        return self.embeddings


class LowRankAdapter(nn.Module):
    """LoRA-style residual on the blocks' output: h + B(A(h)), with B zero at the start so the
    model is unchanged until training moves it."""

    def __init__(self, hidden_size: int, rank: int = 8, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.down = nn.Parameter(torch.randn(hidden_size, rank, generator=generator) / hidden_size**0.5)
        self.up = nn.Parameter(torch.zeros(rank, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.down @ self.up


def lm_loss(model: RemoteCausalLM, tokens: torch.Tensor, prompt: Optional[SoftPrompt] = None,
            adapter: Optional[LowRankAdapter] = None) -> torch.Tensor:
    """Next-token cross-entropy of `tokens` (batch, length)."""
    logits = model(tokens[:, :-1], prefix=prompt() if prompt is not None else None, adapter=adapter)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model: RemoteCausalLM, batches: Iterable[torch.Tensor], prompt: Optional[SoftPrompt] = None,
          adapter: Optional[LowRankAdapter] = None, learning_rate: float = 0.01) -> list[float]:
    """One Adam step per batch on the client's trainable parameters; returns the losses."""
    parameters = [p for module in (prompt, adapter) if module is not None for p in module.parameters()]
    if not parameters:
        raise ValueError("nothing to train: give a soft prompt and/or an adapter")
    optimizer = torch.optim.Adam(parameters, lr=learning_rate)
    losses = []
    for batch in batches:
        loss = lm_loss(model, batch, prompt, adapter)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
