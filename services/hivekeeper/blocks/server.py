"""Block server role: holds a contiguous span of the model's blocks and serves forward,
backward and inference sessions over hivemind's P2P RPC; announces itself in the DHT (state,
span, throughput, cache tokens left, version); picks its span (Petals' block selection, or the
balancer's plan) and moves when that lifts the worst block enough."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from hivekeeper.blocks import protocol
from hivekeeper.blocks.backend import BlockRequestError, SpanBackend
from hivekeeper.blocks.checkpoint import load_span, num_blocks, serving_device, serving_dtype
from hivekeeper.blocks.direct import DirectServer, admission_on
from hivekeeper.blocks.direct import address as direct_address
from hivekeeper.blocks.metrics import REQUEST_KINDS
from hivekeeper.blocks.protocol import JOINING, OFFLINE, ONLINE, ErrorCode, ServerInfo
from hivekeeper.blocks.quantize import quantize_weights
from hivekeeper.blocks.role import BlockContext, load_block_context
from hivekeeper.blocks.selection import choose_start, planned_span, wants_to_move
from hivekeeper.runtime.cpu import torch_threads
from hivekeeper.spec.blockserver import BlockServerSpec, span_length

log = logging.getLogger("hivekeeper.blocks.server")
ANNOUNCE_SECONDS = 5.0
PLAN_CHECK_SECONDS = 2.0
JOIN_SETTLE_SECONDS = 1.0  # wait for peers joining at the same moment to announce, then re-choose
JOIN_ROUNDS = 4


class BlockServicer(ServicerBase):
    """The RPC surface, the same through p2pd and the direct path (direct.py): `handle` answers
    every kind of call, or refuses with a reply whose metadata holds {"error": {"code",
    "message"}} (protocol.make_error: one line, read without parsing an exception's text);
    nothing a client sends can take the server down. Compute runs one call at a time, under
    `compute_lock`: calls through p2pd on the compute thread (the event loop must not block),
    direct calls on their connection's own thread (handing each to the compute thread and
    back cost two thread wake-ups a hop)."""

    def __init__(self, backend: Callable[[], Optional[SpanBackend]], compression: str, metrics):
        self._backend = backend
        self.compression = compression
        self.metrics = metrics
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.compute_lock = threading.Lock()  # calls and loading, one at a time

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """The span held; with metadata {"digest": true}, also a hash of its weights (to show
        that fine-tuning through this server leaves them as they were)."""
        return await self._on_compute("info", request)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._on_compute("forward", request)

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._on_compute("backward", request)

    async def rpc_inference(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._on_compute("inference", request)

    async def rpc_close(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._on_compute("close", request)

    async def _on_compute(self, kind: str, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        entered = time.perf_counter()
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.exclusive, self.handle, kind,
                                                                request, entered)

    def handle_bytes(self, kind: str, data: bytes) -> bytes:
        """A call from the direct path, handled on its connection's thread."""
        return self.exclusive(self._handle_bytes, kind, data, time.perf_counter())

    def exclusive(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) under the compute lock."""
        with self.compute_lock:
            return fn(*args)

    def _handle_bytes(self, kind: str, data: bytes, entered: float) -> bytes:
        try:
            request = runtime_pb2.ExpertRequest.FromString(data)
        except Exception as e:  # noqa: BLE001 (protobuf's DecodeError, or anything a stranger sends)
            return self._refuse(kind, ErrorCode.REFUSED, f"{kind}: malformed request: {type(e).__name__}").SerializeToString()
        return self.handle(kind, request, entered).SerializeToString()

    def handle(self, kind: str, request: runtime_pb2.ExpertRequest, entered: Optional[float] = None,
               ) -> runtime_pb2.ExpertResponse:
        """One call, under the compute lock: decode, run, encode. `entered`: when it arrived
        (the reply's handler_ms counts from then: queueing included)."""
        entered = entered or time.perf_counter()
        try:
            if kind == "info":
                return self._info(request)
            if kind == "close":
                return self._close(request)
            return self._serve(kind, request, entered, _RUNS[kind])
        except Exception as e:  # noqa: BLE001 (a bug must not take the server down)
            log.exception("request failed", extra={"fields": {"kind": kind}})
            return self._refuse(kind, ErrorCode.FAILED, f"{kind}: server error: {type(e).__name__}: {e}")

    def _info(self, request) -> runtime_pb2.ExpertResponse:
        backend = self._backend()
        info: dict[str, Any] = {"start": backend.start, "end": backend.end} if backend else {}
        try:
            digest = protocol.read_metadata(request).get("digest")
        except ValueError as e:
            return protocol.make_error(ErrorCode.REFUSED, f"info: malformed request: {e}")
        if backend is not None and digest:
            info["digest"] = weights_digest(backend)
        return protocol.make_response([], info)

    def _close(self, request) -> runtime_pb2.ExpertResponse:
        try:
            session = protocol.read_metadata(request).get("session")
        except ValueError as e:
            return protocol.make_error(ErrorCode.REFUSED, f"close: malformed request: {e}")
        backend = self._backend()
        closed = bool(backend and isinstance(session, str) and backend.close_session(session))
        return protocol.make_response([], {"closed": closed})

    def _serve(self, kind: str, request, entered: float, run) -> runtime_pb2.ExpertResponse:
        began = time.perf_counter()
        backend = self._backend()
        if backend is None:
            return self._refuse(kind, ErrorCode.REFUSED, f"{kind}: this server is joining or moving: no blocks loaded yet")
        try:
            start, end = protocol.parse_span(request.uid)
            tensors = protocol.read_tensors(request)
            meta = protocol.read_metadata(request)
        except (ValueError, TypeError) as e:  # garbage in: refuse in one line
            return self._refuse(kind, ErrorCode.REFUSED, f"{kind}: malformed request: {e}")
        computing = time.perf_counter()
        backend.last_gpu_ms = None
        try:
            out = run(backend, start, end, tensors, meta)
        except BlockRequestError as e:
            return self._refuse(kind, ErrorCode.REFUSED, str(e))
        except Exception as e:
            log.exception("request failed", extra={"fields": {"kind": kind}})
            return self._refuse(kind, ErrorCode.FAILED, f"{kind}: server error: {type(e).__name__}: {e}")
        seconds = time.perf_counter() - computing
        self.metrics.request_duration.labels(kind).observe(seconds)
        self.metrics.tokens.labels(kind).inc(tensors[0].shape[0] * tensors[0].shape[1])
        self.metrics.requests.labels(kind, "ok").inc()
        timing = {"compute_ms": 1000 * seconds}  # the blocks, copies included
        if backend.last_gpu_ms is not None:
            timing["gpu_ms"] = backend.last_gpu_ms  # of which the blocks on the GPU
        timing["queue_ms"] = 1000 * (began - entered)  # arrival to the compute lock
        timing["handler_ms"] = 1000 * (time.perf_counter() - entered)  # queueing, decoding, compute
        return protocol.make_response([out], timing, self.compression)

    def _refuse(self, kind: str, code: ErrorCode, message: str) -> runtime_pb2.ExpertResponse:
        self.metrics.requests.labels(kind, code.value).inc()
        return protocol.make_error(code, message)


def _forward(b: SpanBackend, start: int, end: int, tensors: list, meta: dict) -> torch.Tensor:
    return b.forward(_one(tensors, 1), start, end)


def _backward(b: SpanBackend, start: int, end: int, tensors: list, meta: dict) -> torch.Tensor:
    hidden, grad = _one(tensors, 2)
    return b.backward(hidden, grad, start, end)


def _inference(b: SpanBackend, start: int, end: int, tensors: list, meta: dict) -> torch.Tensor:
    session = meta.get("session")
    max_length = meta.get("max_length")
    if not isinstance(session, str) or not session or (max_length is not None and not isinstance(max_length, int)):
        raise BlockRequestError("inference: metadata needs 'session' (string) and optional 'max_length' (int)")
    return b.inference_step(session, _one(tensors, 1), start, end, max_length)


_RUNS = {"forward": _forward, "backward": _backward, "inference": _inference}


def weights_digest(backend: SpanBackend) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(backend.weights.blocks.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _one(tensors: list[torch.Tensor], count: int):
    if len(tensors) != count:
        raise BlockRequestError(f"expected {count} tensor(s), got {len(tensors)}")
    return tensors[0] if count == 1 else tensors


def measure_throughput(backend: SpanBackend, compression: str, repeats: int = 5) -> dict[str, float]:
    """Per block: one-token inference steps/s, batched-forward tokens/s, and hidden states/s the
    wire codec moves (on loopback the codec, not the link, is what limits). The announced
    throughput is the smaller of compute and network, as in Petals."""
    hidden = backend.hidden_size
    start = backend.start
    step = torch.randn(1, 1, hidden)
    batch = torch.randn(1, 128, hidden)
    backend.forward(step, start, start + 1)  # warm-up
    began = time.perf_counter()
    for i in range(repeats):
        backend.inference_step("_measure", step, start, start + 1, repeats)
    inference_rps = repeats / (time.perf_counter() - began)
    backend.close_session("_measure")
    began = time.perf_counter()
    backend.forward(batch, start, start + 1)
    forward_rps = batch.shape[1] / (time.perf_counter() - began)
    began = time.perf_counter()
    for _ in range(repeats):
        protos, codec = protocol.encode_tensors([batch], compression)
        protocol.decode_tensors(protos, codec)
    network_rps = repeats * batch.shape[1] / (time.perf_counter() - began)
    return {"inference_rps": inference_rps, "forward_rps": forward_rps, "network_rps": network_rps,
            "throughput": min(forward_rps, network_rps)}


class BlockServer:
    def __init__(self, ctx: BlockContext):
        self.ctx = ctx
        self.spec: BlockServerSpec = ctx.manifest.spec
        self.num_blocks = num_blocks(self.spec.model)
        self.length = span_length(self.spec, self.num_blocks)
        self.fixed = _parse_blocks(ctx.args.blocks, self.num_blocks) if ctx.args.blocks else None
        self.backend: Optional[SpanBackend] = None
        self.state = JOINING
        self.span = (0, self.length)
        self.rates: dict[str, float] = {}
        self.plan_time = 0.0
        self.p2p = None  # this process's handle on the DHT's p2pd, which serves the RPCs
        self.direct: Optional[DirectServer] = None  # and the direct path, where admission is off
        self.direct_address = ""  # host:port announced for it
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rpc", daemon=True).start()

    def run(self) -> int:
        ctx = self.ctx
        ctx.start_endpoint()
        self.dht = ctx.make_dht()
        self.peer_id = str(self.dht.peer_id)
        try:
            servicer = BlockServicer(lambda: self.backend, self.spec.compression, ctx.metrics)
            self.servicer = servicer
            self._call(self._add_handlers(servicer))
            self.direct = self._open_direct(servicer)
            self.rates = self._compute(lambda: measure_throughput(self._load(0, 1), self.spec.compression))
            log.info("measured throughput", extra={"fields": self.rates})
            ctx.metrics.throughput.set(self.rates["throughput"])
            self.join(self.fixed or self.choose())
            self.serve()
        finally:
            self.state = OFFLINE
            self.announce()
            if self.direct is not None:
                self.direct.stop()
            if self.p2p is not None:  # close the replica's connections before its loop stops
                asyncio.run_coroutine_threadsafe(self.p2p.shutdown(), self.loop).result(timeout=5)
            self.dht.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)
        return 0

    def serve(self) -> None:
        """Until SIGTERM: refresh the announcement; follow the balancer's plan or Petals' rule."""
        ctx = self.ctx
        last_announce = last_plan = last_check = time.monotonic()
        while not ctx.stop.wait(1.0):
            now = time.monotonic()
            if now - last_announce >= ANNOUNCE_SECONDS:
                last_announce = now
                self.announce()
            if self.fixed is not None:
                continue
            target = None
            if now - last_plan >= PLAN_CHECK_SECONDS:  # a plan is cheap to read: follow it promptly
                last_plan = now
                target = self.plan_target()
            if target is None and now - last_check >= self.spec.servers.rebalance_seconds:
                last_check = now
                target = self.greedy_target()
            if target is not None:
                log.info("moving", extra={"fields": {"from": list(self.span), "to": list(target)}})
                ctx.metrics.moves.inc()
                self.join(target)
                last_announce = time.monotonic()

    # --- span choice -----------------------------------------------------------------------

    def choose(self) -> tuple[int, int]:
        """Petals' join: announce the choice at once, let simultaneous joiners do the same, re-choose
        until it holds (or the balancer's plan names this server)."""
        start = None
        for _ in range(JOIN_ROUNDS):
            servers = protocol.read_servers(self.dht, self.ctx.run_id)
            planned = planned_span(protocol.read_plan(self.dht, self.ctx.run_id), self.peer_id, self.num_blocks)
            if planned is not None:
                return planned
            choice = choose_start(servers, self.num_blocks, self.length, self.peer_id)
            if choice == start:
                break
            start = choice
            self.span = (start, start + self.length)
            self.announce()
            time.sleep(JOIN_SETTLE_SECONDS)
        return self.span

    def plan_target(self) -> Optional[tuple[int, int]]:
        """The span a balancer plan newer than the last one seen gives this server, if it differs."""
        plan = protocol.read_plan(self.dht, self.ctx.run_id)
        if plan is None or not plan.get("time", 0) > self.plan_time:
            return None
        self.plan_time = plan["time"]
        planned = planned_span(plan, self.peer_id, self.num_blocks)
        return planned if planned is not None and planned != self.span else None

    def greedy_target(self) -> Optional[tuple[int, int]]:
        """Petals' own periodic check, when no balancer plan is in force."""
        if protocol.read_plan(self.dht, self.ctx.run_id) is not None:
            return None
        servers = protocol.read_servers(self.dht, self.ctx.run_id)
        if not wants_to_move(servers, self.num_blocks, self.peer_id, self.spec.servers.balance_quality):
            return None
        others = [s for s in servers if s.peer_id != self.peer_id]
        start = choose_start(others, self.num_blocks, self.length, self.peer_id)
        return (start, start + self.length) if start != self.span[0] else None

    def join(self, span: tuple[int, int]) -> None:
        self.state, self.span = JOINING, span
        self.announce()
        backend = self._compute(lambda: self._load(*span))
        self.backend = backend  # open sessions of the old span are gone: clients replay elsewhere
        self.state = ONLINE
        m = self.ctx.metrics
        m.span_start.set(span[0])
        m.span_end.set(span[1])
        self.announce()
        self.ctx.endpoint.ready.set()
        log.info("serving", extra={"fields": {"start": span[0], "end": span[1], "peer_id": self.peer_id}})

    def _load(self, start: int, end: int) -> SpanBackend:
        servers = self.spec.servers
        device = serving_device(self.spec.servers.device)
        weights = load_span(self.spec.model, start, end, device, serving_dtype(device, self.spec.servers.dtype))
        if servers.weights == "int8":
            quantize_weights(weights.blocks)
        return SpanBackend(weights, servers.cache_tokens, servers.max_session_tokens, servers.session_timeout_seconds)

    def announce(self) -> None:
        backend = self.backend
        left = backend.cache_tokens_left if backend is not None else self.spec.servers.cache_tokens
        info = ServerInfo(
            peer_id=self.peer_id, name=self.ctx.peer_name, state=self.state, start=self.span[0], end=self.span[1],
            throughput=self.rates.get("throughput", 0.0), inference_rps=self.rates.get("inference_rps", 0.0),
            forward_rps=self.rates.get("forward_rps", 0.0), network_rps=self.rates.get("network_rps", 0.0),
            cache_tokens_left=left, direct=self.direct_address)
        protocol.announce(self.dht, self.ctx.run_id, info)
        # the peer report names the addresses it announces: a client in another lab's cluster,
        # whose p2p daemon cannot find this server, dials it there (hivemind_ext.p2pd.Redialer)
        self.ctx.publish_report(self.dht, {"state": self.state.value, "start": self.span[0], "end": self.span[1]})
        self.ctx.metrics.cache_tokens_left.set(left)
        self.ctx.metrics.sessions.set(len(backend.sessions) if backend else 0)
        self.ctx.status.update(state=self.state.value, start=self.span[0], end=self.span[1], peerId=self.peer_id,
                               cacheTokensLeft=left, sessions=len(backend.sessions) if backend else 0,
                               served=served_requests(self.ctx.metrics.registry), **self.rates)

    # --- plumbing --------------------------------------------------------------------------

    def _compute(self, fn: Callable[[], Any]) -> Any:
        """Run on the compute thread under the compute lock, so loading never races a request."""
        return self.servicer.pool.submit(self.servicer.exclusive, fn).result()

    def _call(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _open_direct(self, servicer: BlockServicer) -> Optional[DirectServer]:
        args = self.ctx.args
        server, self.direct_address = open_direct(self.peer_id, servicer.handle_bytes, args.host, args.announce_host,
                                                  self.ctx.client_mode)
        return server

    async def _add_handlers(self, servicer: BlockServicer) -> None:
        self.p2p = await self.dht.replicate_p2p()
        await servicer.add_p2p_handlers(self.p2p)


def open_direct(peer_id: str, handle: Callable[[str, bytes], bytes], host: str, announce_host: Optional[str],
                client_mode: bool) -> tuple[Optional[DirectServer], str]:
    """The direct path's server on `host`, any free port, and the address to announce for it;
    (None, "") where this process admits peers by token (direct.py: the direct path has no
    admission), or the peer is not dialed (client mode), or it has no address others dial."""
    dialed = announce_host or host
    if admission_on() or client_mode or not dialed or dialed in ("0.0.0.0", "::"):
        return None, ""
    try:
        server = DirectServer(peer_id, handle, host)
    except Exception as e:  # noqa: BLE001 (p2pd still serves every call)
        log.warning("direct path not available", extra={"fields": {"why": f"{type(e).__name__}: {e}"}})
        return None, ""
    announced = direct_address(dialed, server.port)
    log.info("direct path", extra={"fields": {"address": announced}})
    return server, announced


def served_requests(registry) -> int:
    """Requests this server answered with a result, all kinds together."""
    return int(sum(registry.get_sample_value("hivekeeper_block_requests_total", {"kind": kind, "outcome": "ok"}) or 0
                   for kind in REQUEST_KINDS))


def _parse_blocks(text: str, total: int) -> tuple[int, int]:
    try:
        start, end = protocol.parse_span(text)
    except ValueError as e:
        raise SystemExit(f"--blocks: {e}") from None
    if not 0 <= start < end <= total:
        raise SystemExit(f"--blocks: {text} is outside the model's {total} blocks")
    return start, end


def run(args: argparse.Namespace) -> int:
    ctx = load_block_context("block-server", args)
    servers = ctx.manifest.spec.servers
    torch.set_num_threads(torch_threads(servers.torch_threads, servers.resources.cpu))
    return BlockServer(ctx).run()
