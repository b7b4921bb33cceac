"""The built-in tasks' options, importable without torch: a manifest is validated (by the CLI,
and by the operator, which never imports torch) before any task is built."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class TaskOptions(BaseModel):
    """Base of each task's options (camelCase in manifests, unknown keys rejected)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class DigitsOptions(TaskOptions):
    hidden_size: int = Field(256, ge=8, le=8192)
    num_layers: int = Field(2, ge=1, le=8)
    dropout: float = Field(0.1, ge=0, lt=1)
    test_fraction: float = Field(0.2, gt=0, lt=1)


class CausalLMOptions(TaskOptions):
    architecture: Literal["llama", "gpt2"] = "llama"
    hidden_size: int = Field(128, ge=16, le=8192)
    num_layers: int = Field(4, ge=1, le=128)
    num_heads: int = Field(4, ge=1, le=128)
    sequence_length: int = Field(128, ge=8, le=8192)
    max_files: int = Field(300, ge=2, description="stdlib files to read (sorted by path)")
    held_out_fraction: float = Field(0.05, gt=0, lt=1)
    eval_sequences: int = Field(64, ge=1)


BUILTIN_OPTIONS: dict[str, type[TaskOptions]] = {"digits": DigitsOptions, "causal-lm": CausalLMOptions}
