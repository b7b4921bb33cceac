"""The expert server's p2p handler: hivemind's expert RPCs (served under hivemind's names, so
hivemind's own RemoteExpert still works), checked before they reach an expert, plus one RPC
that carries requests to several experts of the server at once.

Checks: as shipped, an unknown uid fails with a bare `KeyError('uid')`, and a tensor of the
wrong shape reaches the expert's batch, where concatenating it with other requests fails them
all. Here both are refused at the door with one line that names the uid or the tensor and what
was expected.

Requests to several experts in one message (`rpc_forward_many`, `rpc_backward_many`): a trainer
that has many batches in flight sends a server one message per layer step instead of one per
expert, and requests that were ready at the same moment share one message. Its layout (which
tensors belong to which expert) rides in the request's metadata; the reply says, per part, how
many tensors it holds or why that part failed, so one refused part fails only itself.

The handler does not compute: `submit(uid, call, tensors)` hands each request to the server's
runtime (`experts/runtime.py`), which batches it with the other requests queued for that expert."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.moe.server.connection_handler import ConnectionHandler
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon import DEFAULT_MAX_MSG_SIZE
from hivemind.proto import runtime_pb2
from hivemind.proto.runtime_pb2 import CompressionType
from hivemind.utils import MSGPackSerializer, nested_flatten
from hivemind.utils.streaming import split_for_streaming

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)

FORWARD, BACKWARD = "forward", "backward"
Submit = Callable[[str, str, list[torch.Tensor]], Awaitable[Sequence[torch.Tensor]]]


class BadRequest(ValueError):
    """A request this server refuses; its message goes back to the caller."""


class ExpertError(RuntimeError):
    """A part of a multi-expert request that the server failed or refused (its message)."""


def to_wire(tensor: torch.Tensor, compression: int = CompressionType.NONE) -> runtime_pb2.Tensor:
    """hivemind's serialize_torch_tensor; uncompressed float tensors built directly (hivemind
    describes every tensor first, which asks torch.cuda.is_available(), an environment lookup,
    each time: a tenth of a trainer's interpreter time with many small requests)."""
    if compression != CompressionType.NONE or tensor.dtype == torch.bfloat16:
        return serialize_torch_tensor(tensor, compression, allow_inplace=True)
    return runtime_pb2.Tensor(compression=CompressionType.NONE, buffer=tensor.detach().numpy().tobytes(),
                              size=tensor.shape, dtype=str(tensor.dtype)[len("torch."):],
                              requires_grad=tensor.requires_grad)


def check_tensors(uid: str, what: str, tensors: Sequence[torch.Tensor], schema) -> None:
    expected = list(nested_flatten(schema))
    if len(tensors) != len(expected):
        raise BadRequest(f"expert {uid}: {what} takes {len(expected)} tensors, got {len(tensors)}")
    batch = {t.shape[0] if t.ndim else None for t in tensors}
    for i, (tensor, descriptor) in enumerate(zip(tensors, expected)):
        want = tuple(descriptor.shape[1:])
        if tensor.ndim != len(want) + 1 or tuple(tensor.shape[1:]) != want:
            raise BadRequest(f"expert {uid}: {what} tensor {i} has shape {tuple(tensor.shape)}, "
                             f"expected [batch, {', '.join(map(str, want))}]")
        if descriptor.dtype is not None and tensor.dtype != descriptor.dtype:
            raise BadRequest(f"expert {uid}: {what} tensor {i} has dtype {tensor.dtype}, expected {descriptor.dtype}")
    if len(batch) != 1 or 0 in batch:
        raise BadRequest(f"expert {uid}: {what} tensors need one non-empty batch dimension, got sizes {sorted(batch)}")


class ExpertHandler(ServicerBase):
    """Serves `module_backends` on a p2p instance of this process (`await add_p2p_handlers(p2p)`);
    every checked request goes to `submit`."""

    _rpc_handlers = None  # ServicerBase caches these per class: never inherit another class's
    _stub_type = None

    def __init__(self, module_backends: dict[str, ModuleBackend], submit: Submit):
        self.module_backends, self.submit = module_backends, submit

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind's clients call "ConnectionHandler.rpc_*": serve its RPCs under the same names
        owner = ConnectionHandler.__name__ if hasattr(ConnectionHandler, method_name) else cls.__name__
        return f"{owner}.{method_name}" if namespace is None else f"{namespace}::{owner}.{method_name}"

    def _expert(self, uid: str) -> ModuleBackend:
        if uid not in self.module_backends:
            held = sorted(self.module_backends)
            raise BadRequest(f"unknown expert uid {uid!r}: this server holds {', '.join(held) or 'no experts'}")
        return self.module_backends[uid]

    async def _run(self, uid: str, call: str, inputs: list[torch.Tensor]) -> list[runtime_pb2.Tensor]:
        expert = self._expert(uid)
        schema, out_schema = ((expert.forward_schema, expert.outputs_schema) if call == FORWARD
                              else (expert.backward_schema, expert.grad_inputs_schema))
        check_tensors(uid, call, inputs, schema)
        outputs = await self.submit(uid, call, inputs)
        return [to_wire(result, proto.compression) for result, proto in zip(outputs, nested_flatten(out_schema))]

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        return runtime_pb2.ExpertInfo(serialized_info=MSGPackSerializer.dumps(self._expert(request.uid).get_info()))

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        inputs = [deserialize_torch_tensor(t) for t in request.tensors]
        return runtime_pb2.ExpertResponse(tensors=await self._run(request.uid, FORWARD, inputs))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        inputs = [deserialize_torch_tensor(t) for t in request.tensors]
        return runtime_pb2.ExpertResponse(tensors=await self._run(request.uid, BACKWARD, inputs))

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                 context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        uid, inputs = await ConnectionHandler._gather_inputs(self, requests, context)
        for tensor in await self._run(uid, FORWARD, inputs):
            for part in split_for_streaming(tensor, DEFAULT_MAX_MSG_SIZE):
                yield runtime_pb2.ExpertResponse(tensors=[part])

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        uid, inputs = await ConnectionHandler._gather_inputs(self, requests, context)
        for tensor in await self._run(uid, BACKWARD, inputs):
            for part in split_for_streaming(tensor, DEFAULT_MAX_MSG_SIZE):
                yield runtime_pb2.ExpertResponse(tensors=[part])

    async def rpc_forward_many(self, request: runtime_pb2.ExpertRequest,
                               context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._run_many(FORWARD, request)

    async def rpc_backward_many(self, request: runtime_pb2.ExpertRequest,
                                context: P2PContext) -> runtime_pb2.ExpertResponse:
        return await self._run_many(BACKWARD, request)

    async def _run_many(self, call: str, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        layout = MSGPackSerializer.loads(request.metadata)["parts"]
        if sum(count for _, count in layout) != len(request.tensors):
            raise BadRequest(f"a {call} request for {len(layout)} experts lays out "
                             f"{sum(count for _, count in layout)} tensors but holds {len(request.tensors)}")
        jobs, start = [], 0
        for uid, count in layout:
            inputs = [deserialize_torch_tensor(t) for t in request.tensors[start:start + count]]
            jobs.append(self._run(uid, call, inputs))
            start += count
        tensors, parts = [], []
        for result in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(result, BaseException):
                parts.append(str(result) or repr(result))
            else:
                tensors.extend(result)
                parts.append(len(result))
        return runtime_pb2.ExpertResponse(tensors=tensors, metadata=MSGPackSerializer.dumps({"parts": parts}))


async def call_experts(p2p: P2P, peer_id: PeerID, call: str, requests: Sequence[tuple[str, Sequence[torch.Tensor]]]
                       ) -> list[list[torch.Tensor] | ExpertError]:
    """One message to `peer_id` with a request to each (uid, tensors); per request, its outputs or
    the error the server gave it. A failure of the whole message raises."""
    layout = [(uid, len(tensors)) for uid, tensors in requests]
    serialized = [to_wire(t) for _, tensors in requests for t in tensors]
    message = runtime_pb2.ExpertRequest(tensors=serialized, metadata=MSGPackSerializer.dumps({"parts": layout}))
    stub = ExpertHandler.get_stub(p2p, peer_id)
    send = stub.rpc_forward_many if call == FORWARD else stub.rpc_backward_many
    reply: runtime_pb2.ExpertResponse = await send(message)
    results, start = [], 0
    for part in MSGPackSerializer.loads(reply.metadata)["parts"]:
        if isinstance(part, str):
            results.append(ExpertError(part))
        else:
            results.append([deserialize_torch_tensor(t) for t in reply.tensors[start:start + part]])
            start += part
    if len(results) != len(requests):
        raise ExpertError(f"the server answered {len(results)} of {len(requests)} requests")
    return results
