"""What each kind of resource runs: the roles (processes locally, pods in a cluster), which of
them need a key made before anything starts (others must know their peer IDs in advance), and
the `hivekeeper run` roles it brings, and the volumes its pods mount in a cluster. Every kind is a
package whose `kind` module exposes its `RUNTIME`; the local runner, `hivekeeper run` and the
operator look kinds up here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hivekeeper.runtime import arguments
from hivekeeper.runtime.arguments import RoleEntry
from hivekeeper.spec import Manifest
from hivekeeper.spec.storage import VolumeClaimSpec
from hivekeeper.topology import Network, Role

# (manifest, network, peer IDs of the identity roles by role name, manifest path, run dir) -> roles
RolesFunction = Callable[[Manifest, Network, dict[str, str], str, str], list[Role]]


@dataclass(frozen=True)
class KindVolume:
    """A volume some of a kind's pods mount in a cluster (`hivekeeper up` needs none: its roles
    share the run directory and read paths on the machine): a claim the operator makes once
    (NAME-VOLUME, owned by the resource), a claim of the user's, or another volume source."""

    name: str  # the pod's volume; the suffix of the claim the operator makes
    components: tuple[str, ...]  # whose pods mount it
    mount_path: str
    read_only: bool = False
    claim: Optional[VolumeClaimSpec] = None
    existing_claim: Optional[str] = None
    source: Optional[dict[str, Any]] = None


def claimed_directory(name: str, components: tuple[str, ...], directory: str, claim: Optional[VolumeClaimSpec],
                      existing_claim: Optional[str]) -> list[KindVolume]:
    """A directory kept on a claim, where the spec names one (checkpoints)."""
    if claim is None and existing_claim is None:
        return []
    return [KindVolume(name, components, directory, claim=claim, existing_claim=existing_claim)]


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
    # component -> the `hivekeeper run` role that runs it
    role_modules: dict[str, RoleEntry] = field(default_factory=dict)
    # For the operator. spec section -> the components that read it (unlisted sections are read
    # by all): a change to a section restarts only the pods of its readers.
    section_readers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # seconds a stopping pod gets to finish what it is doing (its termination grace period)
    stop_grace_seconds: Callable[[Manifest], int] = lambda manifest: 60
    # the component whose /status sums up the resource (None: the first backbone peer's)
    status_component: Optional[str] = None
    # besides a ready backbone peer, the component one ready pod of which makes the resource
    # Running (a Swarm's trainers); None: any ready pod
    running_component: Optional[str] = None
    # the component a volunteer runs (`hivekeeper join`); None: the kind takes no volunteers
    volunteer_role: Optional[str] = None
    # For the operator. (manifest, run dir) -> the volumes its pods mount besides the usual ones
    volumes: Callable[[Manifest, str], list[KindVolume]] = lambda manifest, run_dir: []


# Imported on first use: a kind's module is light, but its roles pull in torch and hivemind.
KIND_MODULES: dict[str, str] = {
    "Swarm": "hivekeeper.swarm.kind",
    "BlockServer": "hivekeeper.blocks.kind",
    "ExpertPool": "hivekeeper.experts.kind",
}


def runtime(kind: str) -> KindRuntime:
    if kind not in KIND_MODULES:
        raise KeyError(f"no runtime for kind {kind!r}")
    return importlib.import_module(KIND_MODULES[kind]).RUNTIME


# The roles that let volunteers in, which every kind that takes them runs.
ACCESS_ROLES = {
    "relay": RoleEntry("hivekeeper.volunteer.relay", (arguments.peer_access,)),
    "auth": RoleEntry("hivekeeper.volunteer.token_service", (arguments.token_service,)),
}


def all_roles() -> dict[str, RoleEntry]:
    """Every `hivekeeper run` role: every kind's and the access roles."""
    roles: dict[str, RoleEntry] = {}
    for kind in KIND_MODULES:
        roles.update(runtime(kind).role_modules)
    return {**roles, **ACCESS_ROLES}
