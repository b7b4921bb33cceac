"""What a training task is: a model factory, indexable training data, a loss and held-out metrics.

Trainers sample indices themselves (so the data order is explicit and reproducible) and ask
the task to collate them; the monitor calls `evaluate` on the averaged model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping

import torch

from hivekeeper.tasks.options import TaskOptions


class Task(ABC):
    options_model: type[TaskOptions] = TaskOptions

    def __init__(self, options: Mapping[str, Any] | None = None, seed: int = 0):
        self.options = self.options_model.model_validate(dict(options or {}))
        self.seed = seed

    @property
    @abstractmethod
    def train_size(self) -> int:
        """Number of training examples; trainers sample indices in range(train_size)."""

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """A freshly initialized model; the same seed gives the same weights on every peer."""

    @abstractmethod
    def train_batch(self, indices: list[int]) -> Any:
        """Collate the training examples at `indices` into a batch."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss over the batch (hivemind weighs peers by their sample counts)."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out metrics, e.g. {'accuracy': 0.97, 'loss': 0.1}."""

    def metric_mode(self, name: str) -> str:
        """'max' if larger is better for this metric, else 'min'."""
        return "min" if name in ("loss", "perplexity") else "max"

    @staticmethod
    def to_device(batch: Any, device: torch.device) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(device)
        if isinstance(batch, (tuple, list)):
            return type(batch)(Task.to_device(b, device) for b in batch)
        return batch
