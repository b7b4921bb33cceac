"""The decentralized mixture-of-experts layer (Learning@home 3.1, 3.2).

Gating is additive over the grid: one linear layer per grid dimension, g(x, f) = sum_i g_i(x)[u_i].
hivemind's beam search over DHT prefixes picks each example's top-k announced experts; the
layer sends every chosen expert one request holding all the examples routed to it (the requests
to one server's experts travel as one message, `ExpertClient`), waits until
each example has kMin replies (then `timeout_after_k_min` more for stragglers, never beyond
`forward_timeout`), and averages the replies with softmax weights renormalized over the experts
that answered. The backward pass sends each answering expert its examples' output gradients,
which makes the server update that expert; an expert that fails then contributes no gradient.

Why not hivemind's RemoteMixtureOfExperts as is: it sends one request per example per expert
(k x batch requests a layer, each batched again on the server), its batched beam search passes
`num_workers` where `cache_expiration` belongs (negative caching then raises in the background),
its beam search asks the DHT separately for every example (`beam.py` asks once a step for the
batch), and it cannot inject the network delay the throughput benchmark needs. The DHT records
and the tensor wire format are hivemind's; a message to several experts is hivekeeper's
(`hivemind_ext/moe_handler.py`).
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Callable, Sequence

import numpy as np
import torch
from hivemind.dht import DHT
from hivemind.moe.client.expert import MAX_UNARY_PAYLOAD_SIZE, expert_backward, expert_forward, get_server_stub
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.moe.expert_uid import ExpertInfo
from hivemind.p2p import P2P, PeerID
from prometheus_client import Histogram
from torch import nn
from torch.autograd.function import once_differentiable

from hivekeeper.experts.beam import beam_search, fetch_from_dht
from hivekeeper.experts.grid import UID_DELIMITER
from hivekeeper.hivemind_ext.moe_handler import BACKWARD, FORWARD, call_experts, to_wire
from hivekeeper.hivemind_ext.p2pd import Redialer, running_loop

# hivemind's DHT process reads its request pipe non-blocking: a request that multiprocessing
# writes in two parts (over 16 KiB pickled) is read half, and the DHT process then dies
MAX_DHT_REQUEST_BYTES = 12_000


class ExpertsUnavailable(RuntimeError):
    """Some example got fewer than kMin expert replies: its batch cannot be computed."""


@dataclass
class CallStats:
    """Outcomes of expert requests, for metrics and /status (updated from several threads;
    integer increments under the GIL are good enough for counters)."""

    ok: int = 0
    failed: int = 0
    beam_search_seconds: list[float] = field(default_factory=list)  # since the reader last took them

    def record_search(self, seconds: float) -> None:
        self.beam_search_seconds = (self.beam_search_seconds + [seconds])[-1000:]


class ExpertClient:
    """Requests to expert servers over the DHT's p2p daemon, on hivemind's client event loop.

    Requests to one server are sent together: all the requests that are ready when the event
    loop next runs (a layer's requests to that server's experts, and those of other batches in
    flight at the same moment) go as one message (`call_experts`; a lone request as hivemind's
    own RPC), split only where a message would pass hivemind's unary size limit. Each request
    keeps its own future, outcome and timing: one that fails or is cancelled affects no other,
    and a message whose requests were all cancelled is abandoned.

    `delay_mean` adds an exponentially distributed delay to every message (Learning@home 4.1
    emulates network latency this way): a message, like a packet on a real network, takes one
    latency however many requests it carries.

    `search_cache_seconds` > 0: beam searches run in this process over the DHT's prefix entries
    kept that long (a trainer with many batches in flight searches several times a batch, and
    each search through the DHT process is a round trip of pickled requests); an expert whose
    server died may then be chosen that much longer (its requests fail and it is left out).

    `addresses` gives the addresses each peer announces (peer ID -> multiaddrs: the swarm's
    reports): after a message to a server fails, the client dials the server there, and its
    next messages go over that connection (`Redialer`: a server in another lab's cluster)."""

    def __init__(self, dht: DHT, delay_mean: float = 0.0, seed: int | None = None,
                 request_seconds: Histogram | None = None, search_cache_seconds: float = 0.0,
                 addresses: Callable[[], dict[str, list[str]]] | None = None):
        self.dht = dht
        self.search_cache_seconds = search_cache_seconds
        self._prefixes: dict[str, tuple[float, dict[int, ExpertInfo]]] = {}  # prefix -> (read at, entry)
        self.delay_mean = delay_mean
        self.request_seconds = request_seconds  # ExpertMetrics' histogram by call and outcome, in a role
        self._rng = random.Random(seed)
        self.p2p: P2P = RemoteExpertWorker.run_coroutine(dht.replicate_p2p())
        self._loop: asyncio.AbstractEventLoop = RemoteExpertWorker.run_coroutine(running_loop())
        self._redialer = Redialer(self.p2p, self._loop, addresses) if addresses is not None else None
        self._outbox: dict[tuple[PeerID, bool], list[_Request]] = {}  # on the loop: requests not yet sent
        self.stats = CallStats()
        self.messages = 0  # messages sent (each one delay, one RPC)
        self.dht_lock = threading.Lock()  # DHT requests share one pipe: one sender at a time

    def call(self, expert: ExpertInfo, tensors: Sequence[torch.Tensor], backward: bool = False) -> Reply:
        """A future of the expert's outputs (forward) or input gradients (backward)."""
        return self.call_many([(expert, tensors)], backward)[0]

    def call_many(self, requests: Sequence[tuple[ExpertInfo, Sequence[torch.Tensor]]],
                  backward: bool = False) -> list[Reply]:
        """`call` for several requests at once: those to the same server share a message."""
        batch = [_Request(expert, list(tensors), backward) for expert, tensors in requests]
        self._loop.call_soon_threadsafe(self._enqueue, batch)
        return [request.future for request in batch]

    def _enqueue(self, requests: list[_Request]) -> None:
        for request in requests:
            key = (request.expert.peer_id, request.backward)
            if key not in self._outbox:
                self._outbox[key] = []
                self._loop.call_soon(self._flush, key)  # after whatever else is ready now
            self._outbox[key].append(request)

    def _flush(self, key: tuple[PeerID, bool]) -> None:
        # a request cancelled before it is sent sends nothing and is not timed
        requests = [r for r in self._outbox.pop(key) if not r.future.done()]
        for message in _messages(requests):
            delay = self._rng.expovariate(1.0 / self.delay_mean) if self.delay_mean > 0 else 0.0
            task = self._loop.create_task(self._send(key[0], key[1], message, delay))
            for request in message:
                request.message, request.task = message, task
                request.future.add_done_callback(partial(self._on_done, request))
            self.messages += 1

    def _on_done(self, request: _Request, future: Reply) -> None:
        if future.cancelled():  # the layer stopped waiting for it (called in the layer's thread)
            self._loop.call_soon_threadsafe(self._cancelled, request)

    def _cancelled(self, request: _Request) -> None:
        self._observe(request, "cancelled")
        if all(r.future.done() for r in request.message) and not request.task.done():
            request.task.cancel()  # nobody waits for any of its replies any more

    async def _send(self, peer_id: PeerID, backward: bool, message: list[_Request], delay: float) -> None:
        if delay:
            await asyncio.sleep(delay)
        live = [r for r in message if not r.future.done()]
        if not live:
            return
        try:
            if len(live) == 1:
                (request,) = live
                stub = get_server_stub(self.p2p, peer_id)
                serialized = [to_wire(t) for t in request.tensors]
                send = expert_backward if backward else expert_forward
                results = [await send(request.expert.uid, request.tensors, serialized, stub)]
            else:
                results = await call_experts(self.p2p, peer_id, BACKWARD if backward else FORWARD,
                                             [(r.expert.uid, r.tensors) for r in live])
        except asyncio.CancelledError:
            raise  # every request of the message was cancelled, and timed as such
        except Exception as e:  # noqa: BLE001 - the whole message failed: each of its requests did
            results = [e] * len(live)
            if self._redialer is not None:
                self._redialer.failed(peer_id)
        for request, result in zip(live, results):
            self._settle(request, result)

    def _settle(self, request: _Request, result: list[torch.Tensor] | BaseException) -> None:
        try:
            if isinstance(result, BaseException):
                request.future.set_exception(result)
            else:
                request.future.set_result(result)
        except InvalidStateError:  # cancelled meanwhile: timed by `_cancelled`
            return
        self._observe(request, "error" if isinstance(result, BaseException) else "ok")

    def _observe(self, request: _Request, outcome: str) -> None:
        if self.request_seconds is not None:
            self.request_seconds.labels("backward" if request.backward else "forward", outcome).observe(
                time.perf_counter() - request.started)

    def find_best_experts(self, uid_prefix: str, grid_scores: list[torch.Tensor], k: int) -> list[list[ExpertInfo]]:
        """Each example's top-k announced experts by beam search over DHT prefixes (`beam.py`):
        in this process over prefixes read at most `search_cache_seconds` ago, or (0) in the DHT
        process, where the DHT node and its cache are."""
        started = time.perf_counter()
        sizes = [s.shape[1] for s in grid_scores]
        scores = torch.cat([s.float() for s in grid_scores], dim=1).numpy()
        if self.search_cache_seconds > 0:
            bounds = np.cumsum([0, *sizes])
            by_dimension = [scores[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            found = _run_at_once(beam_search(uid_prefix, by_dimension, k, self._fetch_cached))
        else:
            rows = max(1, MAX_DHT_REQUEST_BYTES // (4 * sum(sizes)))  # examples per DHT request
            with self.dht_lock:
                pending = [self.dht.run_coroutine(_BatchBeamSearch(uid_prefix, scores[i:i + rows].tobytes(), sizes, k),
                                                  return_future=True) for i in range(0, len(scores), rows)]
            found = [choices for part in pending for choices in part.result()]
        self.stats.record_search(time.perf_counter() - started)
        return found

    async def _fetch_cached(self, prefixes: list[str]) -> dict[str, dict[int, ExpertInfo]]:
        """The prefixes' entries, those not read within `search_cache_seconds` read now from the
        DHT process (one request). Blocks instead of awaiting: see `_run_at_once`."""
        now = time.monotonic()
        cached = {p: entry for p in prefixes
                  if (entry := self._prefixes.get(p)) and now - entry[0] < self.search_cache_seconds}
        missing = [p for p in prefixes if p not in cached]
        if missing:
            with self.dht_lock:
                pending = self.dht.run_coroutine(_FetchPrefixes(missing), return_future=True)
            for prefix, entry in pending.result().items():
                self._prefixes[prefix] = cached[prefix] = (now, entry)
        return {p: cached[p][1] for p in prefixes}


def _run_at_once(coroutine):
    """The result of a coroutine that never suspends (the beam search over `_fetch_cached`, which
    blocks instead): run in the caller's thread, with no event loop to hand it to."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended")


@dataclass
class _FetchPrefixes:
    """Prefix entries read in the DHT process (`fetch_from_dht`), for the search in this one."""

    prefixes: list[str]

    async def __call__(self, dht, node) -> dict[str, dict[int, ExpertInfo]]:
        return await fetch_from_dht(node, self.prefixes)


_PENDING, _FINISHED, _FAILED, _CANCELLED = "pending", "finished", "failed", "cancelled"


class Reply:
    """A request's reply: concurrent.futures.Future's interface (done, cancel, result, exception,
    callbacks), without what a Future builds and locks per instance and per callback (a Python
    Condition): a trainer with hundreds of batches in flight makes thousands a second. Set once,
    from the client's event loop; cancelled by the layer that stops waiting."""

    __slots__ = ("_lock", "_state", "_value", "_callbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state, self._value, self._callbacks = _PENDING, None, []

    def done(self) -> bool:
        return self._state is not _PENDING

    def cancelled(self) -> bool:
        return self._state is _CANCELLED

    def cancel(self) -> bool:
        return self._settle(_CANCELLED, None) or self._state is _CANCELLED

    def set_result(self, value) -> None:
        if not self._settle(_FINISHED, value):
            raise InvalidStateError(f"the reply is already {self._state}")

    def set_exception(self, error: BaseException) -> None:
        if not self._settle(_FAILED, error):
            raise InvalidStateError(f"the reply is already {self._state}")

    def add_done_callback(self, callback) -> None:
        with self._lock:
            if self._state is _PENDING:
                self._callbacks.append(callback)
                return
        callback(self)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._value if self._state is _FAILED else None

    def result(self, timeout: float | None = None):
        self._wait(timeout)
        if self._state is _FAILED:
            raise self._value
        return self._value

    def _wait(self, timeout: float | None) -> None:
        if self._state is _PENDING:
            settled = threading.Event()
            self.add_done_callback(lambda _: settled.set())
            if not settled.wait(timeout):
                raise TimeoutError("no reply yet")
        if self._state is _CANCELLED:
            raise CancelledError()

    def _settle(self, state: str, value) -> bool:
        with self._lock:
            if self._state is not _PENDING:
                return False
            self._state, self._value = state, value
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)
        return True


@dataclass(eq=False)
class _Request:
    """One request to one expert, from `call_many` until its future is settled."""

    expert: ExpertInfo
    tensors: list[torch.Tensor]
    backward: bool
    future: Reply = field(default_factory=Reply)
    started: float = field(default_factory=time.perf_counter)
    message: list["_Request"] = field(default_factory=list)  # the requests sent with it
    task: asyncio.Task | None = None  # the message's sending

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.nelement() for t in self.tensors)


def _messages(requests: list[_Request]) -> list[list[_Request]]:
    """Requests to one server cut into messages that keep under hivemind's unary payload limit
    (a request over it goes alone: hivemind's RPC streams it)."""
    messages: list[list[_Request]] = []
    size = MAX_UNARY_PAYLOAD_SIZE
    for request in requests:
        if size + request.nbytes > MAX_UNARY_PAYLOAD_SIZE:
            messages.append([])
            size = 0
        messages[-1].append(request)
        size += request.nbytes
    return messages


@dataclass
class _BatchBeamSearch:
    """The beam search of a batch, run inside the DHT process, where the DHT node and its cache are.
    (A picklable callable that DHT.run_coroutine ships to that process; scores as float32 bytes.)"""

    uid_prefix: str
    scores: bytes
    sizes: list[int]
    k: int

    async def __call__(self, dht, node) -> list[list[ExpertInfo]]:
        flat = np.frombuffer(self.scores, dtype=np.float32).reshape(-1, sum(self.sizes))
        bounds = np.cumsum([0, *self.sizes])
        by_dimension = [flat[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        return await beam_search(self.uid_prefix, by_dimension, self.k, partial(fetch_from_dht, node))


@dataclass
class Routing:
    """Which examples (and which of their k slots) each chosen expert serves."""

    experts: list[ExpertInfo]
    examples: list[torch.Tensor]  # per expert: example indices
    slots: list[torch.Tensor]  # per expert: the slot each of those examples gave it
    batch_size: int
    k: int

    @classmethod
    def from_choices(cls, choices: list[list[ExpertInfo]], k: int) -> "Routing":
        by_uid: dict[str, tuple[ExpertInfo, list[int], list[int]]] = {}
        for example, chosen in enumerate(choices):
            for slot, expert in enumerate(chosen):
                entry = by_uid.setdefault(expert.uid, (expert, [], []))
                entry[1].append(example)
                entry[2].append(slot)
        experts, examples, slots = [], [], []
        for expert, rows, cols in by_uid.values():
            experts.append(expert)
            examples.append(torch.tensor(rows, dtype=torch.long))
            slots.append(torch.tensor(cols, dtype=torch.long))
        return cls(experts, examples, slots, len(choices), k)


def _wait(futures: dict[Future | Reply, int], routing: Routing, k_min: int, timeout: float,
          timeout_after_k_min: float) -> dict[int, list[torch.Tensor]]:
    """Replies by expert index: every example gets min(kMin, its experts) replies if it can, plus
    whatever arrives within `timeout_after_k_min` after that, all within `timeout`."""
    needed = torch.zeros(routing.batch_size, dtype=torch.long)
    for rows in routing.examples:
        needed[rows] += 1
    needed = needed.clamp(max=k_min)
    have = torch.zeros_like(needed)
    replies: dict[int, list[torch.Tensor]] = {}
    finished: queue.SimpleQueue[Future | Reply] = queue.SimpleQueue()  # lighter than concurrent.futures.wait's waiters
    for future in futures:
        future.add_done_callback(finished.put)
    deadline = time.monotonic() + timeout
    for _ in range(len(futures)):
        try:
            future = finished.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if not future.cancelled() and future.exception() is None:
            index = futures[future]
            replies[index] = future.result()
            have[routing.examples[index]] += 1
            if bool((have >= needed).all()):
                deadline = min(deadline, time.monotonic() + timeout_after_k_min)
    for future in futures:
        future.cancel()  # no effect on those already done
    return replies


class _RemoteExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, client: ExpertClient, routing: Routing, k_min: int, forward_timeout: float,
                timeout_after_k_min: float, backward_timeout: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.detach().cpu()
        requests = [(expert, [x[rows]]) for expert, rows in zip(routing.experts, routing.examples)]
        futures = {future: i for i, future in enumerate(client.call_many(requests))}
        replies = _wait(futures, routing, k_min, forward_timeout, timeout_after_k_min)
        client.stats.ok += len(replies)
        client.stats.failed += len(futures) - len(replies)
        outputs = x.new_zeros(routing.batch_size, routing.k, *x.shape[1:])
        mask = torch.zeros(routing.batch_size, routing.k, dtype=torch.bool)
        for i, (output,) in replies.items():
            outputs[routing.examples[i], routing.slots[i]] = output
            mask[routing.examples[i], routing.slots[i]] = True
        ctx.client, ctx.routing, ctx.answered, ctx.timeout = client, routing, sorted(replies), backward_timeout
        ctx.save_for_backward(x)
        ctx.mark_non_differentiable(mask)
        return mask, outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, _grad_mask: torch.Tensor, grad_outputs: torch.Tensor):
        (x,) = ctx.saved_tensors
        routing: Routing = ctx.routing
        grad_outputs = grad_outputs.cpu()
        requests = [(routing.experts[i], [x[routing.examples[i]], grad_outputs[routing.examples[i], routing.slots[i]]])
                    for i in ctx.answered]
        futures = dict(zip(ctx.client.call_many(requests, backward=True), ctx.answered))
        # every answering expert gets its gradient (and updates); wait for all within the timeout
        replies = _wait(futures, routing, k_min=routing.k, timeout=ctx.timeout, timeout_after_k_min=ctx.timeout)
        ctx.client.stats.ok += len(replies)
        ctx.client.stats.failed += len(futures) - len(replies)
        grad_x = torch.zeros_like(x)
        for i, (grad,) in replies.items():
            grad_x.index_add_(0, routing.examples[i], grad.to(grad_x.dtype))
        return grad_x, None, None, None, None, None, None


class DMoE(nn.Module):
    """DMoE(x) = sum over TopK(x) of f(x) * softmax(g(x, f)), renormalized over the experts that answered.
    Input and output: [batch, hidden] (feed-forward experts) or [batch, tokens, hidden]
    (Transformer experts; the gating then sees the mean over tokens)."""

    def __init__(self, client: ExpertClient, uid_prefix: str, grid: Sequence[int], hidden_size: int, k_best: int,
                 k_min: int = 1, forward_timeout: float = 10.0, timeout_after_k_min: float = 1.0,
                 backward_timeout: float = 10.0):
        super().__init__()
        self.client, self.uid_prefix, self.grid = client, uid_prefix, tuple(grid)
        self.gates = nn.ModuleList(nn.Linear(hidden_size, m) for m in self.grid)
        self.k_best, self.k_min = k_best, k_min
        self.forward_timeout, self.timeout_after_k_min = forward_timeout, timeout_after_k_min
        self.backward_timeout = backward_timeout
        self.last_choices: list[list[ExpertInfo]] = []  # the latest forward's choices (tests, bookkeeping)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_input = x if x.ndim == 2 else x.mean(dim=tuple(range(1, x.ndim - 1)))
        grid_scores = [gate(gate_input) for gate in self.gates]
        choices = self.client.find_best_experts(self.uid_prefix, [s.detach().cpu() for s in grid_scores], self.k_best)
        if not any(choices):
            raise ExpertsUnavailable(f"no experts with prefix {self.uid_prefix!r} are announced in the DHT")
        self.last_choices = choices
        routing = Routing.from_choices(choices, self.k_best)
        mask, outputs = _RemoteExperts.apply(x, self.client, routing, self.k_min, self.forward_timeout,
                                             self.timeout_after_k_min, self.backward_timeout)
        answered = mask.sum(dim=1)
        short = (answered < torch.tensor([min(self.k_min, len(c)) for c in choices])) | (answered == 0)
        if bool(short.any()):
            raise ExpertsUnavailable(f"{int(short.sum())} of {len(choices)} examples got fewer than kMin="
                                     f"{self.k_min} expert replies")
        logits = self._expert_logits(grid_scores, routing).to(x.device)
        weights = torch.softmax(logits.masked_fill(~mask.to(x.device), float("-inf")), dim=1)
        weights = weights.view(*weights.shape, *([1] * (outputs.ndim - 2)))
        return (weights * outputs.to(x.device)).sum(dim=1)

    def _expert_logits(self, grid_scores: list[torch.Tensor], routing: Routing) -> torch.Tensor:
        """g(x, f) = sum_i g_i(x)[u_i] for each example's chosen experts; -inf pads missing slots."""
        rows, slots = torch.cat(routing.examples), torch.cat(routing.slots)
        cells = torch.tensor([_cell(expert.uid, len(self.uid_prefix) + 1) for expert in routing.experts])
        cells = cells.repeat_interleave(torch.tensor([len(r) for r in routing.examples]), dim=0)
        flat = sum(scores[rows, cells[:, i]] for i, scores in enumerate(grid_scores))
        logits = grid_scores[0].new_full((routing.batch_size, self.k_best), float("-inf"))
        return logits.index_put((rows, slots), flat)


@lru_cache(maxsize=65536)
def _cell(uid: str, start: int) -> tuple[int, ...]:
    """An expert's grid coordinates: its uid after the prefix (`start` characters)."""
    return tuple(int(c) for c in uid[start:].split(UID_DELIMITER))
