"""Sections every kind's spec shares: a pod's resources and the backbone of bootstrap peers."""

from __future__ import annotations

from pydantic import Field

from hivekeeper.spec.base import SpecModel
from hivekeeper.spec.network import PeerNetwork
from hivekeeper.spec.placement import Placement
from hivekeeper.spec.quantity import Quantity

# An extended resource name: a domain prefix and a name (nvidia.com/gpu, amd.com/gpu, gpu.intel.com/i915).
EXTENDED_RESOURCE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class Resources(SpecModel):
    cpu: Quantity = Field("1", description="CPU request, a Kubernetes quantity: 2, \"500m\"")
    memory: Quantity = Field("2Gi", description="memory request, a Kubernetes quantity: \"2Gi\", \"512Mi\"")
    gpu: int = Field(0, ge=0, description="GPUs per pod (requested and limited as gpuResource)")
    gpu_resource: str = Field("nvidia.com/gpu", pattern=EXTENDED_RESOURCE, max_length=253,
                              description="the device plugin's resource name, e.g. amd.com/gpu or a MIG profile's")


class BackboneSpec(SpecModel):
    replicas: int = Field(1, ge=1, description="DHT peers with stable identities that others bootstrap from")
    placement: Placement = Field(default_factory=Placement)
    network: PeerNetwork = Field(default_factory=PeerNetwork, description="how peers outside the cluster reach them")
