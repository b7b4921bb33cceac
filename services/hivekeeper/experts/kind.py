"""How an ExpertPool runs: backbone DHT peers (stable identities) that everyone bootstraps from,
the expert servers (server I holds `grid.server_experts(spec, I)`, so a restarted server, or a
replacement with the same index, resumes the same experts from their checkpoints), and the
trainers; trainer 0 ends the run."""

from __future__ import annotations

from hivekeeper.kinds import KindRuntime, KindVolume, claimed_directory
from hivekeeper.runtime.arguments import RoleEntry
from hivekeeper.spec import Manifest
from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivekeeper.topology import ACCESS_SECTION_READERS, ACCESS_STATUS_KEYS, Layout, Network, Role, kind_identities

BACKBONE = "backbone-experts"
SERVER = "expert-server"
TRAINER = "expert-trainer"


def identity_roles(manifest: Manifest) -> list[str]:
    return kind_identities(manifest, BACKBONE)


def pool_roles(manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str,
               run_dir: str) -> list[Role]:
    spec: ExpertPoolSpec = manifest.spec
    layout = Layout.of(manifest, network, peer_ids, manifest_path, run_dir, BACKBONE)
    roles = layout.backbones()
    roles += [layout.role(SERVER, i, spec.servers.resources, spec.servers.placement, exposure=spec.servers.network)
              for i in range(spec.servers.replicas)]
    roles += [layout.role(TRAINER, i, spec.trainers.resources, spec.trainers.placement, completes_run=i == 0)
              for i in range(spec.trainers.replicas)]
    return layout.with_access(roles)


def pool_volumes(manifest: Manifest, run_dir: str) -> list[KindVolume]:
    """One claim every expert server shares, where the spec asks: server I's share of the grid
    depends on servers.replicas, so after a scale a server takes over experts another held and
    must find their files."""
    checkpoint = manifest.spec.checkpoint
    if not checkpoint.enabled:
        return []
    return claimed_directory("checkpoints", (SERVER,), checkpoint.directory(run_dir), checkpoint.volume_claim,
                             checkpoint.existing_claim)


RUNTIME = KindRuntime(
    roles=pool_roles, identity_roles=identity_roles,
    target_steps=lambda manifest: manifest.spec.stopping.target_steps,
    status_keys={BACKBONE: "backbone", SERVER: "servers", TRAINER: "trainers", **ACCESS_STATUS_KEYS},
    scale_restarts=(SERVER,),  # server I holds grid.server_experts(spec, I) of servers.replicas
    volunteer_role=SERVER,  # holds free cells of the grid (grid.server_experts), reached through a relay
    section_readers=ACCESS_SECTION_READERS,
    volumes=pool_volumes,
    role_modules={
        BACKBONE: RoleEntry("hivekeeper.experts.backbone", lab_role="backbone"),
        SERVER: RoleEntry("hivekeeper.experts.server", lab_role="server"),
        TRAINER: RoleEntry("hivekeeper.experts.trainer", lab_role="trainer"),
    },
)
