"""Spec models of the three resources and manifest loading."""

from hivekeeper.spec.manifest import Manifest, load_manifest, parse_manifest
from hivekeeper.spec.swarm import SwarmSpec

__all__ = ["Manifest", "SwarmSpec", "load_manifest", "parse_manifest"]
