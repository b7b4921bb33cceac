"""Running a server's span: forward, backward (gradients with respect to the inputs only: the
weights are frozen and never change), and inference sessions that keep attention keys and
values per session within a token budget. Requests are checked before any compute, and every
refusal is a `BlockRequestError` with one line saying why.

The blocks may live on a GPU (in bfloat16, say): tensors arrive and leave as float32 on the CPU
(the wire's form) and are moved here. Llama-style spans decode with a static cache per session
and, on a GPU, a CUDA graph of the one-token step (fast.py); other spans with transformers'
DynamicCache.

Calls come one at a time, under the server's compute lock (BlockServicer), so no locks are needed here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from hivekeeper.blocks.arch import causal_mask
from hivekeeper.blocks.checkpoint import SpanWeights
from hivekeeper.blocks.fast import StaticSessionCache, StaticSpanRunner, supports_static_cache

MAX_REQUEST_TOKENS = 65536  # batch x length in one request; bigger ones are split by the client


class BlockRequestError(ValueError):
    """A request this server refuses; the message goes back to the client as is."""


@dataclass
class Session:
    session_id: str
    start: int
    end: int
    batch: int
    max_length: int
    cache: object  # StaticSessionCache, or a transformers DynamicCache over the session's blocks
    position: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def reserved(self) -> int:
        return self.batch * self.max_length


class SpanBackend:
    def __init__(self, weights: SpanWeights, cache_tokens: int, max_session_tokens: int, session_timeout: float,
                 static_cache: Optional[bool] = None, cuda_graphs: Optional[bool] = None):
        """`static_cache`: decode with fast.py's static cache (default: on a GPU, for spans that
        support it); `cuda_graphs`: capture its one-token step (default: on a GPU)."""
        self.weights = weights
        self.hidden_size = int(weights.config.hidden_size)
        self.cache_tokens = cache_tokens
        self.max_session_tokens = max_session_tokens
        self.session_timeout = session_timeout
        self.sessions: dict[str, Session] = {}
        tensor = next(t for t in weights.blocks.state_dict().values() if t.is_floating_point())
        self.device, self.dtype = tensor.device, tensor.dtype
        on_gpu = self.device.type == "cuda"
        if static_cache is None:
            static_cache = on_gpu and supports_static_cache(weights, max_session_tokens)
        self.runner = StaticSpanRunner(weights, max_session_tokens, on_gpu if cuda_graphs is None else cuda_graphs) \
            if static_cache else None
        self.last_gpu_ms: Optional[float] = None  # device time of the last inference step (on a GPU)
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if on_gpu else None

    @property
    def start(self) -> int:
        return self.weights.start

    @property
    def end(self) -> int:
        return self.weights.end

    @property
    def cache_tokens_left(self) -> int:
        return self.cache_tokens - sum(s.reserved for s in self.sessions.values())

    # --- checks --------------------------------------------------------------------------

    def check_span(self, start: int, end: int) -> None:
        if not (self.start <= start < end <= self.end):
            raise BlockRequestError(f"blocks {start}:{end} are not served here (this server holds "
                                    f"{self.start}:{self.end})")

    def check_hidden(self, hidden: torch.Tensor, what: str = "hidden states") -> None:
        if hidden.dim() != 3 or hidden.shape[-1] != self.hidden_size:
            raise BlockRequestError(f"{what}: expected shape (batch, length, {self.hidden_size}), "
                                    f"got {tuple(hidden.shape)}")
        if not hidden.is_floating_point():
            raise BlockRequestError(f"{what}: expected floating point, got {hidden.dtype}")
        if hidden.shape[0] * hidden.shape[1] > MAX_REQUEST_TOKENS or hidden.shape[0] * hidden.shape[1] == 0:
            raise BlockRequestError(f"{what}: {hidden.shape[0]} x {hidden.shape[1]} tokens; "
                                    f"1 to {MAX_REQUEST_TOKENS} per request")
        if not torch.isfinite(hidden).all():
            raise BlockRequestError(f"{what}: contains NaN or infinity")

    # --- stateless -----------------------------------------------------------------------

    def _run(self, hidden: torch.Tensor, start: int, end: int, past: int, cache) -> torch.Tensor:
        w = self.weights
        batch, length, _ = hidden.shape
        positions = torch.arange(past, past + length, device=self.device)[None].expand(batch, length)
        mask = causal_mask(batch, past, length, hidden.dtype).to(self.device)
        rotary = w.rotary(hidden, positions) if w.rotary is not None else None
        for index in range(start, end):
            hidden = w.arch.run_block(w.blocks[index - w.start], hidden, positions, mask, cache, rotary)
        return hidden

    def _in(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.device, self.dtype)

    @staticmethod
    def _out(hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to("cpu", torch.float32)

    def forward(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        self.check_span(start, end)
        self.check_hidden(hidden)
        with torch.no_grad():
            return self._out(self._run(self._in(hidden), start, end, 0, None))

    def backward(self, hidden: torch.Tensor, grad_output: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """d(loss)/d(hidden) given d(loss)/d(output): the forward is recomputed (nothing is kept
        between calls), and only the input needs a gradient."""
        self.check_span(start, end)
        self.check_hidden(hidden)
        self.check_hidden(grad_output, "output gradients")
        if grad_output.shape != hidden.shape:
            raise BlockRequestError(f"output gradients: shape {tuple(grad_output.shape)} differs from the "
                                    f"inputs' {tuple(hidden.shape)}")
        with torch.enable_grad():
            inputs = self._in(hidden).detach().requires_grad_(True)
            outputs = self._run(inputs, start, end, 0, None)
            (grad,) = torch.autograd.grad(outputs, inputs, self._in(grad_output))
        return self._out(grad)

    # --- sessions ------------------------------------------------------------------------

    def inference_step(self, session_id: str, hidden: torch.Tensor, start: int, end: int,
                       max_length: Optional[int]) -> torch.Tensor:
        """Run new positions of a session; the first step opens it (and needs `max_length`).
        Takes and returns float32 CPU tensors (the wire's form)."""
        return self._out(self.inference_step_on_device(session_id, hidden, start, end, max_length))

    def inference_step_on_device(self, session_id: str, hidden: torch.Tensor, start: int, end: int,
                                 max_length: Optional[int]) -> torch.Tensor:
        """The same, leaving the output on this backend's device and in its dtype (for callers
        in this process; valid until the session's next step)."""
        from transformers import DynamicCache

        self.expire_sessions()
        self.check_span(start, end)
        self.check_hidden(hidden)
        session = self.sessions.get(session_id)
        if session is None:
            if max_length is None:
                raise BlockRequestError(f"session {session_id}: unknown here (expired, or this server restarted "
                                        f"or moved); open a new one")
            if not 1 <= max_length <= self.max_session_tokens:
                raise BlockRequestError(f"session {session_id}: max_length {max_length} is outside 1.."
                                        f"{self.max_session_tokens}")
            needed = hidden.shape[0] * max_length
            if needed > self.cache_tokens_left:
                raise BlockRequestError(f"attention cache exhausted: the session needs {needed} tokens, "
                                        f"{self.cache_tokens_left} of {self.cache_tokens} left")
            session = Session(session_id, start, end, hidden.shape[0], max_length, None)
        if (start, end) != (session.start, session.end) or hidden.shape[0] != session.batch:
            raise BlockRequestError(f"session {session_id}: opened for blocks {session.start}:{session.end}, "
                                    f"batch {session.batch}; got blocks {start}:{end}, batch {hidden.shape[0]}")
        if session.position + hidden.shape[1] > session.max_length:
            raise BlockRequestError(f"session {session_id}: {session.position} + {hidden.shape[1]} tokens exceed "
                                    f"its max_length {session.max_length}")
        if session.cache is None:  # allocated only once the first step passed every check
            session.cache = self.runner.new_cache(start, end, session.batch, max_length) \
                if self.runner is not None else DynamicCache()
        self.sessions[session_id] = session
        x = self._in(hidden)
        if self._events is not None:
            self._events[0].record()
        with torch.no_grad():
            if isinstance(session.cache, StaticSessionCache):
                out = self.runner.step(session.cache, x, session.position)
            else:
                out = self._run(x, start, end, session.position, session.cache)
        if self._events is not None:
            self._events[1].record()
            self._events[1].synchronize()
            self.last_gpu_ms = self._events[0].elapsed_time(self._events[1])
        session.position += hidden.shape[1]
        session.last_used = time.monotonic()
        return out

    def close_session(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    def expire_sessions(self) -> None:
        now = time.monotonic()
        for session_id in [s.session_id for s in self.sessions.values() if now - s.last_used > self.session_timeout]:
            del self.sessions[session_id]
