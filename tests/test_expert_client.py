"""The expert client times every request into hivekeeper_dmoe_expert_request_seconds by call and
outcome: a reply is `ok`, a raised error `error`, a request the layer stops waiting for
`cancelled`. The p2p side is replaced (no DHT, no server): the timing and labelling are the
client's own."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hivemind.moe.expert_uid import ExpertInfo

import hivekeeper.experts.dmoe as dmoe
import hivekeeper.hivemind_ext.p2pd as p2pd
from hivekeeper.experts.common import ExpertMetrics


class NoDHT:
    async def replicate_p2p(self) -> None:
        return None


def count(metrics: ExpertMetrics, call: str, outcome: str) -> float:
    return metrics.registry.get_sample_value("hivekeeper_dmoe_expert_request_seconds_count",
                                             {"call": call, "outcome": outcome})


def test_each_request_is_timed_by_call_and_outcome(monkeypatch):
    never, sent = asyncio.Event(), threading.Event()

    async def forward(uid, tensors, serialized, stub):
        if uid == "refusing":
            raise RuntimeError("the server refused")
        if uid == "slow":
            sent.set()
            await never.wait()
        return [tensors[0] * 2]

    async def backward(uid, tensors, serialized, stub):
        return [tensors[1]]

    monkeypatch.setattr(dmoe, "get_server_stub", lambda p2p, peer_id: None)
    monkeypatch.setattr(dmoe, "expert_forward", forward)
    monkeypatch.setattr(dmoe, "expert_backward", backward)
    metrics = ExpertMetrics()
    client = dmoe.ExpertClient(NoDHT(), request_seconds=metrics.expert_request_seconds)
    x = torch.ones(2, 3)

    (y,) = client.call(ExpertInfo("ffn.0.0", None), [x]).result(timeout=30)
    assert torch.equal(y, x * 2)
    with pytest.raises(RuntimeError, match="refused"):
        client.call(ExpertInfo("refusing", None), [x]).result(timeout=30)
    client.call(ExpertInfo("ffn.0.0", None), [x, x], backward=True).result(timeout=30)
    slow = client.call(ExpertInfo("slow", None), [x])
    assert sent.wait(30)  # a request cancelled before it starts sends nothing, and is not timed
    slow.cancel()

    deadline = time.monotonic() + 30  # the cancellation reaches the request on the client's event loop
    while count(metrics, "forward", "cancelled") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {(call, outcome): count(metrics, call, outcome) for call in ("forward", "backward")
            for outcome in ("ok", "error", "cancelled")} == {
        ("forward", "ok"): 1, ("forward", "error"): 1, ("forward", "cancelled"): 1,
        ("backward", "ok"): 1, ("backward", "error"): 0, ("backward", "cancelled"): 0}


def test_requests_to_one_server_share_a_message_and_fail_alone(monkeypatch):
    """A layer's requests to the experts of one server go as one message; each request keeps its
    own reply or error, and its own timing."""
    messages = []

    async def call_experts(p2p, peer_id, call, requests):
        messages.append((peer_id, call, [uid for uid, _ in requests]))
        return [RuntimeError(f"{uid} refused") if uid.endswith("9") else [tensors[-1] + 1]
                for uid, tensors in requests]

    async def lone(uid, tensors, serialized, stub):
        return [tensors[-1] + 1]

    monkeypatch.setattr(dmoe, "call_experts", call_experts)
    monkeypatch.setattr(dmoe, "get_server_stub", lambda p2p, peer_id: None)
    monkeypatch.setattr(dmoe, "expert_forward", lone)
    metrics = ExpertMetrics()
    client = dmoe.ExpertClient(NoDHT(), request_seconds=metrics.expert_request_seconds)
    x = torch.zeros(2, 3)
    requests = [(ExpertInfo("e.0", "server-a"), [x]), (ExpertInfo("e.9", "server-a"), [x]),
                (ExpertInfo("e.1", "server-b"), [x]), (ExpertInfo("e.2", "server-a"), [x])]
    futures = client.call_many(requests)
    assert torch.equal(futures[0].result(timeout=30)[0], x + 1)
    with pytest.raises(RuntimeError, match="e.9 refused"):
        futures[1].result(timeout=30)
    assert [torch.equal(f.result(timeout=30)[0], x + 1) for f in futures[2:]] == [True, True]
    # server-b's lone request took hivemind's own RPC (call_experts is for two or more)
    assert messages == [("server-a", "forward", ["e.0", "e.9", "e.2"])]
    assert client.messages == 2

    futures = client.call_many([(ExpertInfo("e.0", "server-a"), [x, x]), (ExpertInfo("e.2", "server-a"), [x, x])],
                               backward=True)
    assert all(torch.equal(f.result(timeout=30)[0], x + 1) for f in futures)
    assert messages[-1] == ("server-a", "backward", ["e.0", "e.2"])
    assert {(call, outcome): count(metrics, call, outcome) for call in ("forward", "backward")
            for outcome in ("ok", "error")} == {("forward", "ok"): 3, ("forward", "error"): 1,
                                                ("backward", "ok"): 2, ("backward", "error"): 0}


def test_a_message_whose_requests_are_all_cancelled_is_abandoned(monkeypatch):
    sent, abandoned = threading.Event(), threading.Event()

    async def call_experts(p2p, peer_id, call, requests):
        sent.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            abandoned.set()
            raise

    monkeypatch.setattr(dmoe, "call_experts", call_experts)
    metrics = ExpertMetrics()
    client = dmoe.ExpertClient(NoDHT(), request_seconds=metrics.expert_request_seconds)
    x = torch.zeros(1, 3)
    first, second = client.call_many([(ExpertInfo("e.0", "server-a"), [x]), (ExpertInfo("e.1", "server-a"), [x])])
    assert sent.wait(30)
    first.cancel()
    time.sleep(0.2)
    assert not abandoned.is_set(), "the other request still waits for its reply"
    second.cancel()
    assert abandoned.wait(30)
    deadline = time.monotonic() + 30
    while count(metrics, "forward", "cancelled") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert count(metrics, "forward", "cancelled") == 2


def test_the_server_handler_answers_each_part_of_a_message(monkeypatch):
    """The wire format end to end, without a network: the client's message goes to the server's
    handler, which checks each part, runs the good ones (batched per expert by the runtime) and
    names what is wrong with the others."""
    from hivemind.p2p import PeerID

    from hivekeeper.experts.backend import make_backend
    from hivekeeper.experts.runtime import ExpertRuntime
    from hivekeeper.hivemind_ext import moe_handler
    from hivekeeper.spec.expertpool import ExpertPoolSpec

    spec = ExpertPoolSpec.model_validate({"grid": {"dimensions": [2]}, "expert": {"hiddenSize": 8},
                                         "trainers": {"dmoe": {"kBest": 1}}})
    backends = {uid: make_backend(spec, uid) for uid in ("expert.0", "expert.1")}
    runtime = ExpertRuntime(backends, max_batch_size=16)
    handler = moe_handler.ExpertHandler(backends, runtime.submit)

    class Stub:
        async def rpc_forward_many(self, request):
            return await handler.rpc_forward_many(request, None)

        async def rpc_backward_many(self, request):
            return await handler.rpc_backward_many(request, None)

    monkeypatch.setattr(moe_handler.ExpertHandler, "get_stub", classmethod(lambda cls, p2p, peer: Stub()))
    x, y, grad = torch.randn(3, 8), torch.randn(2, 8), torch.randn(3, 8)

    async def exchange():
        scheduler = asyncio.create_task(runtime.schedule())
        peer = PeerID(b"server")
        try:
            forward = await moe_handler.call_experts(None, peer, "forward", [
                ("expert.0", [x]), ("expert.1", [y]), ("expert.0", [y]), ("expert.7", [x]), ("expert.1", [x[:, :4]]),
                ("expert.0", [torch.randn(17, 8)])])
            backward = await moe_handler.call_experts(None, peer, "backward", [("expert.1", [x, grad])])
            return forward, backward
        finally:
            scheduler.cancel()

    with torch.no_grad():
        before = {(uid, name): b.module(t) for uid, b in backends.items() for name, t in (("x", x), ("y", y))}
    forward, backward = asyncio.run(exchange())
    torch.testing.assert_close(forward[0][0], before["expert.0", "x"])
    torch.testing.assert_close(forward[1][0], before["expert.1", "y"])
    torch.testing.assert_close(forward[2][0], before["expert.0", "y"])
    assert backends["expert.0"].forward_batches == 1, "both requests to expert.0 ran as one batch"
    assert "unknown expert uid 'expert.7': this server holds expert.0, expert.1" in str(forward[3])
    assert "expert expert.1: forward tensor 0 has shape (3, 4), expected [batch, 8]" in str(forward[4])
    assert "a forward request of 17 examples is over the server's maxBatchSize 16" in str(forward[5])
    assert backward[0][0].shape == x.shape and backends["expert.1"].updates == 1
    with torch.no_grad():
        assert torch.equal(backends["expert.0"].module(x), before["expert.0", "x"])
        assert not torch.equal(backends["expert.1"].module(x), before["expert.1", "x"])


def test_tensors_go_on_the_wire_as_hivemind_writes_them():
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor

    from hivekeeper.hivemind_ext.moe_handler import to_wire

    for tensor in (torch.randn(3, 4), torch.randn(5, 2, 3)[1:4], torch.randn(2, 3, requires_grad=True),
                   torch.arange(6).view(2, 3)[:, :2], torch.randn(4, 4).to(torch.bfloat16)):
        assert to_wire(tensor) == serialize_torch_tensor(tensor)
        assert torch.equal(deserialize_torch_tensor(to_wire(tensor)), tensor.detach())


def test_a_server_that_fails_is_dialed_at_its_announced_addresses(monkeypatch):
    """A server the p2p daemon cannot find (in another lab's cluster) fails its message; the
    client dials it at the addresses its report announces, once in 10 s, and the next message
    goes through."""
    from hivemind.p2p import PeerID

    server = PeerID.from_base58("QmUBCJnqZ533GeWZPbDcoXJoK6FhS8bajcCT37gVf57Sj2")
    announced = ["/ip4/10.245.0.5/tcp/31337", "/ip4/203.0.113.6/tcp/31710"]
    dialed: list[tuple[object, list[str]]] = []
    reachable, dialing = threading.Event(), threading.Event()

    async def forward(uid, tensors, serialized, stub):
        if not reachable.is_set():
            raise RuntimeError("routing: not found")
        return [tensors[0]]

    async def dial(p2p, peer_id, maddrs):
        dialed.append((peer_id, [str(m) for m in maddrs]))
        dialing.set()

    monkeypatch.setattr(dmoe, "get_server_stub", lambda p2p, peer_id: None)
    monkeypatch.setattr(dmoe, "expert_forward", forward)
    monkeypatch.setattr(p2pd, "dial", dial)
    client = dmoe.ExpertClient(NoDHT(), addresses=lambda: {server.to_base58(): announced, "another": ["/ip4/1.2.3.4"]})
    x = torch.ones(2, 3)
    with pytest.raises(RuntimeError, match="routing"):
        client.call(ExpertInfo("ffn.2.0", server), [x]).result(timeout=30)
    assert dialing.wait(30)
    for _ in range(2):  # failures within 10 s of the dial: no other
        with pytest.raises(RuntimeError, match="routing"):
            client.call(ExpertInfo("ffn.2.0", server), [x]).result(timeout=30)
    reachable.set()  # the connection the dial opened
    (y,) = client.call(ExpertInfo("ffn.2.0", server), [x]).result(timeout=30)
    assert torch.equal(y, x)
    assert dialed == [(server, announced)]


def test_a_reply_behaves_as_a_future():
    reply = dmoe.Reply()
    seen = []
    reply.add_done_callback(seen.append)
    with pytest.raises(TimeoutError):
        reply.result(timeout=0.01)
    threading.Timer(0.05, reply.set_result, ([1],)).start()
    assert reply.result(timeout=30) == [1] and reply.exception() is None and seen == [reply]
    assert not reply.cancel() and not reply.cancelled()
    failed = dmoe.Reply()
    failed.set_exception(RuntimeError("refused"))
    with pytest.raises(RuntimeError, match="refused"):
        failed.result()
    with pytest.raises(dmoe.InvalidStateError):
        failed.set_result([2])
    cancelled = dmoe.Reply()
    assert cancelled.cancel() and cancelled.cancel() and cancelled.cancelled()
    with pytest.raises(dmoe.CancelledError):
        cancelled.result()
    with pytest.raises(dmoe.InvalidStateError):
        cancelled.set_result([3])
    cancelled.add_done_callback(seen.append)
    assert seen == [reply, cancelled]
