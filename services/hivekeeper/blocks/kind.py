"""How a BlockServer runs: a backbone DHT peer (stable identity) everyone bootstraps from, the
block servers (each picks its span in the DHT, or follows the balancer), the balancer, and a
scripted client whose successful exit ends a local run."""

from __future__ import annotations

from hivekeeper.kinds import KindRuntime, KindVolume
from hivekeeper.runtime.arguments import RoleEntry, peer_access
from hivekeeper.spec import Manifest
from hivekeeper.spec.blockserver import BlockServerSpec
from hivekeeper.topology import (ACCESS_SECTION_READERS, ACCESS_STATUS_KEYS, BACKBONE_RESOURCES, Layout, Network, Role,
                                 kind_identities)

BACKBONE = "backbone-blocks"
SERVER = "block-server"
BALANCER = "block-balancer"
CLIENT = "block-client"


def identity_roles(manifest: Manifest) -> list[str]:
    return kind_identities(manifest, BACKBONE)


def block_roles(manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str,
                run_dir: str) -> list[Role]:
    spec: BlockServerSpec = manifest.spec
    layout = Layout.of(manifest, network, peer_ids, manifest_path, run_dir, BACKBONE)
    roles = layout.backbones()
    roles += [layout.role(SERVER, i, spec.servers.resources, spec.servers.placement, exposure=spec.servers.network)
              for i in range(spec.servers.replicas)]
    if spec.balancer.enabled:
        roles.append(layout.role(BALANCER, 0, BACKBONE_RESOURCES, spec.balancer.placement))
    if spec.client.enabled:
        roles.append(layout.role(CLIENT, 0, spec.client.resources, spec.client.placement, completes_run=True))
    return layout.with_access(roles)


def model_volumes(manifest: Manifest, run_dir: str) -> list[KindVolume]:
    """The volume the checkpoint folder is on, read-only in every role that reads the model."""
    volume = manifest.spec.model.volume
    if volume is None:
        return []
    return [KindVolume("model", (BACKBONE, SERVER, BALANCER, CLIENT), volume.mount_path, read_only=True,
                       existing_claim=volume.existing_claim, source=volume.source)]


def _server_arguments(parser) -> None:
    parser.add_argument("--blocks", default=None, metavar="START:END",
                        help="hold exactly these blocks (no block selection, no moving)")


RUNTIME = KindRuntime(
    roles=block_roles, identity_roles=identity_roles,
    target_steps=lambda manifest: manifest.spec.client.new_tokens,
    volunteer_role=SERVER,  # a block server behind a relay: clients reach it through the circuit
    section_readers=ACCESS_SECTION_READERS,
    volumes=model_volumes,
    status_keys={BACKBONE: "backbone", SERVER: "servers", BALANCER: "balancer", CLIENT: "client",
                 **ACCESS_STATUS_KEYS},
    role_modules={
        BACKBONE: RoleEntry("hivekeeper.blocks.backbone", lab_role="backbone"),
        SERVER: RoleEntry("hivekeeper.blocks.server", (peer_access, _server_arguments), lab_role="server"),
        BALANCER: RoleEntry("hivekeeper.blocks.balancer"),
        CLIENT: RoleEntry("hivekeeper.blocks.client_role"),
    },
)
