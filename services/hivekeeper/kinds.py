"""What each kind of resource runs: the roles (processes locally, pods in a cluster) and which
of them need a key made before anything starts (others must know their peer IDs in advance).
The local runner looks kinds up here; each kind's topology lives with its package."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from hivekeeper.spec import Manifest
from hivekeeper.topology import Network, Role, swarm_roles

# (manifest, network, peer IDs of the identity roles by role name, manifest path, run dir) -> roles
RolesFunction = Callable[[Manifest, Network, dict[str, str], str, str], list[Role]]


@dataclass(frozen=True)
class KindRuntime:
    roles: RolesFunction
    identity_roles: Callable[[Manifest], list[str]]  # role names whose key is made before start
    target_steps: Callable[[Manifest], Optional[int]] = lambda manifest: None  # for the progress bar
    # component -> its key in the resource's status (a RoleStatus there), for the operator
    status_keys: dict[str, str] = field(default_factory=dict)
    # components whose roles depend on replica counts (an expert server's share of the grid):
    # the operator restarts their pods when a count changes, instead of only adding or removing
    scale_restarts: tuple[str, ...] = ()


def _swarm_identities(manifest: Manifest) -> list[str]:
    spec = manifest.spec
    return ([f"backbone-{i}" for i in range(spec.backbone.replicas)] + (["balancer-0"] if spec.balancer.enabled else [])
            + [f"relay-{i}" for i in range(spec.volunteers.relays if spec.volunteers.enabled else 0)])


def _swarm_roles(manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str,
                 run_dir: str) -> list[Role]:
    backbone = [peer_ids[f"backbone-{i}"] for i in range(manifest.spec.backbone.replicas)]
    return swarm_roles(manifest, network, backbone, manifest_path, run_dir, balancer_peer_id=peer_ids.get("balancer-0"))


_RUNTIMES: dict[str, KindRuntime] = {
    "Swarm": KindRuntime(roles=_swarm_roles, identity_roles=_swarm_identities,
                         target_steps=lambda manifest: manifest.spec.stopping.target_steps),
}
# Kinds whose runtime lives in their own package (imported on first use: they pull in torch).
_RUNTIME_MODULES: dict[str, str] = {
    "BlockServer": "hivekeeper.blocks.kind",
    "ExpertPool": "hivekeeper.experts.kind",
}


def runtime(kind: str) -> KindRuntime:
    """The runtime of `kind`; a package's `kind` module exposes it as `RUNTIME`."""
    if kind not in _RUNTIMES and kind in _RUNTIME_MODULES:
        _RUNTIMES[kind] = importlib.import_module(_RUNTIME_MODULES[kind]).RUNTIME
    if kind not in _RUNTIMES:
        raise KeyError(f"no runtime for kind {kind!r}")
    return _RUNTIMES[kind]
