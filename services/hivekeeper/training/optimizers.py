"""The local optimizer and learning-rate schedule a training spec asks for (`spec.optimizer`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from hivekeeper.spec.training import OptimizerSpec


def torch_optimizer_factory(spec: OptimizerSpec) -> Callable[[Iterable[Any]], torch.optim.Optimizer]:
    """The local optimizer. Gradient clipping happens inside its step, on the averaged global
    gradient, so clipping means the same as in single-process large-batch training."""
    base = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[spec.name]
    kwargs: dict[str, Any] = dict(lr=spec.learning_rate, weight_decay=spec.weight_decay)
    kwargs.update(momentum=spec.momentum) if spec.name == "sgd" else kwargs.update(betas=spec.betas)
    if spec.clip_grad_norm is None:
        return lambda params: base(params, **kwargs)
    max_norm = spec.clip_grad_norm

    class Clipped(base):  # type: ignore[valid-type, misc]
        def step(self, closure=None):
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            return super().step(closure)

    return lambda params: Clipped(params, **kwargs)


def scheduler_factory(spec: OptimizerSpec) -> Optional[Callable[[torch.optim.Optimizer], Any]]:
    if not spec.warmup_steps:
        return None
    warmup = spec.warmup_steps
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
