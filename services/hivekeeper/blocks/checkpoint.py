"""Where a model's weights come from: a local Hugging Face folder, or a tiny config with seeded
random weights (the same in every process). Never a hub: nothing is downloaded at run time.

A server keeps only its span's blocks (and the rotary embedding a Llama-style block needs); a
client keeps only the embeddings, the final norm and the head."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from hivekeeper.blocks.arch import Architecture, architecture_of
from hivekeeper.spec.blockserver import ModelSpec, TinyModelSpec


def tiny_config(tiny: TinyModelSpec):
    import transformers

    common = dict(vocab_size=tiny.vocab_size, tie_word_embeddings=False, attn_implementation="eager")
    if tiny.architecture == "llama":
        return transformers.LlamaConfig(
            hidden_size=tiny.hidden_size, intermediate_size=4 * tiny.hidden_size, num_hidden_layers=tiny.num_layers,
            num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_heads,
            max_position_embeddings=tiny.max_positions, **common)
    return transformers.GPT2Config(n_embd=tiny.hidden_size, n_layer=tiny.num_layers, n_head=tiny.num_heads,
                                   n_positions=tiny.max_positions, **common)


def load_config(model: ModelSpec):
    import transformers

    if model.tiny is not None:
        return tiny_config(model.tiny)
    return transformers.AutoConfig.from_pretrained(_folder(model.checkpoint), local_files_only=True)


def load_model(model: ModelSpec) -> nn.Module:
    """The whole model, in eval mode, float32."""
    import transformers

    if model.tiny is not None:
        # fork_rng: seeding must not disturb the caller's random stream (a sampling client's)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model.tiny.seed)
            built = transformers.AutoModelForCausalLM.from_config(tiny_config(model.tiny))
    else:
        built = transformers.AutoModelForCausalLM.from_pretrained(
            _folder(model.checkpoint), local_files_only=True, torch_dtype=torch.float32)
    return built.eval()


@dataclass
class SpanWeights:
    """The blocks [start, end) of a model, frozen."""

    arch: Architecture
    config: object
    start: int
    end: int
    blocks: nn.ModuleList
    rotary: Optional[nn.Module]


def load_span(model: ModelSpec, start: int, end: int) -> SpanWeights:
    """Blocks [start, end) and nothing else (the rest is dropped as soon as it is built)."""
    full = load_model(model)
    arch = architecture_of(full.config)
    blocks = arch.blocks(full)
    if not 0 <= start < end <= len(blocks):
        raise ValueError(f"span {start}:{end} is outside the model's {len(blocks)} blocks")
    kept = nn.ModuleList(blocks[start:end])
    rotary = full.model.rotary_emb if arch.needs_rotary else None
    for parameter in kept.parameters():
        parameter.requires_grad_(False)
    return SpanWeights(arch, full.config, start, end, kept, rotary)


def num_blocks(model: ModelSpec) -> int:
    """Read without transformers (slow to import), for the roles that hold no weights."""
    if model.tiny is not None:
        return model.tiny.num_layers
    config = json.loads((Path(_folder(model.checkpoint)) / "config.json").read_text())
    for key in ("num_hidden_layers", "n_layer"):
        if isinstance(config.get(key), int):
            return config[key]
    raise ValueError(f"model.checkpoint: {model.checkpoint}/config.json names no number of layers")


def _folder(checkpoint: Optional[str]) -> str:
    path = Path(checkpoint or "")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.checkpoint: {checkpoint!r} is not a Hugging Face folder (no config.json)")
    return str(path)
