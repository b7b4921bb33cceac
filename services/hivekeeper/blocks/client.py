"""The client: a PyTorch module over remote blocks (local embeddings and head, the blocks on
servers), inference sessions that survive a server's death, and forward/backward through the
servers for parameter-efficient fine-tuning.

Failover (Petals section 3.2): a session remembers, for each hop of its chain, every input it
sent. When a server dies (or refuses, or answers garbage), the client bans it, routes the hop's
blocks through other servers, replays the remembered inputs to the replacement to rebuild its
attention cache, and carries on: the generated tokens are the same."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from hivekeeper.blocks import protocol
from hivekeeper.blocks.arch import architecture_of
from hivekeeper.blocks.checkpoint import load_client_model, load_model, serving_device, serving_dtype
from hivekeeper.blocks.direct import DirectCallError, DirectClient, admission_on
from hivekeeper.blocks.protocol import ServerInfo
from hivekeeper.blocks.routing import Hop, NoRouteError, fastest_chain, throughput_chain
from hivekeeper.spec.blockserver import ModelSpec

log = logging.getLogger("hivekeeper.blocks.client")
REFRESH_SECONDS = 2.0  # how stale the client's view of the servers may be
# A failed server is avoided BAN_SECONDS (longer than its record lives: a crashed server's record
# is gone before the ban ends), times BAN_BACKOFF for each further failure before it answers well.
BAN_SECONDS, BAN_BACKOFF = 30.0, 2.0
MAX_FAILURES = 8  # per call: servers tried before giving up


class RemoteBlocksError(RuntimeError):
    """The remote blocks could not run the request; the message says which blocks and why."""


class ServerError(Exception):
    """One server failed one call: down, refused (its one-line reason; `code` is the server's
    protocol.ErrorCode), or answered garbage."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class RemoteSequence:
    """Blocks [0, num_blocks) of one BlockServer swarm, as the client sees them: the servers'
    DHT records, routing, and RPC calls with clear errors."""

    def __init__(self, dht, run_id: str, num_blocks: int, hidden_size: int, compression: str = "none",
                 request_timeout: float = 30.0, route_wait: float = 60.0, seed: int = 0, direct: bool = True):
        """`direct`: call servers on their direct port where they announce one and it answers
        (direct.py; never where this process admits peers by token), else through p2pd."""
        from hivemind.dht.node import Blacklist
        from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
        from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE

        from hivekeeper.hivemind_ext.p2pd import Redialer, running_loop
        from hivekeeper.runtime.reports import announced_addresses

        self.dht, self.run_id = dht, run_id
        self.num_blocks, self.hidden_size = num_blocks, hidden_size
        self.compression = compression
        self.request_timeout, self.route_wait = request_timeout, route_wait
        self.max_request_tokens = max(1, MAX_UNARY_PAYLOAD_SIZE // (4 * hidden_size) // 2)
        self._worker = RemoteExpertWorker
        self._p2p = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())
        # a server whose call failed is dialed at the addresses it announces (another lab's cluster)
        self._redialer = Redialer(self._p2p, RemoteExpertWorker.run_coroutine(running_loop()),
                                  partial(announced_addresses, dht, run_id))
        self._servers: list[ServerInfo] = []
        self._by_peer: dict[str, ServerInfo] = {}
        self._refreshed = 0.0
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servers")  # background reads
        self._pending = None  # a background read in flight
        self.direct = DirectClient() if direct and not admission_on() else None
        # servers that failed, avoided with exponential backoff; a server that answers well is forgiven
        self.banned = Blacklist(base_time=BAN_SECONDS, backoff_rate=BAN_BACKOFF)
        self._ban_lock = threading.Lock()  # the parts of a batch run on threads of their own
        self.rtt: dict[str, float] = {}
        self.rng = random.Random(seed)
        self.failovers = 0
        # Set to a list to record every call_hop: {start, end, via (direct or p2pd), tokens, rpc_ms,
        # encode_ms, call_ms, and the server's handler_ms / queue_ms / compute_ms / gpu_ms from
        # its reply} (benchmarks' breakdown).
        self.hop_log: Optional[list[dict]] = None
        self._via = threading.local()  # the path the calling thread's last call took

    def close(self) -> None:
        """Close the direct connections and this process's handle on the DHT's p2pd (before
        the DHT itself shuts down)."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        if self.direct is not None:
            self.direct.close()
        self._worker.run_coroutine(self._p2p.shutdown())

    # --- what the DHT says -----------------------------------------------------------------

    def servers(self, refresh: bool = False) -> list[ServerInfo]:
        """The servers' records. A view older than REFRESH_SECONDS is returned as it is while a
        fresh one is read in the background (a DHT read costs milliseconds that a new session's
        first token need not wait for); `refresh`, and the first call, wait for a fresh read."""
        pending = self._pending
        if pending is not None and pending.done():
            self._pending = None
            try:
                self._adopt(pending.result())
            except Exception as e:  # noqa: BLE001 (the DHT's errors: keep the view, read again later)
                log.debug("reading the servers failed", extra={"fields": {"why": f"{type(e).__name__}: {e}"}})
        if refresh or not self._refreshed:
            self._adopt(protocol.read_servers(self.dht, self.run_id))
        elif time.monotonic() - self._refreshed > REFRESH_SECONDS and self._pending is None:
            self._pending = self._reader.submit(protocol.read_servers, self.dht, self.run_id)
        return self._servers

    def _adopt(self, servers: list[ServerInfo]) -> None:
        self._by_peer = {s.peer_id: s for s in servers}
        self._servers = servers
        self._refreshed = time.monotonic()

    def ban(self, peer_id: str, reason: str, failover: bool = False) -> None:
        """Avoid a server for a while; `failover`: it failed a call, which goes on elsewhere."""
        log.warning("avoiding server", extra={"fields": {"peer_id": peer_id, "reason": reason}})
        with self._ban_lock:
            self.banned.register_failure(peer_id)
        self.failovers += failover

    def _banned(self, servers: Sequence[ServerInfo]) -> set[str]:
        with self._ban_lock:
            return {s.peer_id for s in servers if s.peer_id in self.banned}

    def route(self, start: int, end: int, for_inference: bool) -> list[Hop]:
        """A chain for [start, end); waits up to `route_wait` for servers to cover it."""
        deadline = time.monotonic() + self.route_wait
        refresh = False
        while True:
            servers = self.servers(refresh)
            try:
                if for_inference:
                    self._ping_unknown(servers)
                    return fastest_chain(servers, start, end, self.rtt, self._banned(servers))
                return throughput_chain(servers, start, end, self.rng, self._banned(servers))
            except NoRouteError as e:
                if time.monotonic() >= deadline:
                    raise RemoteBlocksError(f"blocks {start}:{end}: {e} (waited {self.route_wait:.0f}s)") from None
            time.sleep(0.5)
            refresh = True

    def _ping_unknown(self, servers: Sequence[ServerInfo]) -> None:
        """Round trips to servers not measured yet (Petals pings before routing)."""
        banned = self._banned(servers)
        for s in servers:
            if s.peer_id not in self.rtt and s.peer_id not in banned and s.state == protocol.ONLINE:
                began = time.perf_counter()
                try:
                    self.call("rpc_info", s.peer_id, protocol.make_request(0, 0, [], {}), timeout=5.0)
                except ServerError as e:
                    self.ban(s.peer_id, str(e))
                    continue
                self.rtt[s.peer_id] = time.perf_counter() - began

    # --- calls -----------------------------------------------------------------------------

    def call(self, method: str, peer_id: str, request, timeout: Optional[float] = None):
        """`method` (rpc_KIND) on a server: over its direct port if it has one this client
        reaches, else through p2pd. ServerError if it failed or refused."""
        response = self._call_direct(method, peer_id, request, timeout)
        if response is None:
            response = self._call_p2pd(method, peer_id, request, timeout)
        try:
            error = protocol.read_error(response)
        except Exception as e:  # msgpack's errors, or a malformed reason
            raise ServerError(f"undecodable reply: {e}") from None
        if error is not None:
            raise ServerError(error[1], code=error[0])
        return response

    def _call_direct(self, method: str, peer_id: str, request, timeout: Optional[float]):
        """The reply over the direct path; None where there is none to this server."""
        from hivemind.proto import runtime_pb2

        server = self._by_peer.get(peer_id)
        if self.direct is None or server is None or not server.direct:
            return None
        try:
            data = self.direct.call(peer_id, server.direct, method.removeprefix("rpc_"), request.SerializeToString(),
                                    timeout or self.request_timeout)
        except DirectCallError as e:
            raise ServerError(str(e)) from None
        if data is None:
            return None
        self._via.name = "direct"
        try:
            return runtime_pb2.ExpertResponse.FromString(data)
        except Exception as e:  # noqa: BLE001 (protobuf's DecodeError)
            raise ServerError(f"undecodable reply: {type(e).__name__}") from None

    def _call_p2pd(self, method: str, peer_id: str, request, timeout: Optional[float]):
        from hivemind.p2p import PeerID

        from hivekeeper.blocks.server import BlockServicer

        stub = BlockServicer.get_stub(self._p2p, PeerID.from_base58(peer_id))
        self._via.name = "p2pd"
        try:
            return self._worker.run_coroutine(getattr(stub, method)(request, timeout=timeout or self.request_timeout))
        except Exception as e:  # down, timed out, crashed: the caller decides what to do next
            self._redialer.failed(peer_id)
            raise ServerError(_explain(e)) from None

    def call_hop(self, kind: str, hop: Hop, tensors: Sequence[torch.Tensor], metadata: dict,
                 expect: tuple[int, ...]) -> torch.Tensor:
        """One hop; a reply of the wrong shape or with NaNs is a server failure too."""
        began = time.perf_counter()
        request = protocol.make_request(hop.start, hop.end, tensors, metadata, self.compression)
        sent = time.perf_counter()
        response = self.call(f"rpc_{kind}", hop.peer_id, request)
        answered = time.perf_counter()
        try:
            outputs = protocol.read_tensors(response)
        except Exception as e:
            raise ServerError(f"undecodable reply: {e}") from None
        if self.hop_log is not None:
            served = protocol.read_metadata(response)
            self.hop_log.append({"kind": kind, "start": hop.start, "end": hop.end, "via": self._via.name,
                                 "tokens": int(tensors[0].shape[1]) if tensors and tensors[0].dim() == 3 else 0,
                                 "rpc_ms": 1000 * (time.perf_counter() - began),
                                 "encode_ms": 1000 * (sent - began), "call_ms": 1000 * (answered - sent),
                                 **{k: served[k] for k in ("compute_ms", "gpu_ms", "handler_ms", "queue_ms")
                                    if isinstance(served.get(k), float)}})
        if len(outputs) != 1 or tuple(outputs[0].shape) != expect or not torch.isfinite(outputs[0]).all():
            shapes = [tuple(t.shape) for t in outputs]
            raise ServerError(f"garbage reply: expected one finite tensor of shape {expect}, got {shapes}")
        with self._ban_lock:  # it answered well: a later failure starts from the shortest ban again
            self.banned.register_success(hop.peer_id)
        return outputs[0]

    def close_session(self, hop: Hop, session_id: str) -> None:
        try:
            self.call("rpc_close", hop.peer_id, protocol.make_request(hop.start, hop.end, [], {"session": session_id}),
                       timeout=5.0)
        except ServerError:
            pass  # it expires on the server anyway

    # --- forward and backward with failover -----------------------------------------------

    def _with_failover(self, start: int, end: int, for_inference: bool, run: Callable[[list[Hop]], torch.Tensor],
                       ) -> torch.Tensor:
        last = ""
        for _ in range(MAX_FAILURES):
            try:
                chain = self.route(start, end, for_inference)
            except RemoteBlocksError as e:
                raise RemoteBlocksError(f"{e}; last failure: {last}" if last else str(e)) from None
            try:
                return run(chain)
            except _HopFailed as failed:
                last = f"{failed.hop.peer_id[-8:]} (blocks {failed.hop.start}:{failed.hop.end}): {failed.reason}"
                self.ban(failed.hop.peer_id, failed.reason, failover=True)
        raise RemoteBlocksError(f"blocks {start}:{end}: {MAX_FAILURES} servers failed; last: {last}")

    def forward_span(self, hidden: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, list[tuple[Hop, torch.Tensor]]]:
        """Outputs of blocks [start, end), and each hop with its input (kept for backward)."""
        trace: list[tuple[Hop, torch.Tensor]] = []

        def run(chain: list[Hop]) -> torch.Tensor:
            trace.clear()
            x = hidden
            for hop in chain:
                trace.append((hop, x))
                x = _hop(self, "forward", hop, [x], {}, tuple(x.shape))
            return x

        out = self._with_failover(start, end, False, run)
        return out, list(trace)

    def backward_span(self, trace: list[tuple[Hop, torch.Tensor]], grad: torch.Tensor) -> torch.Tensor:
        """Gradients w.r.t. the span's input. A hop whose server fails is recomputed through
        another chain (forward again, then backward)."""
        for hop, x in reversed(trace):
            try:
                grad = _hop(self, "backward", hop, [x, grad], {}, tuple(x.shape))
            except _HopFailed as failed:
                self.ban(hop.peer_id, failed.reason, failover=True)
                grad = self._backward_elsewhere(x, grad, hop.start, hop.end)
        return grad

    def _backward_elsewhere(self, x: torch.Tensor, grad: torch.Tensor, start: int, end: int) -> torch.Tensor:
        def run(chain: list[Hop]) -> torch.Tensor:
            inputs = [x]
            for hop in chain[:-1]:
                inputs.append(_hop(self, "forward", hop, [inputs[-1]], {}, tuple(x.shape)))
            g = grad
            for hop, hop_input in zip(reversed(chain), reversed(inputs)):
                g = _hop(self, "backward", hop, [hop_input, g], {}, tuple(x.shape))
            return g

        return self._with_failover(start, end, False, run)

    def parts(self, batch: int, length: int) -> list[slice]:
        """Split a batch so each request stays under the wire's message limit; each part takes
        its own chain, which is what spreads a large batch over servers."""
        rows = max(1, self.max_request_tokens // max(length, 1))
        return [slice(i, min(i + rows, batch)) for i in range(0, batch, rows)]


@dataclass
class _HopFailed(Exception):
    hop: Hop
    reason: str


def _hop(sequence: RemoteSequence, kind: str, hop: Hop, tensors: Sequence[torch.Tensor], metadata: dict,
         expect: tuple[int, ...]) -> torch.Tensor:
    try:
        return sequence.call_hop(kind, hop, tensors, metadata, expect)
    except ServerError as e:
        raise _HopFailed(hop, str(e)) from None


def _explain(error: Exception) -> str:
    """What went wrong on the way (refusals come in the reply: protocol.read_error)."""
    if isinstance(error, TimeoutError) or type(error).__name__ == "TimeoutError":
        return "timed out"
    return (str(error) or type(error).__name__).splitlines()[0][:300]


class _RemoteBlocks(torch.autograd.Function):
    """Blocks [0, num_blocks) as one differentiable op: forward and backward on the servers."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, sequence: RemoteSequence) -> torch.Tensor:
        parts = sequence.parts(hidden.shape[0], hidden.shape[1])
        wire = _to_wire(hidden)
        with ThreadPoolExecutor(max_workers=max(1, min(len(parts), 4))) as pool:
            results = list(pool.map(lambda p: sequence.forward_span(wire[p], 0, sequence.num_blocks), parts))
        ctx.sequence, ctx.parts, ctx.traces = sequence, parts, [trace for _, trace in results]
        ctx.like = (hidden.device, hidden.dtype)
        return torch.cat([out for out, _ in results]).to(*ctx.like)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        sequence: RemoteSequence = ctx.sequence
        wire = _to_wire(grad_output)
        with ThreadPoolExecutor(max_workers=max(1, min(len(ctx.parts), 4))) as pool:
            grads = list(pool.map(lambda pt: sequence.backward_span(pt[1], wire[pt[0]].contiguous()),
                                  zip(ctx.parts, ctx.traces)))
        return torch.cat(grads).to(*ctx.like), None


def _to_wire(hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states as they travel: float32 on the CPU (the servers cast to their own dtype)."""
    return hidden.detach().to("cpu", torch.float32)


@dataclass
class _HopSession:
    hop: Hop
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    inputs: list[torch.Tensor] = field(default_factory=list)  # everything sent, for replay


class InferenceSession:
    """A chain of server sessions holding this generation's attention caches."""

    def __init__(self, sequence: RemoteSequence, max_length: int):
        self.sequence = sequence
        self.max_length = max_length
        self.position = 0
        self.hops: list[_HopSession] = [_HopSession(hop) for hop in sequence.route(0, sequence.num_blocks, True)]

    @property
    def chain(self) -> list[Hop]:
        return [h.hop for h in self.hops]

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run new positions (batch, length, hidden) through every block; returns their outputs."""
        if hidden.dim() != 3 or hidden.shape[-1] != self.sequence.hidden_size:
            raise ValueError(f"hidden states: expected (batch, length, {self.sequence.hidden_size}), "
                             f"got {tuple(hidden.shape)}")
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(f"session: {self.position} + {hidden.shape[1]} tokens exceed max_length {self.max_length}")
        x, k, failures, last = _to_wire(hidden), 0, 0, ""
        while k < len(self.hops):
            hs = self.hops[k]
            meta = {"session": hs.session_id, "max_length": self.max_length}
            try:
                out = _hop(self.sequence, "inference", hs.hop, [x], meta, tuple(x.shape))
            except _HopFailed as failed:
                failures += 1
                last = f"blocks {hs.hop.start}:{hs.hop.end}: {failed.reason}"
                if failures >= MAX_FAILURES:
                    raise RemoteBlocksError(f"inference: {failures} servers failed; last: {last}") from None
                self.sequence.ban(hs.hop.peer_id, failed.reason, failover=True)
                try:
                    self._replace(k)
                except RemoteBlocksError as e:
                    raise RemoteBlocksError(f"{e}; last failure: {last}") from None
                continue
            hs.inputs.append(x)
            x, k = out, k + 1
        self.position += hidden.shape[1]
        return x.to(hidden.device, hidden.dtype)

    def _replace(self, k: int) -> None:
        """Route hop k's blocks through other servers and replay its past inputs there, so their
        caches hold what the failed server's did; a replacement failing during replay is banned
        and another route tried. Raises RemoteBlocksError when no route is left."""
        old = self.hops[k]
        history = torch.cat(old.inputs, dim=1) if old.inputs else None
        for _ in range(MAX_FAILURES):
            chain = self.sequence.route(old.hop.start, old.hop.end, True)
            fresh = [_HopSession(hop) for hop in chain]
            x = history
            try:
                for hs in fresh if x is not None else ():
                    meta = {"session": hs.session_id, "max_length": self.max_length}
                    out = _hop(self.sequence, "inference", hs.hop, [x], meta, tuple(x.shape))
                    hs.inputs.append(x)
                    x = out
            except _HopFailed as failed:
                self.sequence.ban(failed.hop.peer_id, failed.reason, failover=True)
                continue
            self.hops[k : k + 1] = fresh
            log.info("failover", extra={"fields": {"blocks": [old.hop.start, old.hop.end],
                                                   "replayed": 0 if history is None else history.shape[1],
                                                   "now": [h.peer_id[-8:] for h in chain]}})
            return
        raise RemoteBlocksError(f"blocks {old.hop.start}:{old.hop.end}: {MAX_FAILURES} replacements failed")

    def close(self) -> None:
        for hs in self.hops:
            self.sequence.close_session(hs.hop, hs.session_id)

    def __enter__(self) -> "InferenceSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RemoteCausalLM(nn.Module):
    """A causal language model whose blocks run on servers. Embeddings, final norm and head are
    local (and frozen: fine-tuning trains soft prompts and adapters, see finetune.py), on
    `device` in `dtype` (default: checkpoint.serving_device() and serving_dtype())."""

    def __init__(self, model: ModelSpec, sequence: RemoteSequence, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.device = torch.device(device) if device is not None else serving_device()
        self.dtype = dtype or serving_dtype(self.device)
        local = load_client_model(model, self.device, self.dtype)
        self.arch, self.config = architecture_of(local.config), local.config
        self.local, self.sequence = local.requires_grad_(False), sequence

    def embed(self, input_ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        input_ids = input_ids.to(self.device)
        positions = torch.arange(offset, offset + input_ids.shape[1], device=self.device)[None].expand_as(input_ids)
        return self.arch.embed(self.local, input_ids, positions)

    def forward(self, input_ids: torch.Tensor, prefix: Optional[torch.Tensor] = None,
                adapter: Optional[nn.Module] = None) -> torch.Tensor:
        """Logits for `input_ids` (batch, length); `prefix` (batch, n, hidden) soft-prompt
        embeddings come first, and `adapter` acts on the blocks' output (both trainable)."""
        n = 0 if prefix is None else prefix.shape[1]
        hidden = self.embed(input_ids, offset=n)
        if prefix is not None:
            hidden = torch.cat([prefix.expand(hidden.shape[0], -1, -1), hidden], dim=1)
        hidden = _RemoteBlocks.apply(hidden, self.sequence)
        if adapter is not None:
            hidden = hidden + adapter(hidden)
        return self.arch.head(self.local, hidden[:, n:])

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
                 prefix: Optional[torch.Tensor] = None, adapter: Optional[nn.Module] = None,
                 on_token: Optional[Callable[[int, InferenceSession], None]] = None) -> torch.Tensor:
        """Greedy or sampled decoding through one inference session; returns prompt + new tokens.
        `on_token(count, session)` is called after each new token."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected (batch, length >= 1), got {tuple(input_ids.shape)}")
        generator = torch.Generator().manual_seed(seed)
        n = 0 if prefix is None else prefix.shape[1]
        tokens = input_ids
        with InferenceSession(self.sequence, n + input_ids.shape[1] + max_new_tokens) as session:
            hidden = self.embed(input_ids, offset=n)
            if prefix is not None:
                hidden = torch.cat([prefix.expand(hidden.shape[0], -1, -1), hidden], dim=1)
            for count in range(1, max_new_tokens + 1):
                out = session.step(hidden)[:, -1:]
                if adapter is not None:
                    out = out + adapter(out)
                logits = self.arch.head(self.local, out)[:, -1].float()
                if do_sample:  # the generator is the CPU's: the same draws wherever the head runs
                    logits = logits.cpu()
                token = _pick(logits, do_sample, temperature, top_k, generator).cpu()
                tokens = torch.cat([tokens, token[:, None]], dim=1)
                if on_token is not None:
                    on_token(count, session)
                hidden = self.embed(token[:, None], offset=n + tokens.shape[1] - 1)
        return tokens


def _pick(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: Optional[int],
          generator: torch.Generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


def local_generate(model: ModelSpec | nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                   do_sample: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
                   seed: int = 0) -> torch.Tensor:
    """The same decoding with the whole model (loaded from a spec, or given) in this process:
    the reference remote runs must match."""
    full = load_model(model) if isinstance(model, ModelSpec) else model
    generator = torch.Generator().manual_seed(seed)
    tokens = input_ids
    with torch.no_grad():
        from transformers import DynamicCache

        cache, ids, offset = DynamicCache(), input_ids, 0
        for _ in range(max_new_tokens):
            positions = torch.arange(offset, offset + ids.shape[1])[None].expand_as(ids)
            out = full(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                       logits_to_keep=1)
            offset += ids.shape[1]
            token = _pick(out.logits[:, -1].float(), do_sample, temperature, top_k, generator)
            tokens = torch.cat([tokens, token[:, None]], dim=1)
            ids = token[:, None]
    return tokens
