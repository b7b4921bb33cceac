"""Persistent expert checkpoints for an ExpertPool in a cluster (spec.checkpoint.volumeClaim or
existingClaim): one claim shared by every expert server, mounted where the servers write their
checkpoints. Servers keep one file per expert uid in that one directory, and server I's share
of the grid depends on servers.replicas, so after a scale a server takes over experts another
held and must find their files: one shared claim, not a volume per server.

The claim the operator makes (NAME-checkpoints) is owned by the pool, so it goes when the pool is
deleted. It is made once and never patched (a bound claim's spec is immutable but for its size)
nor deleted while the pool exists, so no spec edit can throw checkpoints away."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hivekeeper.experts.kind import SERVER
from hivekeeper.spec import Manifest

from hivekeeper_operator.network import RUN_DIR

VOLUME = "checkpoints"


def claim_name(pool: str) -> str:
    return f"{pool}-checkpoints"


@dataclass
class CheckpointStorage:
    component: str  # the component whose pods mount it
    volume: dict[str, Any]
    mount: dict[str, Any]
    claim: dict[str, Any] | None  # the PersistentVolumeClaim to make; None for the user's own


def checkpoint_storage(manifest: Manifest, meta: Callable[[str, str], dict[str, Any]]) -> CheckpointStorage | None:
    """What an ExpertPool's spec asks for (None: checkpoints stay in each pod's emptyDir).
    `meta(name, component)` is the child metadata (labels, owner reference) of the plan."""
    checkpoint = getattr(manifest.spec, "checkpoint", None)  # a kind whose spec keeps checkpoints on a claim
    if not hasattr(checkpoint, "volume_claim") or not checkpoint.enabled or (
            checkpoint.volume_claim is None and checkpoint.existing_claim is None):
        return None
    name = checkpoint.existing_claim or claim_name(manifest.metadata.name)
    claim = None
    if checkpoint.volume_claim is not None:
        wanted = checkpoint.volume_claim
        spec: dict[str, Any] = {"accessModes": [wanted.access_mode], "resources": {"requests": {"storage": wanted.size}}}
        if wanted.storage_class_name:
            spec["storageClassName"] = wanted.storage_class_name
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(name, SERVER), "spec": spec}
    return CheckpointStorage(component=SERVER, volume={"name": VOLUME, "persistentVolumeClaim": {"claimName": name}},
                             mount={"name": VOLUME, "mountPath": checkpoint.directory(RUN_DIR)}, claim=claim)
