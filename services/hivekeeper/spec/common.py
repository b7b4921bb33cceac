"""Sections every kind's spec shares: a pod's resources and the backbone of bootstrap peers."""

from __future__ import annotations

from pydantic import Field

from hivekeeper.spec.base import SpecModel


class Resources(SpecModel):
    cpu: str = Field("1", description="CPU request, Kubernetes quantity")
    memory: str = Field("2Gi", description="memory request, Kubernetes quantity")
    gpu: int = Field(0, ge=0, description="GPUs per pod (nvidia.com/gpu)")


class BackboneSpec(SpecModel):
    replicas: int = Field(1, ge=1, description="DHT peers with stable identities that others bootstrap from")
