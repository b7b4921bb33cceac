"""The volumes a kind's pods mount besides the usual ones (`KindRuntime.volumes`): a Swarm
monitor's checkpoints, an ExpertPool's expert checkpoints (one claim every server shares), a
BlockServer's weights (read-only, in every role that reads the model).

A claim the operator makes (NAME-VOLUME, e.g. NAME-checkpoints) is owned by the resource, so it
goes when the resource is deleted. It is made once and never patched (a bound claim's spec is
immutable but for its size) nor deleted while the resource exists, so no spec edit can throw its
data away. A claim of the user's, or another volume source, is only mounted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hivekeeper.kinds import KindVolume, runtime
from hivekeeper.spec import Manifest
from hivekeeper.spec.storage import VolumeClaimSpec

from hivekeeper_operator.network import RUN_DIR


def claim_name(resource: str, volume: str) -> str:
    return f"{resource}-{volume}"


@dataclass
class Storage:
    components: tuple[str, ...]  # whose pods mount it
    volume: dict[str, Any]
    mount: dict[str, Any]
    claim: dict[str, Any] | None  # the PersistentVolumeClaim to make; None for the user's own or another source


def _claim(name: str, wanted: VolumeClaimSpec, meta: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": [wanted.access_mode], "resources": {"requests": {"storage": wanted.size}}}
    if wanted.storage_class_name:
        spec["storageClassName"] = wanted.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def _storage(resource: str, need: KindVolume, meta: Callable[[str, str], dict[str, Any]]) -> Storage:
    mount: dict[str, Any] = {"name": need.name, "mountPath": need.mount_path}
    if need.read_only:
        mount["readOnly"] = True
    if need.source is not None:
        return Storage(need.components, {"name": need.name, **need.source}, mount, None)
    name = need.existing_claim or claim_name(resource, need.name)
    claim = _claim(name, need.claim, meta(name, need.components[0])) if need.claim is not None else None
    source: dict[str, Any] = {"claimName": name}
    if need.read_only:
        source["readOnly"] = True
    return Storage(need.components, {"name": need.name, "persistentVolumeClaim": source}, mount, claim)


def storage_of(manifest: Manifest, meta: Callable[[str, str], dict[str, Any]]) -> list[Storage]:
    """What the spec asks for (none: the pods keep their data in their emptyDir). `meta(name,
    component)` is the child metadata (labels, owner reference) of the plan."""
    return [_storage(manifest.metadata.name, need, meta) for need in runtime(manifest.kind).volumes(manifest, RUN_DIR)]
