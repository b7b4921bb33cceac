"""Fast decoding for a Llama-style span: a static attention cache per session and, on a GPU, the
span's one-token step captured once per session as a CUDA graph and replayed for every token.

Why: one decoding step of a span is a few hundred small kernels (norms, projections, rotary,
attention, MLP per block). Launched from Python one by one (transformers' blocks with a
DynamicCache), the launches, not the GPU, set the pace: at batch 1 the GPU idles most of the
step. A static cache gives the step fixed shapes and addresses, so it can be captured as a graph
and replayed with one launch; the step then runs at close to the speed memory bandwidth allows
(every weight of the span read once per token).

The step computes what transformers' eager Llama block computes (the same weights, rotary
tables, float32 norms and softmax), in fewer kernels: the query, key and value projections are
one matrix product (their weights are rows of one tensor, and the modules keep views of it, so
memory does not grow and transformers' own path still works), gate and up likewise; the norm is
torch's fused rms_norm; rotary runs once over queries and keys together. On the CPU in float32
it agrees with the DynamicCache path to rounding; tests check that.

A session's cache holds keys and values for all of its `max_length` positions, reserved when it
opens (the backend already budgets cache tokens that way); positions not yet written are masked.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("hivekeeper.blocks.fast")


def supports_static_cache(weights, max_length: int) -> bool:
    """Llama-style blocks (rotary, no sliding window shorter than a session)."""
    config = weights.config
    if not weights.arch.needs_rotary:
        return False
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return window is None or window >= max_length


class StaticSessionCache:
    """Keys and values of blocks [start, end) for one session, and its captured step."""

    def __init__(self, start: int, end: int, batch: int, max_length: int, kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype):
        self.start, self.end = start, end
        shape = (batch, kv_heads, max_length, head_dim)
        # zeros, not empty: masked positions must hold finite values (0 * NaN is NaN)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(start, end)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(start, end)]
        self.key_positions = torch.arange(max_length, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.graph_input: Optional[torch.Tensor] = None
        self.graph_index: Optional[torch.Tensor] = None
        self.graph_output: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class _FusedBlock:
    """One block's weights, arranged for the fused step (views shared with the block's modules)."""

    def __init__(self, block: nn.Module, q_rows: int, kv_rows: int):
        attn, mlp = block.self_attn, block.mlp
        self.block = block
        self.eps = (float(block.input_layernorm.variance_epsilon), float(block.post_attention_layernorm.variance_epsilon))
        self.qkv_weight, self.qkv_bias = _fuse_rows(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up_weight, self.gate_up_bias = _fuse_rows(mlp.gate_proj, mlp.up_proj)
        self.q_rows, self.kv_rows = q_rows, kv_rows


def _fuse_rows(*linears: nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One weight tensor holding the linears' rows; each linear's weight becomes a view of it."""
    with torch.no_grad():
        weight = torch.cat([linear.weight for linear in linears])
        biases = [linear.bias for linear in linears]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        row = 0
        for linear in linears:
            rows = linear.weight.shape[0]
            linear.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
            row += rows
    return weight, bias


def _fusable(block: nn.Module) -> bool:
    attn, mlp = block.self_attn, block.mlp
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    biases = {attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None} \
        if all(type(m) is nn.Linear for m in linears) else set()
    return (all(type(m) is nn.Linear for m in linears) and len(biases) == 1
            and mlp.gate_proj.bias is None and mlp.up_proj.bias is None
            and getattr(getattr(block.mlp, "config", None), "hidden_act", "silu") == "silu"
            and hasattr(block.input_layernorm, "variance_epsilon")
            and hasattr(block.post_attention_layernorm, "variance_epsilon"))


class StaticSpanRunner:
    """Runs blocks of one server's span (weights: checkpoint.SpanWeights) with static caches."""

    def __init__(self, weights, max_positions: int, cuda_graphs: bool):
        config = weights.config
        self.weights = weights
        tensor = next(t for t in weights.blocks.state_dict().values() if t.is_floating_point())
        self.device, self.dtype = tensor.device, tensor.dtype
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        first = weights.blocks[0].self_attn
        self.scaling = float(getattr(first, "scaling", self.head_dim ** -0.5))
        # Rotary tables for every position a session can reach: the same cos/sin the
        # transformers rotary module returns for those positions (an outer product, then cos/sin).
        with torch.no_grad():
            probe = torch.zeros(1, device=self.device, dtype=self.dtype)
            cos, sin = weights.rotary(probe, torch.arange(max_positions, device=self.device)[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * sin_signed: one kernel fewer
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1).contiguous()
        self.masked = torch.finfo(self.dtype).min
        blocks = list(weights.blocks)
        q_rows, kv_rows = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.fused = [_FusedBlock(b, q_rows, kv_rows) for b in blocks] if all(_fusable(b) for b in blocks) else None
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graph_error: Optional[str] = None
        self.graphs_captured = 0

    def new_cache(self, start: int, end: int, batch: int, max_length: int) -> StaticSessionCache:
        if max_length > self.cos.shape[0]:
            raise ValueError(f"max_length {max_length} exceeds the {self.cos.shape[0]} positions prepared")
        return StaticSessionCache(start, end, batch, max_length, self.kv_heads, self.head_dim, self.device, self.dtype)

    # --- the computation ------------------------------------------------------------------

    def _forward(self, hidden: torch.Tensor, index: torch.Tensor, cache: StaticSessionCache) -> torch.Tensor:
        """hidden (batch, length, hidden) at positions `index` (length,), a device tensor, so the
        same code runs eagerly and inside a captured graph."""
        length = hidden.shape[1]
        mask = torch.zeros(length, cache.key_positions.shape[0], device=self.device, dtype=self.dtype)
        mask = mask.masked_fill(cache.key_positions[None, :] > index[:, None], self.masked)
        if self.fused is not None:
            cos = self.cos.index_select(0, index)[None, :, None]  # (1, length, 1, head_dim)
            sin = self.sin_signed.index_select(0, index)[None, :, None]
            for k, block_index in enumerate(range(cache.start, cache.end)):
                hidden = self._fused_block(self.fused[block_index - self.weights.start], hidden, cos, sin, index, mask,
                                           cache.keys[k], cache.values[k])
            return hidden
        cos = self.cos.index_select(0, index)[None, None]  # (1, 1, length, head_dim)
        sin = self.sin.index_select(0, index)[None, None]
        blocks = self.weights.blocks
        for k, block_index in enumerate(range(cache.start, cache.end)):
            block = blocks[block_index - self.weights.start]
            hidden = self._block(block, hidden, cos, sin, index, mask, cache.keys[k], cache.values[k])
        return hidden

    def _fused_block(self, f: _FusedBlock, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                     index: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        block = f.block
        h = F.rms_norm(x, (width,), eps=f.eps[0]) * block.input_layernorm.weight
        qkv = F.linear(h, f.qkv_weight, f.qkv_bias).view(batch, length, -1, self.head_dim)
        qk, v = qkv[:, :, :self.heads + self.kv_heads], qkv[:, :, self.heads + self.kv_heads:]
        qk = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin_signed)  # rotary, queries and keys
        q, k = qk[:, :, :self.heads].transpose(1, 2), qk[:, :, self.heads:].transpose(1, 2)
        keys.index_copy_(2, index, k)
        values.index_copy_(2, index, v.transpose(1, 2))
        out = self._attend(q, keys, values, mask)
        x = x + block.self_attn.o_proj(out)
        h = F.rms_norm(x, (width,), eps=f.eps[1]) * block.post_attention_layernorm.weight
        gate, up = F.linear(h, f.gate_up_weight, f.gate_up_bias).chunk(2, dim=-1)
        return x + block.mlp.down_proj(F.silu(gate) * up)

    def _block(self, block: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: torch.Tensor,
               mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        attn = block.self_attn
        h = block.input_layernorm(x)
        q = attn.q_proj(h).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys.index_copy_(2, index, k)
        values.index_copy_(2, index, v)
        out = self._attend(q, keys, values, mask)
        x = x + attn.o_proj(out)
        return x + block.mlp(block.post_attention_layernorm(x))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eager attention over the whole static cache (grouped heads share their key/value head
        without copying it); softmax in float32, as transformers' eager attention."""
        batch, heads, length, dim = q.shape
        group = heads // self.kv_heads
        grouped = q.reshape(batch, self.kv_heads, group * length, dim)
        scores = torch.matmul(grouped, keys.transpose(2, 3)).view(batch, self.kv_heads, group, length, -1)
        scores = torch.add(mask, scores, alpha=self.scaling)  # scale and mask in one kernel
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs.view(batch, self.kv_heads, group * length, -1), values)
        return out.view(batch, heads, length, dim).transpose(1, 2).reshape(batch, length, heads * dim)

    # --- steps ----------------------------------------------------------------------------

    def step(self, cache: StaticSessionCache, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """New positions [position, position + length) of a session; hidden on this runner's
        device and dtype. A one-token step on a GPU replays the session's graph; its output is
        valid until the session's next step."""
        with torch.no_grad():
            if hidden.shape[1] == 1 and self.cuda_graphs:
                if cache.graph is None:
                    self._capture(cache, hidden, position)
                if cache.graph is not None:
                    cache.graph_input.copy_(hidden)
                    cache.graph_index.fill_(position)
                    cache.graph.replay()
                    return cache.graph_output
            index = torch.arange(position, position + hidden.shape[1], device=self.device)
            return self._forward(hidden, index, cache)

    def _capture(self, cache: StaticSessionCache, hidden: torch.Tensor, position: int) -> None:
        """Capture the session's one-token step. The warm-up on a side stream computes this very
        step (the replay that follows writes the same keys and values again). If capture fails,
        graphs are off for this runner and steps run eagerly."""
        cache.graph_input = hidden.clone()
        cache.graph_index = torch.full((1,), position, device=self.device, dtype=torch.long)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(cache.graph_input, cache.graph_index, cache)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # A private memory pool per graph: sessions come and go, and a pool shared between
            # graphs must not be captured into again once every graph using it is gone.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                cache.graph_output = self._forward(cache.graph_input, cache.graph_index, cache)
            cache.graph = graph
            self.graphs_captured += 1
        except Exception as e:  # keep serving, eagerly
            self.cuda_graphs = False
            self.graph_error = f"{type(e).__name__}: {e}"
            cache.graph = cache.graph_output = None
            log.warning("CUDA graph capture failed; decoding eagerly", extra={"fields": {"error": self.graph_error}})


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
