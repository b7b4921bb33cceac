"""The expert server's runtime: serves its experts from this process. An asyncio loop (one
thread) takes the p2p requests (`ExpertHandler`) and queues them per expert and call; one
compute thread runs, oldest request first, everything queued for that expert and call as one
batch (up to `max_batch_size` examples), so requests that arrive while it computes are batched
together (Learning@home 3.2: a server batches the requests of many trainers).

Why not hivemind's Server: it passes every request from a connection-handler process to a
task-pool process to the runtime and back, each hop a pickled tensor in shared memory; on a
small machine those hops, not the experts, are most of a request's time and CPU."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import torch
from hivemind.dht import DHT
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.utils import switch_to_uvloop

from hivekeeper.hivemind_ext.moe_handler import FORWARD, BadRequest, ExpertHandler

log = logging.getLogger("hivekeeper.experts.runtime")


@dataclass
class _Request:
    tensors: list[torch.Tensor]
    future: asyncio.Future
    queued: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return len(self.tensors[0])


class ExpertRuntime:
    def __init__(self, backends: dict[str, ModuleBackend], max_batch_size: int, device: str | None = None):
        self.backends, self.max_batch_size, self.device = backends, max_batch_size, device
        self._queues: dict[tuple[str, str], deque[_Request]] = {}
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="expert-compute")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._queued, self._stop = asyncio.Event(), asyncio.Event()

    def start(self, dht: DHT, timeout: float = 60.0) -> None:
        """Serve the experts on `dht`'s p2p daemon; returns once the handlers are registered."""
        if self.device is not None:
            for backend in self.backends.values():
                backend.module.to(self.device)
        started = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            self._loop = loop = switch_to_uvloop()
            try:
                loop.run_until_complete(self._serve(dht, started))
            except BaseException as e:  # noqa: BLE001 - reported to start() if it failed there
                failure.append(e)
                started.set()
            finally:  # the p2p client's own tasks end with the loop
                leftover = asyncio.all_tasks(loop)
                for task in leftover:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=serve, name="expert-runtime", daemon=True)
        self._thread.start()
        if not started.wait(timeout) or failure:
            raise RuntimeError(f"the expert runtime did not start: {failure[0] if failure else 'timed out'}")

    async def _serve(self, dht: DHT, started: threading.Event) -> None:
        p2p = await dht.replicate_p2p()
        handler = ExpertHandler(self.backends, self.submit)
        await handler.add_p2p_handlers(p2p)
        scheduler = asyncio.create_task(self.schedule())
        started.set()
        try:
            await self._stop.wait()
        finally:
            scheduler.cancel()
            await handler.remove_p2p_handlers(p2p)
            await p2p.shutdown()  # this replica only (its socket file); the DHT's p2pd stays

    def shutdown(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop has already stopped
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._compute.shutdown(wait=False, cancel_futures=True)

    async def submit(self, uid: str, call: str, tensors: list[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The outputs (forward) or input gradients (backward) of one request (on the loop)."""
        if len(tensors[0]) > self.max_batch_size:
            raise BadRequest(f"expert {uid}: a {call} request of {len(tensors[0])} examples is over the server's "
                             f"maxBatchSize {self.max_batch_size}")
        request = _Request(tensors, asyncio.get_running_loop().create_future())
        self._queues.setdefault((uid, call), deque()).append(request)
        self._queued.set()
        return await request.future

    async def schedule(self) -> None:
        """Forever: the queue with the oldest request runs as one batch, in the compute thread."""
        loop = asyncio.get_running_loop()
        while True:
            await self._queued.wait()
            self._queued.clear()
            while True:
                waiting = [(queue[0].queued, key) for key, queue in self._queues.items() if queue]
                if not waiting:
                    break
                key = min(waiting)[1]
                batch = self._take(self._queues[key])
                if not batch:
                    continue
                try:
                    outputs = await loop.run_in_executor(self._compute, self._process, key, batch)
                except Exception as e:  # noqa: BLE001 - the batch's requests fail, the server goes on
                    log.warning("expert batch failed", extra={"fields": {"expert": key[0], "call": key[1],
                                                                         "error": repr(e)[:300]}})
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(e)
                    continue
                for request, result in zip(batch, outputs):
                    if not request.future.done():
                        request.future.set_result(result)

    def _take(self, queue: deque[_Request]) -> list[_Request]:
        batch, size = [], 0
        while queue and (not batch or size + queue[0].size <= self.max_batch_size):
            request = queue.popleft()
            if request.future.done():  # its caller went away (a cancelled p2p call)
                continue
            batch.append(request)
            size += request.size
        return batch

    def _process(self, key: tuple[str, str], batch: list[_Request]) -> list[tuple[torch.Tensor, ...]]:
        uid, call = key
        backend = self.backends[uid]
        inputs = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*(r.tensors for r in batch))]
        if self.device is not None:
            inputs = [t.to(self.device) for t in inputs]
        outputs = backend.forward(*inputs) if call == FORWARD else backend.backward(*inputs)
        sizes = [r.size for r in batch]
        return list(zip(*(t.detach().cpu().split(sizes) for t in outputs)))
