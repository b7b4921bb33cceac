"""Checkpoints the monitor writes: atomic (write, then rename), with the step, metrics and
manifest beside the weights, so a reader can tell what it holds and a crash never leaves a
half-written file under a final name."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch


_STEP_FILE = re.compile(r"^step-(\d+)\.pt$")


class CheckpointError(Exception):
    pass


def save_checkpoint(directory: Path, name: str, model: torch.nn.Module, step: int,
                    metrics: dict[str, float], manifest: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.pt"
    tmp = path.with_suffix(".pt.tmp")
    payload = {"format": "hivekeeper-checkpoint/1", "step": step, "metrics": metrics, "manifest": manifest,
               "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}}
    torch.save(payload, tmp)
    os.replace(tmp, path)
    if hasattr(model, "save_pretrained"):  # Hugging Face models: a folder a BlockServer can load
        model.save_pretrained(directory / f"{name}-hf")
    return path


def load_checkpoint(path: Path, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Read a checkpoint; a truncated, foreign or mismatched file raises CheckpointError."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != "hivekeeper-checkpoint/1":
        raise CheckpointError(f"{path}: not a hivekeeper checkpoint")
    if model is not None:
        try:
            model.load_state_dict(payload["model"])
        except RuntimeError as e:
            raise CheckpointError(f"{path}: does not fit the model: {str(e).splitlines()[0]}") from None
    return payload


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the step-N.pt checkpoints in `directory`, in order (none: the directory may not
    exist yet)."""
    found = (_STEP_FILE.match(p.name) for p in directory.glob("step-*.pt")) if directory.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


def prune_checkpoints(directory: Path, keep: int) -> None:
    for step in checkpoint_steps(directory)[:-keep]:
        (directory / f"step-{step}.pt").unlink(missing_ok=True)
