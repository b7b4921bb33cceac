"""One hosted expert: hivemind's ModuleBackend (batched forward, backward that updates the
weights with the expert's own optimizer), plus what a server reports and checkpoints: how many
updates the expert has applied, and a consistent copy of its state taken between updates."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from hivemind.moe.server.module_backend import ModuleBackend
from hivemind.utils.tensor_descr import BatchTensorDescriptor

from hivekeeper.experts.layers import build_expert, example_shape
from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivekeeper.training.optimizers import scheduler_factory, torch_optimizer_factory


class ExpertBackend(ModuleBackend):
    def __init__(self, *args: Any, updates: int = 0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.updates = updates  # backward requests applied since the expert was created (checkpointed)
        self.forward_batches = 0  # batches of forward requests since this server started
        self._lock = threading.Lock()  # the runtime thread steps; the checkpoint thread copies

    def forward(self, *inputs: torch.Tensor):
        self.forward_batches += 1
        return super().forward(*inputs)

    def on_backward(self, batch_size: int) -> None:
        with self._lock:
            super().on_backward(batch_size)
            self.updates += 1

    def snapshot(self) -> tuple[dict[str, Any], int]:
        """(state, updates) as of one moment between two updates."""
        with self._lock:
            return copy.deepcopy(self.state_dict()), self.updates


def make_backend(spec: ExpertPoolSpec, uid: str) -> ExpertBackend:
    module = build_expert(spec.expert, uid, seed=spec.task.seed)
    optimizer = torch_optimizer_factory(spec.optimizer)(module.parameters())
    make_scheduler = scheduler_factory(spec.optimizer)
    return ExpertBackend(
        name=uid,
        module=module,
        optimizer=optimizer,
        scheduler=make_scheduler(optimizer) if make_scheduler else None,
        args_schema=(BatchTensorDescriptor(*example_shape(spec.expert)),),
        outputs_schema=BatchTensorDescriptor(*example_shape(spec.expert)),
        max_batch_size=spec.servers.max_batch_size,
    )
