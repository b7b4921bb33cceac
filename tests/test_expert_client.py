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
