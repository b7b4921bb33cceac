"""Sections of the kinds that train (Swarm, ExpertPool): what to train, the local optimizer,
and when the run stops."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from hivekeeper.spec.base import CelRule, SpecModel


class TaskSpec(SpecModel):
    """What to train: a built-in task, or `module:factory` returning a `hivekeeper.tasks.Task`."""

    name: str = Field("digits", description="built-in task (digits, causal-lm) or 'module:factory'")
    options: dict[str, Any] = Field(default_factory=dict, description="task-specific options, checked by the task")
    seed: int = Field(0, ge=0, description="seed of the model initialization and the data split")


class OptimizerSpec(SpecModel):
    name: Literal["adam", "adamw", "sgd"] = Field("adam", description="the torch optimizer")
    learning_rate: float = Field(1e-3, gt=0, description="peak learning rate (after warmupSteps)")
    weight_decay: float = Field(0.0, ge=0, description="L2 penalty (adam, sgd) or decoupled weight decay (adamw)")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd only")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam, adamw: the moments' decay rates, each in [0, 1)")
    warmup_steps: int = Field(0, ge=0, description="linear learning-rate warm-up, in global steps")
    clip_grad_norm: Optional[float] = Field(None, gt=0, description="clip the gradients' global norm to this; default: no clipping")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class TargetMetric(SpecModel):
    name: str = Field(description="a held-out metric of the task, e.g. accuracy or perplexity")
    value: float = Field(description="the value to reach")
    mode: Literal["max", "min"] = Field("max", description="max: stop when metric >= value; min: when <= value")


class StoppingSpec(SpecModel):
    target_steps: Optional[int] = Field(
        None, ge=1, description="stop after this many steps (a Swarm's global steps, an ExpertPool's trainer batches)")
    target_metric: Optional[TargetMetric] = Field(None, description="stop when a held-out metric reaches a value")
    max_wall_seconds: Optional[float] = Field(None, gt=0, description="give up after this long (local runs)")

    cel_rules = (CelRule("has(self.targetSteps) || has(self.targetMetric)",
                         "set targetSteps and/or targetMetric, or the run never ends"),)

    @model_validator(mode="after")
    def _something_stops(self) -> "StoppingSpec":
        if self.target_steps is None and self.target_metric is None:
            raise ValueError("set targetSteps and/or targetMetric, or the run never ends")
        return self

    def metric_met(self, metrics: dict[str, float]) -> bool:
        """Whether held-out `metrics` meet targetMetric (False when there is none, or no such metric)."""
        target = self.target_metric
        if target is None or target.name not in metrics:
            return False
        value = metrics[target.name]
        return value >= target.value if target.mode == "max" else value <= target.value

    def reached(self, step: int, metrics: dict[str, float], elapsed_seconds: float) -> Optional[str]:
        """Why the run is done at `step` with held-out `metrics`, or None if it goes on."""
        if self.target_steps is not None and step >= self.target_steps:
            return f"reached targetSteps={self.target_steps}"
        if self.metric_met(metrics):
            target = self.target_metric
            return f"{target.name}={metrics[target.name]:.4f} reached target {target.value}"
        if self.max_wall_seconds is not None and elapsed_seconds > self.max_wall_seconds:
            return f"maxWallSeconds={self.max_wall_seconds} elapsed"
        return None
