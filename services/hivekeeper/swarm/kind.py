"""How a Swarm runs (DeDLOC): backbone DHT peers everyone bootstraps from, the trainers, the
CPU-only auxiliary averagers, the monitor (its successful exit ends the run) and the balancer,
whose key is made in advance like the backbone's: its peer ID tells the averaging peers and the
monitor whose signed plan to follow."""

from __future__ import annotations

from hivekeeper.kinds import KindRuntime, KindVolume, claimed_directory
from hivekeeper.runtime import arguments
from hivekeeper.runtime.arguments import RoleEntry
from hivekeeper.spec import Manifest
from hivekeeper.spec.common import Resources
from hivekeeper.spec.swarm import SwarmSpec
from hivekeeper.topology import ACCESS_SECTION_READERS, ACCESS_STATUS_KEYS, Layout, Network, Role, kind_identities

BACKBONE = "backbone"
BALANCER = "balancer-0"
PLAN_FOLLOWERS = ("trainer", "auxiliary", "monitor")  # the monitor only shows the plan
SERVICE_RESOURCES = Resources(cpu="500m", memory="1Gi")  # the monitor and the balancer


def identity_roles(manifest: Manifest) -> list[str]:
    return kind_identities(manifest, BACKBONE) + ([BALANCER] if manifest.spec.balancer.enabled else [])


def swarm_roles(manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str,
                run_dir: str) -> list[Role]:
    spec: SwarmSpec = manifest.spec
    layout = Layout.of(manifest, network, peer_ids, manifest_path, run_dir, BACKBONE)
    plan_signer = peer_ids.get(BALANCER)

    def role(component: str, index: int, resources: Resources, **kwargs) -> Role:
        follows = ("--plan-signer", plan_signer) if plan_signer and component in PLAN_FOLLOWERS else ()
        return layout.role(component, index, resources, extra_args=follows, **kwargs)

    roles = layout.backbones()
    roles += [role("trainer", i, spec.trainers.resources, placement=spec.trainers.placement,
                   exposure=spec.trainers.network)
              for i in range(spec.trainers.replicas)]
    roles += [role("auxiliary", i, spec.auxiliary.resources, placement=spec.auxiliary.placement,
                   exposure=spec.auxiliary.network)
              for i in range(spec.auxiliary.replicas)]
    if spec.monitor.enabled:
        roles.append(role("monitor", 0, SERVICE_RESOURCES, placement=spec.monitor.placement, completes_run=True))
    if spec.balancer.enabled:
        roles.append(role("balancer", 0, SERVICE_RESOURCES, placement=spec.balancer.placement, identity=True))
    return layout.with_access(roles)


def swarm_volumes(manifest: Manifest, run_dir: str) -> list[KindVolume]:
    """The monitor's checkpoints and final model on a claim, where the spec asks."""
    monitor = manifest.spec.monitor
    if not monitor.enabled:
        return []
    return claimed_directory("checkpoints", ("monitor",), monitor.directory(run_dir), monitor.volume_claim,
                             monitor.existing_claim)


def _trainer_arguments(parser) -> None:
    parser.add_argument("--batch-size", type=int, default=None, help="override trainers.batchSize")
    parser.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per batch (emulates a slow device)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--trace", default=None, help="append one JSON line per batch and per round to this file")


def _plan_arguments(parser) -> None:
    parser.add_argument("--plan-signer", default=None,
                        help="peer ID of the balancer whose signed averaging plan this peer follows")


PEER = (arguments.peer_access,)
RUNTIME = KindRuntime(
    roles=swarm_roles, identity_roles=identity_roles,
    target_steps=lambda manifest: manifest.spec.stopping.target_steps,
    # For the operator: status keys, which components read which spec sections (a new trainer
    # batch size leaves the backbone, the auxiliaries and the monitor running), a stopping peer's
    # grace (finish or abandon its averaging round), and the monitor's /status as the status.
    status_keys={BACKBONE: "backbone", "trainer": "trainers", "auxiliary": "auxiliary", "monitor": "monitor",
                 "balancer": "balancer", **ACCESS_STATUS_KEYS},
    section_readers={"backbone": (BACKBONE,), "trainers": ("trainer", "balancer"),  # the balancer caps by bandwidth
                     "auxiliary": ("auxiliary", "balancer"), "monitor": ("monitor",), "balancer": ("balancer",),
                     "stopping": ("monitor",),  # the monitor alone decides when the run is done
                     **ACCESS_SECTION_READERS},
    stop_grace_seconds=lambda manifest: int(manifest.spec.averaging.timeout_seconds
                                            + manifest.spec.averaging.matchmaking_seconds + 30),
    status_component="monitor",
    running_component="trainer",
    volunteer_role="trainer",
    volumes=swarm_volumes,
    role_modules={
        BACKBONE: RoleEntry("hivekeeper.swarm.backbone", lab_role="backbone"),
        "trainer": RoleEntry("hivekeeper.swarm.trainer", PEER + (_plan_arguments, _trainer_arguments),
                             lab_role="trainer"),
        "auxiliary": RoleEntry("hivekeeper.swarm.auxiliary", PEER + (_plan_arguments,), lab_role="auxiliary"),
        "monitor": RoleEntry("hivekeeper.swarm.monitor", PEER + (_plan_arguments,)),
        "balancer": RoleEntry("hivekeeper.swarm.balancer"),
    },
)
