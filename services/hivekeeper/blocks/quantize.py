"""8-bit weights: each linear layer's weight kept as int8 with one float scale per output row
(absmax), dequantized on every call. A quarter of the float32 memory; what it costs in speed
and accuracy is measured by bench/bench_block_inference.py."""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
        super().__init__()
        # GPT-2's Conv1D stores (in, out); keep (out, in) rows so scales are per output unit
        w = weight.detach().float().t() if transposed else weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return nn.functional.linear(x, self.qweight.to(x.dtype) * self.scale.to(x.dtype), bias)


def quantize_weights(module: nn.Module) -> int:
    """Replace every nn.Linear and GPT-2 Conv1D inside `module`; returns how many."""
    from transformers.pytorch_utils import Conv1D

    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, (nn.Linear, Conv1D)):
            setattr(module, name, Int8Linear(child.weight, child.bias, transposed=isinstance(child, Conv1D)))
            count += 1
        else:
            count += quantize_weights(child)
    return count


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weights (the state dict: no masks or other non-persistent buffers)."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())
