"""What differs between Hugging Face architectures: where the blocks, embeddings and head live,
and how one block runs with an attention cache. Servers run blocks; clients run the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class Architecture:
    name: str
    blocks_path: str  # attribute path of the nn.ModuleList of blocks
    embed: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, ids, positions)
    head: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, hidden) -> logits
    needs_rotary: bool

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model.get_submodule(self.blocks_path)

    def drop_blocks(self, model: nn.Module) -> None:
        """Keep only what a client runs: the blocks live on the servers."""
        parent, _, name = self.blocks_path.rpartition(".")
        setattr(model.get_submodule(parent), name, nn.ModuleList())

    def run_block(self, block: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                  cache, rotary: Optional[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        kwargs = dict(attention_mask=mask, past_key_values=cache, use_cache=cache is not None,
                      cache_position=positions[0])
        if self.needs_rotary:
            out = block(hidden, position_ids=positions, position_embeddings=rotary, **kwargs)
        else:
            out = block(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


def _llama_embed(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return model.model.embed_tokens(ids)


def _llama_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden))


def _gpt2_embed(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    t = model.transformer
    return t.drop(t.wte(ids) + t.wpe(positions))


def _gpt2_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.transformer.ln_f(hidden))


ARCHITECTURES = {
    "llama": Architecture("llama", "model.layers",
                          _llama_embed, _llama_head, needs_rotary=True),
    "gpt2": Architecture("gpt2", "transformer.h",
                         _gpt2_embed, _gpt2_head, needs_rotary=False),
}
# Llama-style families share Llama's block interface (rotary embeddings passed in).
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2"}


def architecture_of(config) -> Architecture:
    try:
        return ARCHITECTURES[MODEL_TYPES[config.model_type]]
    except KeyError:
        raise ValueError(f"model_type {config.model_type!r} is not supported (supported: "
                         f"{', '.join(sorted(MODEL_TYPES))})") from None


def causal_mask(batch: int, past: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (batch, 1, length, past + length): query i sees keys up to past + i. An
    explicit mask, as Hugging Face builds at the model level, so eager and SDPA attention agree."""
    keys = torch.arange(past + length)
    queries = torch.arange(past, past + length)
    blocked = keys[None, :] > queries[:, None]
    mask = torch.zeros(length, past + length, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, length, past + length)
