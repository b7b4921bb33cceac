"""Where a model's weights come from: a local Hugging Face folder, or a tiny config with seeded
random weights (the same in every process). Never a hub: nothing is downloaded at run time.

A Hugging Face folder whose config.json holds `"hivekeeper_random_weights": {"seed": N}` and no
weight files is a big model with seeded random weights (Llama-style architectures): each
parameter is a hash of (seed, its name, its index), computed on the device it will live on and
bit-identical on CPU and GPU, so a server builds only its span and a client only its embeddings
and head, without ever building the whole model (an 8B model's blocks appear on a GPU in a second).

A server keeps only its span's blocks (and the rotary embedding a Llama-style block needs); a
client keeps only the embeddings, the final norm and the head. Where they live (CPU or a GPU)
and in which dtype: `serving_device()` and `serving_dtype()` (the spec's servers.device and .dtype)."""

from __future__ import annotations

import hashlib
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


RANDOM_WEIGHTS_KEY = "hivekeeper_random_weights"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serving_device(name: str = "cpu") -> torch.device:
    """Where a server keeps its blocks (servers.device) and a client its embeddings and head.
    CPU unless asked: the exact-equality tests compare float32 runs, and a GPU in bfloat16 is a
    different model."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"servers.device is {name}, but torch sees no CUDA device")
    return device


def serving_dtype(device: torch.device, name: Optional[str] = None) -> torch.dtype:
    """servers.dtype, or float32 on the CPU and bfloat16 on a GPU."""
    if not name:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"servers.dtype {name!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(model: ModelSpec, device: Optional[torch.device] = None,
               dtype: torch.dtype = torch.float32) -> nn.Module:
    """The whole model, in eval mode (float32 on the CPU unless asked otherwise)."""
    import transformers

    device = torch.device(device or "cpu")
    if model.tiny is not None:
        # fork_rng: seeding must not disturb the caller's random stream (a sampling client's)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(model.tiny.seed)
            built = transformers.AutoModelForCausalLM.from_config(tiny_config(model.tiny))
        return built.to(device=device, dtype=dtype).eval()
    config = load_config(model)
    if random_weights_seed(config) is not None:
        return _random_model(config, lambda full: None, device, dtype)
    built = transformers.AutoModelForCausalLM.from_pretrained(
        _folder(model.checkpoint), local_files_only=True, torch_dtype=dtype)
    return built.to(device).eval()


def load_client_model(model: ModelSpec, device: Optional[torch.device] = None,
                      dtype: torch.dtype = torch.float32) -> nn.Module:
    """What a client runs: the model without its blocks (embeddings, final norm, head)."""
    config = load_config(model)
    arch = architecture_of(config)
    if model.tiny is None and random_weights_seed(config) is not None:
        return _random_model(config, arch.drop_blocks, device or torch.device("cpu"), dtype)
    full = load_model(model, "cpu", dtype)
    arch.drop_blocks(full)
    return full.to(device or "cpu")


def random_weights_seed(config) -> Optional[int]:
    value = getattr(config, RANDOM_WEIGHTS_KEY, None)
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("seed"), int):
        raise ValueError(f"config.json: {RANDOM_WEIGHTS_KEY} must be {{\"seed\": <int>}}, got {value!r}")
    return value["seed"]


def write_random_checkpoint(folder: Path, config, seed: int = 0) -> Path:
    """A Hugging Face folder (config.json alone) that every process builds the same random model from."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    document = config.to_dict()
    document[RANDOM_WEIGHTS_KEY] = {"seed": seed}
    (folder / "config.json").write_text(json.dumps(document, indent=2))
    return folder


def _random_model(config, prune, device, dtype: torch.dtype) -> nn.Module:
    """Build the architecture without memory (meta tensors), let `prune` drop what this process
    does not keep, then give the rest memory on `device` and fill it from the seeded hash."""
    import transformers

    arch = architecture_of(config)
    if not arch.needs_rotary:
        raise ValueError(f"{RANDOM_WEIGHTS_KEY}: only Llama-style architectures (not {config.model_type!r})")
    seed = random_weights_seed(config)
    with torch.device("meta"):
        full = transformers.AutoModelForCausalLM.from_config(config)
    prune(full)
    full.to(dtype=dtype)
    full.to_empty(device=device)
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, parameter in full.named_parameters():
            if parameter.dim() >= 2:
                hashed_uniform_(parameter, seed, name, std)
            elif name.endswith("bias"):
                parameter.zero_()
            else:  # norm scales
                parameter.fill_(1.0)
    # the only buffer in a Llama-style model: rebuilt, in float32 as transformers keeps it
    full.model.rotary_emb = type(full.model.rotary_emb)(config=full.config, device=device)
    for parameter in full.parameters():
        parameter.requires_grad_(False)
    return full.eval()


_MASK31 = (1 << 31) - 1


def hashed_uniform_(tensor: torch.Tensor, seed: int, name: str, std: float) -> torch.Tensor:
    """Fill with values uniform in [-a, a) (standard deviation `std`) that depend only on (seed,
    name, element index): integer arithmetic below 2**62 and one float rounding, so CPU and
    GPU give the same bits."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    k1, k2, k3 = (int.from_bytes(digest[i:i + 4], "little") & _MASK31 for i in (0, 4, 8))
    scale = std * 3 ** 0.5 / 2 ** 30
    flat = tensor.view(-1)
    chunk = 1 << 24
    for begin in range(0, flat.numel(), chunk):
        count = min(chunk, flat.numel() - begin)
        x = torch.arange(begin, begin + count, device=tensor.device, dtype=torch.int64)
        x = ((x ^ (x >> 31)) + k1) & _MASK31
        for multiplier, k in ((0x2C1B3C6D, k2), (0x297A2D39, k3), (0x3A8F05C5, k1)):
            x = x ^ (x >> 15)
            x = (x * multiplier + k) & _MASK31
        x = x ^ (x >> 13)
        flat[begin:begin + count] = ((x - (1 << 30)).to(torch.float32) * scale).to(tensor.dtype)
    return tensor


@dataclass
class SpanWeights:
    """The blocks [start, end) of a model, frozen."""

    arch: Architecture
    config: object
    start: int
    end: int
    blocks: nn.ModuleList
    rotary: Optional[nn.Module]


def load_span(model: ModelSpec, start: int, end: int, device: Optional[torch.device] = None,
              dtype: torch.dtype = torch.float32) -> SpanWeights:
    """Blocks [start, end) and nothing else (the rest is dropped as soon as it is built; with
    seeded random weights it is never built), on `device` (default CPU) in `dtype`."""
    device = torch.device(device or "cpu")
    config = load_config(model)
    arch = architecture_of(config)
    if model.tiny is None and random_weights_seed(config) is not None:
        total = int(config.num_hidden_layers)
        if not 0 <= start < end <= total:
            raise ValueError(f"span {start}:{end} is outside the model's {total} blocks")

        def keep_span(full: nn.Module) -> None:
            blocks = arch.blocks(full)
            for index in range(len(blocks)):  # keep the indices (parameter names) of the span
                if not start <= index < end:
                    blocks[index] = nn.Identity()
            full.model.embed_tokens, full.lm_head = nn.Identity(), nn.Identity()

        full = _random_model(config, keep_span, device, dtype)
    else:
        full = load_model(model, "cpu", dtype)
    blocks = arch.blocks(full)
    if not 0 <= start < end <= len(blocks):
        raise ValueError(f"span {start}:{end} is outside the model's {len(blocks)} blocks")
    kept = nn.ModuleList(blocks[start:end]).to(device)
    rotary = full.model.rotary_emb.to(device) if arch.needs_rotary else None
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
