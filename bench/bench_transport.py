"""Which wire for BlockServer's direct path: the round trip of a one-token inference request
(an ExpertRequest holding a 1x1x768 float32 hidden state, about 3.1 kB each way) between two
processes on loopback, the server handing each request to a one-thread compute pool as the
block server does, through:

- p2pd, unary (block calls where the direct path is out of reach), and p2pd with one
  bidirectional stream kept open (hivemind's own streaming, what Petals' inference sessions use);
- gRPC (grpcio, which hivekeeper already depends on): unary calls and one bidirectional stream,
  on one kept HTTP/2 connection;
- the direct path as built (hivekeeper.blocks.direct: length-prefixed frames on a kept TCP
  connection, a thread per connection on the server).

Each twice: the server answering at once, and the server first spending about 15 ms of
memory-bound compute (a matrix-vector product over 235 MB of float32, as an 8-block span's
one-token step): after that, the reply's code paths run with cold caches, which is what a real
hop pays. The server times each call's compute and sends that along; the client subtracts it.

Anchor: the per-hop overhead of a one-token step through p2pd on loopback, 2.7 ms of RPC (3.9 ms in all).
Prints a table and writes bench/results/transport.json.

    .venv/bin/python bench/bench_transport.py [--calls 200]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import signal
import statistics
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from bench_results import write_results

HIDDEN = 768
WEIGHTS = 60_000_000  # float32 values the compute streams through (235 MB)


class Work:
    """The server's compute thread: nothing, or ~15 ms of memory-bound compute per request."""

    def __init__(self, compute: bool):
        import torch

        torch.set_num_threads(min(2, os.cpu_count() or 1))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.weights = torch.randn(WEIGHTS // HIDDEN, HIDDEN) if compute else None
        self.x = torch.ones(HIDDEN)

    def run(self) -> bytes:
        """The compute, and how long it took (8 bytes: the reply carries them, so that the
        client subtracts each call's own compute from its round trip)."""
        began = time.perf_counter()
        if self.weights is not None:
            import torch

            torch.mv(self.weights, self.x)
        return struct.pack("!d", time.perf_counter() - began)

    def reply_bytes(self, data: bytes) -> bytes:
        """A request in bytes, answered on the compute thread: the compute's duration, the request echoed."""
        return self.pool.submit(self.run).result() + data

    def reply_proto(self, request):
        return runtime_pb2.ExpertResponse(tensors=request.tensors, metadata=self.run())


def compute_of(reply) -> float:
    """Seconds of the server's compute for this reply."""
    return struct.unpack("!d", reply.metadata if isinstance(reply, runtime_pb2.ExpertResponse) else reply[:8])[0]


def request_bytes() -> bytes:
    import torch

    from hivekeeper.blocks import protocol

    return protocol.make_request(0, 8, [torch.randn(1, 1, HIDDEN)], {"session": "s" * 32, "max_length": 48}
                                 ).SerializeToString()


# --- servers (each in its own process; puts its address, then serves until killed) -----------

def p2pd_server(out: mp.Queue, compute: bool) -> None:
    from hivemind.p2p import P2P

    work = Work(compute)

    class Servicer(ServicerBase):
        async def rpc_unary(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                            ) -> runtime_pb2.ExpertResponse:
            return await asyncio.get_running_loop().run_in_executor(work.pool, work.reply_proto, request)

        async def rpc_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                             ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
            async for request in requests:
                yield await asyncio.get_running_loop().run_in_executor(work.pool, work.reply_proto, request)

    async def main() -> None:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        await Servicer().add_p2p_handlers(p2p)
        out.put(([str(a) for a in await p2p.get_visible_maddrs()], p2p.peer_id.to_base58()))
        await asyncio.Event().wait()

    asyncio.run(main())


def grpc_server(out: mp.Queue, compute: bool) -> None:
    import grpc

    work = Work(compute)

    def stream(requests, context):
        for request in requests:
            yield work.reply_bytes(request)

    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: work.reply_bytes(request)),
                "Stream": grpc.stream_stream_rpc_method_handler(stream)}
    server = grpc.server(ThreadPoolExecutor(8), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Blocks", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out.put(port)
    server.wait_for_termination()


def direct_server(out: mp.Queue, compute: bool) -> None:
    from hivekeeper.blocks.direct import DirectServer

    work = Work(compute)
    server = DirectServer("QmBench", lambda kind, data: work.reply_bytes(data), "127.0.0.1")
    out.put(server.port)
    while True:
        time.sleep(3600)


# --- clients (in this process) ---------------------------------------------------------------

def timed(call, calls: int) -> list[float]:
    """Milliseconds of each call's round trip beyond the server's compute for it."""
    for _ in range(5):
        call()
    overheads = []
    for _ in range(calls):
        began = time.perf_counter()
        reply = call()
        overheads.append(1000 * (time.perf_counter() - began - compute_of(reply)))
    return overheads


def p2pd_clients(address, calls: int) -> dict[str, list[float]]:
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker as worker
    from hivemind.p2p import P2P, PeerID

    class Servicer(ServicerBase):  # the stub's shape
        async def rpc_unary(self, request: runtime_pb2.ExpertRequest, context: P2PContext
                            ) -> runtime_pb2.ExpertResponse: ...

        async def rpc_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
                             ) -> AsyncIterator[runtime_pb2.ExpertResponse]: ...

    maddrs, peer = address
    p2p = worker.run_coroutine(P2P.create(initial_peers=[f"{maddrs[0]}/p2p/{peer}"]))
    stub = Servicer.get_stub(p2p, PeerID.from_base58(peer))
    request = runtime_pb2.ExpertRequest.FromString(request_bytes())
    results = {"p2pd, unary (before)": timed(lambda: worker.run_coroutine(stub.rpc_unary(request)), calls)}
    inputs: asyncio.Queue = worker.run_coroutine(_make_queue())

    async def requests():
        while (item := await inputs.get()) is not None:
            yield item

    async def open_stream():
        return await stub.rpc_stream(requests())

    replies = worker.run_coroutine(open_stream())

    async def one():
        await inputs.put(request)
        return await replies.__anext__()

    results["p2pd, one stream"] = timed(lambda: worker.run_coroutine(one()), calls)
    worker.run_coroutine(inputs.put(None))
    worker.run_coroutine(p2p.shutdown())
    return results


async def _make_queue() -> asyncio.Queue:
    return asyncio.Queue()


def grpc_clients(address, calls: int) -> dict[str, list[float]]:
    import grpc

    port = address
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)])
    data = request_bytes()
    unary = channel.unary_unary("/bench.Blocks/Unary")
    results = {"gRPC, unary": timed(lambda: unary(data, timeout=30), calls)}
    inputs: queue.SimpleQueue = queue.SimpleQueue()
    replies = channel.stream_stream("/bench.Blocks/Stream")(iter(inputs.get, None))

    def one():
        inputs.put(data)
        return next(replies)

    results["gRPC, one stream"] = timed(one, calls)
    inputs.put(None)
    channel.close()
    return results


def direct_clients(address, calls: int) -> dict[str, list[float]]:
    from hivekeeper.blocks.direct import DirectClient

    port = address
    client = DirectClient()
    data = request_bytes()
    target = f"127.0.0.1:{port}"
    results = {"direct path (after)": timed(lambda: client.call("QmBench", target, "inference", data, 30), calls)}
    client.close()
    return results


def _in_own_group(server, out: mp.Queue, compute: bool) -> None:
    os.setsid()  # its p2pd too is stopped with the group
    server(out, compute)


def measure(server, clients, compute: bool, calls: int) -> dict[str, list[float]]:
    ctx = mp.get_context("spawn")  # a clean process: no threads or torch state of this one
    out = ctx.Queue()
    process = ctx.Process(target=_in_own_group, args=(server, out, compute), daemon=True)
    process.start()
    try:
        return clients(out.get(timeout=120), calls)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.join(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=200, help="round trips per wire (with compute: a quarter)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict = {"requestBytes": len(request_bytes()), "wires": {}}
    for compute in (False, True):
        calls = args.calls // 4 if compute else args.calls
        for server, clients in ((p2pd_server, p2pd_clients), (grpc_server, grpc_clients),
                                (direct_server, direct_clients)):
            measured = measure(server, clients, compute, calls)
            for name, overheads in measured.items():
                entry = results["wires"].setdefault(name, {})
                entry["withComputeMs" if compute else "idleMs"] = round(statistics.median(overheads), 3)
            print(f"{'with' if compute else 'without'} compute: " + ", ".join(
                f"{n} {statistics.median(t):.3f} ms" for n, t in measured.items()), flush=True)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"One-token request round trips on loopback ({results['requestBytes']} bytes each way) "
                        f"beyond the server's compute, medians")
    for column in ("wire", "idle server ms", "after compute ms"):
        table.add_column(column, justify="left" if column == "wire" else "right")
    for name, entry in results["wires"].items():
        table.add_row(name, f"{entry['idleMs']:.3f}", f"{entry['withComputeMs']:.3f}")
    Console(width=160).print(table)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    write_results("transport", anchor="issue 21: 2.7 ms of RPC through p2pd per one-token hop on loopback", **results)


if __name__ == "__main__":
    main()
