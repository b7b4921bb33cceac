"""hivemind's ConnectionHandler with its requests checked before they reach an expert.

As shipped, an unknown uid fails with a bare `KeyError('uid')`, and a tensor of the wrong
shape is queued into the expert's task pool, where concatenating it with other requests kills
the pool process: the expert then hangs for everyone. Here both are refused at the door with
one line that names the uid or the tensor and what was expected."""

from __future__ import annotations

from typing import AsyncIterator, Sequence

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.moe.server.connection_handler import ConnectionHandler
from hivemind.p2p import P2PContext
from hivemind.p2p.p2p_daemon import DEFAULT_MAX_MSG_SIZE
from hivemind.proto import runtime_pb2
from hivemind.utils import nested_flatten
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.utils.streaming import split_for_streaming

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)


class BadRequest(ValueError):
    """A request this server refuses; its message goes back to the caller."""


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


class CheckedConnectionHandler(ConnectionHandler):
    module_backends: dict[str, ModuleBackend]

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        # hivemind's clients call "ConnectionHandler.rpc_*": serve under the same names
        return ConnectionHandler._get_handle_name(namespace, method_name)

    def _expert(self, uid: str) -> ModuleBackend:
        if uid not in self.module_backends:
            held = sorted(self.module_backends)
            raise BadRequest(f"unknown expert uid {uid!r}: this server holds {', '.join(held) or 'no experts'}")
        return self.module_backends[uid]

    async def rpc_info(self, request: runtime_pb2.ExpertUID, context: P2PContext) -> runtime_pb2.ExpertInfo:
        self._expert(request.uid)
        return await super().rpc_info(request, context)

    async def _forward(self, uid: str, inputs: list[torch.Tensor]) -> list[runtime_pb2.Tensor]:
        expert = self._expert(uid)
        check_tensors(uid, "forward", inputs, expert.forward_schema)
        return await self._process_inputs(inputs, expert.forward_pool, expert.outputs_schema)

    async def _backward(self, uid: str, inputs_and_grads: list[torch.Tensor]) -> list[runtime_pb2.Tensor]:
        expert = self._expert(uid)
        check_tensors(uid, "backward", inputs_and_grads, expert.backward_schema)
        return await self._process_inputs(inputs_and_grads, expert.backward_pool, expert.grad_inputs_schema)

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        inputs = [deserialize_torch_tensor(t) for t in request.tensors]
        return runtime_pb2.ExpertResponse(tensors=await self._forward(request.uid, inputs))

    async def rpc_backward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        inputs = [deserialize_torch_tensor(t) for t in request.tensors]
        return runtime_pb2.ExpertResponse(tensors=await self._backward(request.uid, inputs))

    async def rpc_forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                 context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        uid, inputs = await self._gather_inputs(requests, context)
        for tensor in await self._forward(uid, inputs):
            for part in split_for_streaming(tensor, DEFAULT_MAX_MSG_SIZE):
                yield runtime_pb2.ExpertResponse(tensors=[part])

    async def rpc_backward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                                  context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        uid, inputs = await self._gather_inputs(requests, context)
        for tensor in await self._backward(uid, inputs):
            for part in split_for_streaming(tensor, DEFAULT_MAX_MSG_SIZE):
                yield runtime_pb2.ExpertResponse(tensors=[part])
