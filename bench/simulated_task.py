"""A training task whose compute is simulated: a sleep of a set length per sample, and a model
of a set size whose gradients are as large as a real one's. On two shared cores every peer's
compute then runs at once (a sleep takes no CPU), so a second lab adds compute the way a second
cluster of GPUs would, and what the wire and the coordination cost shows against it.

Use it as `task: {name: "simulated_task:make", options: {...}}` with this folder on
PYTHONPATH (bench/bench_labs.py sets it for every process of both labs). Options:
  parameters        the model's size (one square linear layer, rounded to a square)
  secondsPerSample  the simulated compute per sample
  trainSize         how many samples there are to draw from

The loss is cheap and depends on the model and the samples, so gradients are dense and change
from batch to batch; the held-out "loss" is the same function on fixed inputs."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import torch
from pydantic import Field

from hivekeeper.tasks.base import Task
from hivekeeper.tasks.options import TaskOptions


class SimulatedOptions(TaskOptions):
    parameters: int = Field(1_000_000, ge=16, le=1 << 30)
    seconds_per_sample: float = Field(0.025, ge=0, le=60)
    train_size: int = Field(1_000_000, ge=1)


class SimulatedTask(Task):
    options_model = SimulatedOptions

    def __init__(self, options: Mapping[str, Any] | None = None, seed: int = 0):
        super().__init__(options, seed)
        self.width = max(4, math.isqrt(self.options.parameters))
        generator = torch.Generator().manual_seed(seed + 1)
        self.held_out = torch.randn(8, self.width, generator=generator)

    @property
    def train_size(self) -> int:
        return self.options.train_size

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        return torch.nn.Linear(self.width, self.width, bias=False)

    def train_batch(self, indices: list[int]) -> torch.Tensor:
        return torch.as_tensor(indices, dtype=torch.long)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        time.sleep(self.options.seconds_per_sample * len(batch))  # the simulated compute
        generator = torch.Generator().manual_seed(int(batch.sum()))
        x = torch.randn(1, self.width, generator=generator)
        return model(x).square().mean()

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        device = next(model.parameters()).device
        return {"loss": model(self.held_out.to(device)).square().mean().item()}


def make(options: Mapping[str, Any], seed: int = 0) -> SimulatedTask:
    return SimulatedTask(options, seed=seed)
