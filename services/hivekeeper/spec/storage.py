"""Volumes a kind keeps data on in a cluster: a PersistentVolumeClaim the operator makes once
(NAME-checkpoints, owned by the resource), a claim of the user's, or, for data the pods only
read (a BlockServer's weights), any volume source. `hivekeeper up` ignores them: its roles share
the run directory, and read paths on the machine itself."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from hivekeeper.spec.base import CelRule, SpecModel
from hivekeeper.spec.placement import DNS_SUBDOMAIN
from hivekeeper.spec.quantity import Quantity

class VolumeClaimSpec(SpecModel):
    """A PersistentVolumeClaim the operator makes (NAME-checkpoints), owned by the resource: it goes
    when the resource is deleted. It is made once; size and class apply then (resize the claim itself)."""

    size: Quantity = Field("1Gi", description="storage requested, a Kubernetes quantity")
    storage_class_name: Optional[str] = Field(None, pattern=DNS_SUBDOMAIN, max_length=253,
                                              description="default: the cluster's default StorageClass")
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = Field(
        "ReadWriteOnce", description="the claim's access mode, as Kubernetes has it")


def claim_rules(directory_field: str) -> tuple[CelRule, ...]:
    """`check_claim` in CEL, for the section holding volumeClaim, existingClaim, enabled and the directory."""
    claimed = "(has(self.volumeClaim) || has(self.existingClaim))"
    return (
        CelRule("!has(self.volumeClaim) || !has(self.existingClaim)", "set volumeClaim or existingClaim, not both",
                ".existingClaim"),
        CelRule(f"!{claimed} || self.enabled", "a checkpoint claim needs enabled: true", ".enabled"),
        CelRule(f"!{claimed} || !has(self.{directory_field}) || self.{directory_field}.startsWith('/')",
                "must be an absolute path with a claim: the claim is mounted there", f".{directory_field}"),
    )


def check_claim(volume_claim: Optional[VolumeClaimSpec], existing_claim: Optional[str], directory: Optional[str],
                directory_field: str, enabled: bool) -> None:
    """One claim at most; only for a role that runs; mounted at an absolute directory."""
    claimed = volume_claim is not None or existing_claim is not None
    if volume_claim is not None and existing_claim is not None:
        raise ValueError("set volumeClaim or existingClaim, not both")
    if claimed and not enabled:
        raise ValueError("a checkpoint claim needs enabled: true")
    if claimed and directory is not None and not directory.startswith("/"):
        raise ValueError(f"{directory_field} ({directory!r}) must be an absolute path with a claim: "
                         "the claim is mounted there")


class ModelVolumeSpec(SpecModel):
    """Cluster only: the volume that holds the model, mounted read-only at mountPath in every pod
    that reads it (model.checkpoint is a folder inside it). Locally the checkpoint path is read
    as it is."""

    mount_path: str = Field("/models", pattern=r"^/", description="where the pods see the volume")
    existing_claim: Optional[str] = Field(
        None, pattern=DNS_SUBDOMAIN, max_length=253,
        description="a PersistentVolumeClaim holding the model (ReadOnlyMany or ReadWriteMany unless every pod "
                    "runs on one node)")
    source: Optional[dict[str, Any]] = Field(
        None, description="any other volume source, as a pod's volume takes it: nfs, hostPath, csi, image, ...")

    # What source holds CEL cannot see (its schema keeps any content): the operator checks it (InvalidSpec).
    cel_rules = (CelRule("has(self.existingClaim) != has(self.source)", "set existingClaim or source, one of them"),)

    @model_validator(mode="after")
    def _one_source(self) -> "ModelVolumeSpec":
        if (self.existing_claim is None) == (self.source is None):
            raise ValueError("set existingClaim or source, one of them")
        if self.source is not None and (len(self.source) != 1
                                        or not isinstance(next(iter(self.source.values())), dict)):
            raise ValueError("source: one volume source, e.g. nfs: {server: HOST, path: /models}")
        return self

    def holds(self, path: str) -> bool:
        return PurePosixPath(path).is_relative_to(PurePosixPath(self.mount_path))
