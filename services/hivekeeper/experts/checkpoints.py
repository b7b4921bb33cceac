"""Expert checkpoints: DIR/UID.pt per expert (weights, optimizer state, updates applied),
written atomically (write, then rename) so a server killed mid-save never leaves a torn file
under the final name. The directory is shared by all servers (a volume in a cluster), so a
replacement server, or one that takes an expert over after a rebalance, resumes it.

hivemind's own CheckpointSaver keeps every timestamped copy forever and replaces
`checkpoint_last.pt` non-atomically; hence this module."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("hivekeeper.experts.checkpoints")
FORMAT = "hivekeeper-expert/1"


def checkpoint_path(directory: Path, uid: str) -> Path:
    return directory / f"{uid}.pt"


def save_expert(directory: Path, uid: str, state: dict[str, Any], updates: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, uid)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"format": FORMAT, "uid": uid, "updates": updates, "state": state}, tmp)
    os.replace(tmp, path)
    return path


def load_expert(directory: Path, uid: str) -> tuple[dict[str, Any], int] | None:
    """(state, updates) from the expert's checkpoint, or None if there is none (or it is unreadable:
    the expert then starts fresh, which is logged)."""
    path = checkpoint_path(directory, uid)
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file must not keep the expert offline
        log.warning("unreadable expert checkpoint, starting fresh", extra={"fields": {"path": str(path), "error": repr(e)}})
        return None
    if payload.get("format") != FORMAT or payload.get("uid") != uid:
        log.warning("not a checkpoint of this expert, starting fresh", extra={"fields": {"path": str(path)}})
        return None
    return payload["state"], int(payload["updates"])
