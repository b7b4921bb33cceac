"""Handwritten digits (scikit-learn's copy of the UCI set: 1,797 8x8 images, shipped inside
the package, no download). An MLP classifier; held-out accuracy is the metric."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from hivekeeper.tasks.base import Task
from hivekeeper.tasks.options import DigitsOptions


class DigitsTask(Task):
    options_model = DigitsOptions

    def __init__(self, options=None, seed: int = 0):
        super().__init__(options, seed)
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        # The split depends on the seed only, so every peer and the monitor agree on it.
        train_idx, test_idx = train_test_split(
            list(range(len(y))), test_size=self.options.test_fraction, random_state=seed, stratify=y.numpy()
        )
        self.x_train, self.y_train = x[train_idx], y[train_idx]
        self.x_test, self.y_test = x[test_idx], y[test_idx]

    @property
    def train_size(self) -> int:
        return len(self.y_train)

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        layers: list[torch.nn.Module] = []
        width_in = 64
        for _ in range(self.options.num_layers):
            layers += [torch.nn.Linear(width_in, self.options.hidden_size), torch.nn.ReLU()]
            if self.options.dropout:
                layers.append(torch.nn.Dropout(self.options.dropout))
            width_in = self.options.hidden_size
        layers.append(torch.nn.Linear(width_in, 10))
        return torch.nn.Sequential(*layers)

    def train_batch(self, indices: list[int]):
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.x_train[index], self.y_train[index]

    def loss(self, model: torch.nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        logits = model(self.x_test.to(device))
        y = self.y_test.to(device)
        model.train(was_training)
        return {
            "accuracy": (logits.argmax(-1) == y).float().mean().item(),
            "loss": F.cross_entropy(logits, y).item(),
        }
