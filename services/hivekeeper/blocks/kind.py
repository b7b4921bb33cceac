"""How a BlockServer runs: a backbone DHT peer (stable identity) everyone bootstraps from, the
block servers (each picks its span in the DHT, or follows the balancer), the balancer, and a
scripted client whose successful exit ends a local run."""

from __future__ import annotations

from hivekeeper.kinds import KindRuntime
from hivekeeper.spec import Manifest
from hivekeeper.spec.blockserver import BlockServerSpec
from hivekeeper.spec.swarm import Resources
from hivekeeper.topology import Network, Role, make_role

BACKBONE = "backbone-blocks"  # a name under "backbone": the network gives it a fixed, dialable port
SERVER = "block-server"
BALANCER = "block-balancer"
CLIENT = "block-client"


def identity_roles(manifest: Manifest) -> list[str]:
    return [f"{BACKBONE}-0"]


def block_roles(manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str,
                run_dir: str) -> list[Role]:
    spec: BlockServerSpec = manifest.spec
    maddr = network.backbone_maddr(0, network.port(f"{BACKBONE}-0", "p2p"), peer_ids[f"{BACKBONE}-0"], BACKBONE)

    def role(component: str, index: int, resources: Resources, **kwargs) -> Role:
        return make_role(component, index, network, manifest_path, run_dir, [maddr], resources, **kwargs)

    roles = [make_role(BACKBONE, 0, network, manifest_path, run_dir, [], Resources(cpu="250m", memory="512Mi"),
                       identity=True)]
    roles += [role(SERVER, i, spec.servers.resources) for i in range(spec.servers.replicas)]
    if spec.balancer.enabled:
        roles.append(role(BALANCER, 0, Resources(cpu="250m", memory="512Mi")))
    if spec.client.enabled:
        roles.append(role(CLIENT, 0, spec.client.resources, completes_run=True))
    return roles


RUNTIME = KindRuntime(roles=block_roles, identity_roles=identity_roles,
                      target_steps=lambda manifest: manifest.spec.client.new_tokens,
                      status_keys={BACKBONE: "backbone", SERVER: "servers", BALANCER: "balancer", CLIENT: "client"})
