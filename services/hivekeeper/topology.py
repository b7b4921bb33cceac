"""From a manifest to the processes that run it: a pure function, shared by the local runner
and the Kubernetes operator. Where each role listens and how it finds the backbone differs
between the two; a `Network` says how, and the rest is the same."""

from __future__ import annotations

import ipaddress
import zlib
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence

from hivekeeper.spec import Manifest
from hivekeeper.spec.common import Resources
from hivekeeper.spec.network import PeerNetwork
from hivekeeper.spec.placement import Placement
from hivekeeper.spec.volunteers import VolunteersSpec

METRICS = "metrics"
P2P = "p2p"
GRPC = "grpc"
ACCESS_STATUS_KEYS = {"relay": "relays", "auth": "auth"}  # their RoleStatus in every kind's status
# For the operator (KindRuntime.section_readers): spec.volunteers is read by the token service
# alone (allowlist, labs, token lifetime); what else it decides is in the roles' arguments. So an
# allowlist edit (a lab taken off) restarts no peer of the swarm.
ACCESS_SECTION_READERS = {"volunteers": ("auth",)}
BACKBONE_RESOURCES = ACCESS_RESOURCES = Resources(cpu="250m", memory="512Mi")  # backbones, relays, token service
VOLUNTEER_INDEX = 1000  # volunteers' roles (`hivekeeper join`) are numbered from here: apart from the replicas
# A joining lab's peers are numbered from lab_index_base(lab): apart from the host's replicas, the
# volunteers' and other labs' (LAB_GROUP_SIZE numbers each, a lab's group at most that many peers)
LAB_INDEX = 10_000
LAB_GROUP_SIZE = 1000
JOIN_INVITE = "join-invite"  # the access file of a joining lab's invite (spec.join.inviteSecret)


@dataclass(frozen=True)
class Role:
    """One process (locally) or one pod (in Kubernetes)."""

    name: str  # unique within the resource, e.g. "trainer-1"
    component: str  # backbone | trainer | auxiliary | monitor | balancer
    index: int
    args: tuple[str, ...]  # after `hivekeeper run`
    ports: dict[str, int] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    placement: Placement = field(default_factory=Placement)  # its pod's, in a cluster
    exposure: PeerNetwork = field(default_factory=PeerNetwork)  # its group's reach from outside the cluster
    restart: bool = True  # restart after a crash
    completes_run: bool = False  # its successful exit means the run is done
    backbone: bool = False  # a bootstrap peer of its kind: others dial it, so it starts first


class Network(Protocol):
    listen_host: str

    def port(self, role_name: str, port_name: str) -> int:
        """The port a role listens on; 0 lets the OS choose (only for ports nobody dials)."""

    def backbone_maddr(self, index: int, port: int, peer_id: str, component: str = "backbone") -> str:
        """The multiaddr other peers dial to reach backbone `index` (of the backbone-like
        `component`: every kind's bootstrap peers, named backbone...)."""

    def identity_path(self, role_name: str) -> str:
        """Where a role with a stable identity keeps its private key."""

    def announce_host(self, role_name: str) -> str | None:
        """The address others dial for this role, if not the listen address."""

    def public_address(self, role_name: str, index: int, exposure: PeerNetwork) -> str | None:
        """host:port where peers outside the cluster dial role `role_name` (peer `index` of a
        group exposed as `exposure` says), announced along with the announce host; None for
        none (a group not exposed, or a LoadBalancer still being provisioned)."""

    def gateway_address(self) -> str:
        """host:port where the swarm's own roles reach the token service."""

    # Where the resource sits in a swarm of several labs (spec.join): peers outside it that every
    # role bootstraps from too (the host's entry points), and the number its peers' indexes start
    # from (0 for the host; lab_index_base for a lab that joins).
    entry_points: tuple[str, ...]
    index_base: int

    def relay_public_address(self, index: int) -> str | None:
        """host:port where volunteers outside reach relay `index` (None: not known yet, as for
        a LoadBalancer still being provisioned)."""

    def access_path(self, name: str) -> str:
        """Where a role finds an access file: the swarm's signing key, the swarm info, the
        allowlist, or a role's invite (ROLE.invite)."""


def lab_index_base(lab: str) -> int:
    """The first peer index of a joining lab's groups (its trainer i is index base + i): a
    number of the lab's own, so its peers' names, data orders and roles differ from everyone's."""
    return LAB_INDEX + zlib.crc32(lab.encode()) % 90_000 * LAB_GROUP_SIZE


def make_role(component: str, index: int, network: Network, manifest_path: str, run_dir: str,
              initial_peers: list[str], resources: Resources, *, placement: Placement | None = None,
              identity: bool = False, backbone: bool = False, completes_run: bool = False,
              extra_args: tuple[str, ...] = (), extra_ports: tuple[str, ...] = (),
              exposure: PeerNetwork | None = None) -> Role:
    """One role of any kind: `hivekeeper run COMPONENT` with the arguments every role takes.
    Its name and ports are the resource's (`index`); its peer index in the swarm is
    `network.index_base` + `index`. `exposure`, its group's: a ClientOnly peer runs in client
    mode, and a public one announces its public address too."""
    name = f"{component}-{index}"
    ports = {port: network.port(name, port) for port in (METRICS, P2P, *extra_ports)}
    peer_index = network.index_base + index
    args = [component, "--manifest", manifest_path, "--index", str(peer_index), "--host", network.listen_host,
            "--p2p-port", str(ports[P2P]), "--metrics-port", str(ports[METRICS]), "--run-dir", run_dir]
    announce = network.announce_host(name)
    if announce:
        args += ["--announce-host", announce]
    exposure = exposure or PeerNetwork()
    if exposure.expose == "ClientOnly":
        args += ["--client-mode"]
    public = network.public_address(name, index, exposure) if exposure.public else None
    if public:
        args += ["--public-address", public]
    if identity:
        args += ["--identity", network.identity_path(name)]
    args += extra_args
    if initial_peers:
        args += ["--initial-peers", *initial_peers]
    return Role(name=name, component=component, index=index, args=tuple(args), ports=ports,
                resources=resources, placement=placement or Placement(), exposure=exposure,
                completes_run=completes_run, backbone=backbone)


@dataclass(frozen=True)
class Layout:
    """How one resource's roles are laid out, whatever its kind: every role bootstraps from the
    kind's backbone peers (`BACKBONE-i`, keys made in advance), and where volunteers are admitted
    every role signs its DHT requests with a token and the relays and token service run too."""

    manifest: Manifest
    network: Network
    manifest_path: str
    run_dir: str
    backbone_component: str
    backbone_maddrs: tuple[str, ...]

    @classmethod
    def of(cls, manifest: Manifest, network: Network, peer_ids: dict[str, str], manifest_path: str, run_dir: str,
           backbone_component: str) -> "Layout":
        replicas = manifest.spec.backbone.replicas
        maddrs = tuple(network.backbone_maddr(i, network.port(f"{backbone_component}-{i}", P2P),
                                              peer_ids[f"{backbone_component}-{i}"], backbone_component)
                       for i in range(replicas))
        return cls(manifest, network, manifest_path, run_dir, backbone_component, maddrs)

    def role(self, component: str, index: int, resources: Resources, placement: Placement | None = None, *,
             identity: bool = False, completes_run: bool = False, extra_args: tuple[str, ...] = (),
             exposure: PeerNetwork | None = None) -> Role:
        """`placement`: its role group's, merged over the spec-wide one; `exposure`, its group's."""
        name = f"{component}-{index}"
        peers = [m for i, m in enumerate(self.backbone_maddrs) if f"{self.backbone_component}-{i}" != name]
        peers += self.network.entry_points
        return make_role(component, index, self.network, self.manifest_path, self.run_dir, peers, resources,
                         placement=placed(self.manifest, placement), identity=identity,
                         backbone=component == self.backbone_component, completes_run=completes_run,
                         extra_args=extra_args + access_args(self.manifest, self.network, name), exposure=exposure)

    def backbones(self) -> list[Role]:
        backbone = self.manifest.spec.backbone
        return [self.role(self.backbone_component, i, BACKBONE_RESOURCES, backbone.placement, identity=True,
                          exposure=backbone.network)
                for i in range(len(self.backbone_maddrs))]

    def with_access(self, roles: list[Role]) -> list[Role]:
        """`roles` with the token service first (others fetch tokens from it as they start)
        and the relays last, where volunteers are admitted."""
        access = access_roles(self.manifest, self.network, list(self.backbone_maddrs), self.manifest_path,
                              self.run_dir)
        return access[:1] + roles + access[1:]


def placed(manifest: Manifest, group: Placement | None) -> Placement:
    """A role group's placement merged over the spec-wide one."""
    return (group or Placement()).over(manifest.spec.placement)


def kind_identities(manifest: Manifest, backbone_component: str) -> list[str]:
    """Roles whose keys are made before anything starts: the backbone peers and the relays."""
    return ([f"{backbone_component}-{i}" for i in range(manifest.spec.backbone.replicas)]
            + access_identities(manifest.spec.volunteers))


def access_identities(volunteers: VolunteersSpec) -> list[str]:
    """The relays' names: their keys are made before they start, like a backbone's (volunteers
    bootstrap from their peer IDs)."""
    return [f"relay-{i}" for i in range(volunteers.relays if volunteers.enabled else 0)]


def access_args(manifest: Manifest, network: Network, role_name: str) -> tuple[str, ...]:
    """Where volunteers are admitted, every peer signs its DHT requests with a token: from the
    resource's own token service with its own invite, or in a lab that joins another's swarm,
    from the host's with the lab's invite."""
    join = getattr(manifest.spec, "join", None)
    if join is not None:
        return ("--gateway", join.gateway, "--invite", network.access_path(JOIN_INVITE))
    if not manifest.spec.volunteers.enabled:
        return ()
    return ("--gateway", network.gateway_address(), "--invite", network.access_path(f"{role_name}.invite"))


def access_roles(manifest: Manifest, network: Network, initial_peers: list[str], manifest_path: str,
                 run_dir: str) -> list[Role]:
    """The roles that let volunteers in, for any kind: the token service, and the relays (DHT
    entry points with a public address, circuit relays for peers behind NAT)."""
    volunteers: VolunteersSpec = manifest.spec.volunteers
    if not volunteers.enabled:
        return []
    placement = placed(manifest, volunteers.placement)
    roles = [auth_role(volunteers, network, manifest_path, run_dir, placement)]
    for i in range(volunteers.relays):
        public = network.relay_public_address(i)
        extra = access_args(manifest, network, f"relay-{i}") + (("--public-address", public) if public else ())
        roles.append(make_role("relay", i, network, manifest_path, run_dir, initial_peers, ACCESS_RESOURCES,
                               placement=placement, identity=True, extra_args=extra))
    return roles


def auth_role(volunteers: VolunteersSpec, network: Network, manifest_path: str, run_dir: str,
              placement: Placement | None = None) -> Role:
    """The token service: it signs access tokens and joins no DHT (it needs no token itself)."""
    args = ("--swarm-key", network.access_path("swarm-auth.pem"), "--swarm-info", network.access_path("swarm-info.json"))
    if volunteers.allowlist_secret:
        args += ("--allowlist-file", network.access_path("allowlist"))
    role = make_role("auth", 0, network, manifest_path, run_dir, [], ACCESS_RESOURCES, placement=placement,
                     extra_args=args, extra_ports=(GRPC,))
    return replace(role, args=role.args + ("--grpc-port", str(role.ports[GRPC])))


def relay_maddrs(network: Network, relay_peer_ids: list[str], public: bool) -> list[str]:
    """Where relays are dialed: from inside (other roles) or from outside (volunteers)."""
    maddrs = []
    for i, peer_id in enumerate(relay_peer_ids):
        if public:
            address = network.relay_public_address(i)
            if address:  # a relay without a public address yet is left out
                host, port = address.rsplit(":", 1)
                maddrs.append(f"{host_protocol(host)}/tcp/{port}/p2p/{peer_id}")
        else:
            maddrs.append(network.backbone_maddr(i, network.port(f"relay-{i}", P2P), peer_id, component="relay"))
    return maddrs


def host_protocol(host: str) -> str:
    """/ip4/HOST or /dns4/HOST: public addresses may be names."""
    try:
        ipaddress.IPv4Address(host)
        return f"/ip4/{host}"
    except ValueError:
        return f"/dns4/{host}"


def public_backbone_maddrs(network: Network, roles: list[Role], peer_ids: dict[str, str]) -> list[str]:
    """Where peers outside the cluster dial the backbone peers exposed with an address known
    here (a publicHost, or a LoadBalancer's): not one that only the peer's own node knows."""
    maddrs = []
    for role in roles:
        if role.backbone and role.exposure.public and role.name in peer_ids:
            address = network.public_address(role.name, role.index, role.exposure)
            if address and "$(" not in address:
                host, port = address.rsplit(":", 1)
                maddrs.append(f"{host_protocol(host)}/tcp/{port}/p2p/{peer_ids[role.name]}")
    return maddrs


def volunteer_info(manifest: Manifest, network: Network, relay_peer_ids: list[str],
                   plan_signer: str | None = None, backbones: Sequence[str] = ()) -> dict:
    """What the token service hands a joining volunteer or lab: the resource to contribute to,
    the peers it bootstraps from (the relays, and the `backbones` exposed outside the cluster;
    the others are out of its reach) and whose averaging plan to follow."""
    relays = relay_maddrs(network, relay_peer_ids, public=True)
    document = manifest.model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"status"})
    # the name, not the cluster's bookkeeping: a resourceVersion that moves with every status
    # write would change the token service's config hash, and so restart it, at every reconcile
    document["metadata"] = {"name": manifest.metadata.name}
    info = {"kind": manifest.kind, "name": manifest.metadata.name, "manifest": document,
            "initialPeers": [*backbones, *relays], "relays": relays}
    if plan_signer:
        info["planSigner"] = plan_signer
    return info
