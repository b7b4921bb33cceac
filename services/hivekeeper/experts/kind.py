"""How an ExpertPool runs: a backbone DHT peer (stable identity) that everyone bootstraps from,
the expert servers (server I holds `grid.server_experts(spec, I)`, so a restarted server, or a
replacement with the same index, resumes the same experts from their checkpoints), and the
trainers; trainer 0 ends the run."""

from __future__ import annotations

from hivekeeper.kinds import KindRuntime
from hivekeeper.spec import Manifest
from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivekeeper.spec.swarm import Resources
from hivekeeper.topology import P2P, Network, Role, make_role

BACKBONE = "backbone-experts"  # a name under "backbone": the network gives it a fixed, dialable port
SERVER = "expert-server"
TRAINER = "expert-trainer"


def identity_roles(manifest: Manifest) -> list[str]:
    return [f"{BACKBONE}-{i}" for i in range(manifest.spec.backbone.replicas)]


def pool_roles(manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str,
               run_dir: str) -> list[Role]:
    spec: ExpertPoolSpec = manifest.spec
    backbone = [f"{BACKBONE}-{i}" for i in range(spec.backbone.replicas)]
    maddrs = [network.backbone_maddr(i, network.port(name, P2P), peer_ids[name], BACKBONE)
              for i, name in enumerate(backbone)]

    def role(component: str, index: int, resources: Resources, **kwargs) -> Role:
        peers = [m for m, name in zip(maddrs, backbone) if name != f"{component}-{index}"]
        return make_role(component, index, network, manifest_path, run_dir, peers, resources, **kwargs)

    roles = [role(BACKBONE, i, Resources(cpu="250m", memory="512Mi"), identity=True)
             for i in range(spec.backbone.replicas)]
    roles += [role(SERVER, i, spec.servers.resources) for i in range(spec.servers.replicas)]
    roles += [role(TRAINER, i, spec.trainers.resources, completes_run=i == 0) for i in range(spec.trainers.replicas)]
    return roles


RUNTIME = KindRuntime(roles=pool_roles, identity_roles=identity_roles,
                      target_steps=lambda manifest: manifest.spec.stopping.target_steps,
                      status_keys={BACKBONE: "backbone", SERVER: "servers", TRAINER: "trainers"},
                      scale_restarts=(SERVER,))  # server I holds grid.server_experts(spec, I) of servers.replicas
