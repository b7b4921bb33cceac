"""From a manifest to the processes that run it: a pure function, shared by the local runner
and the Kubernetes operator. Where each role listens and how it finds the backbone differs
between the two; a `Network` says how, and the rest is the same."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from typing import Protocol

from hivekeeper.spec import Manifest
from hivekeeper.spec.swarm import Resources, SwarmSpec

METRICS = "metrics"
P2P = "p2p"
GRPC = "grpc"
PLAN_FOLLOWERS = ("trainer", "auxiliary", "monitor")  # the monitor only shows the plan


@dataclass(frozen=True)
class Role:
    """One process (locally) or one pod (in Kubernetes)."""

    name: str  # unique within the resource, e.g. "trainer-1"
    component: str  # backbone | trainer | auxiliary | monitor | balancer
    index: int
    args: tuple[str, ...]  # after `hivekeeper run`
    ports: dict[str, int] = field(default_factory=dict)
    resources: Resources = field(default_factory=Resources)
    restart: bool = True  # restart after a crash
    completes_run: bool = False  # its successful exit means the run is done


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

    def gateway_address(self) -> str:
        """host:port where the swarm's own roles reach the token service."""

    def relay_public_address(self, index: int) -> str | None:
        """host:port where volunteers outside reach relay `index` (None: not known yet, as for
        a LoadBalancer still being provisioned)."""

    def access_path(self, name: str) -> str:
        """Where a role finds an access file: the swarm's signing key, the swarm info, the
        allowlist, or a role's invite (ROLE.invite)."""


def make_role(component: str, index: int, network: Network, manifest_path: str, run_dir: str,
              initial_peers: list[str], resources: Resources, *, identity: bool = False,
              completes_run: bool = False, extra_args: tuple[str, ...] = (), extra_ports: tuple[str, ...] = ()) -> Role:
    """One role of any kind: `hivekeeper run COMPONENT` with the arguments every role takes."""
    name = f"{component}-{index}"
    ports = {port: network.port(name, port) for port in (METRICS, P2P, *extra_ports)}
    args = [component, "--manifest", manifest_path, "--index", str(index), "--host", network.listen_host,
            "--p2p-port", str(ports[P2P]), "--metrics-port", str(ports[METRICS]), "--run-dir", run_dir]
    announce = network.announce_host(name)
    if announce:
        args += ["--announce-host", announce]
    if identity:
        args += ["--identity", network.identity_path(name)]
    args += extra_args
    if initial_peers:
        args += ["--initial-peers", *initial_peers]
    return Role(name=name, component=component, index=index, args=tuple(args), ports=ports,
                resources=resources, completes_run=completes_run)


def backbone_maddrs(network: Network, backbone_peer_ids: list[str]) -> list[str]:
    """The multiaddrs of the backbone peers, which every other role bootstraps from."""
    return [network.backbone_maddr(i, network.port(f"backbone-{i}", P2P), peer_id)
            for i, peer_id in enumerate(backbone_peer_ids)]


def swarm_roles(manifest: Manifest, network: Network, backbone_peer_ids: list[str], manifest_path: str,
                run_dir: str, balancer_peer_id: str | None = None) -> list[Role]:
    """Every process of a Swarm. The balancer's peer ID (its key is made before it starts, like
    the backbone's) tells the averaging peers and the monitor whose signed plan to follow."""
    spec: SwarmSpec = manifest.spec
    assert len(backbone_peer_ids) == spec.backbone.replicas, "one identity per backbone peer"
    assert (balancer_peer_id is not None) == spec.balancer.enabled, "a balancer identity iff the balancer runs"
    initial_peers = backbone_maddrs(network, backbone_peer_ids)

    def role(component: str, index: int, resources: Resources, *, identity: bool = False,
             completes_run: bool = False, extra_args: tuple[str, ...] = ()) -> Role:
        follows_plan = balancer_peer_id and component in PLAN_FOLLOWERS
        peers = [maddr for i, maddr in enumerate(initial_peers) if not (component == "backbone" and i == index)]
        if follows_plan:
            extra_args += ("--plan-signer", balancer_peer_id)
        if spec.volunteers.enabled:  # every peer signs its DHT requests with a token
            extra_args += ("--gateway", network.gateway_address(),
                           "--invite", network.access_path(f"{component}-{index}.invite"))
        return make_role(component, index, network, manifest_path, run_dir, peers, resources, identity=identity,
                         completes_run=completes_run, extra_args=extra_args)

    backbone_resources = Resources(cpu="250m", memory="512Mi")
    roles = [role("backbone", i, backbone_resources, identity=True) for i in range(spec.backbone.replicas)]
    roles += [role("trainer", i, spec.trainers.resources) for i in range(spec.trainers.replicas)]
    roles += [role("auxiliary", i, spec.auxiliary.resources) for i in range(spec.auxiliary.replicas)]
    if spec.monitor.enabled:
        roles.append(role("monitor", 0, Resources(cpu="500m", memory="1Gi"), completes_run=True))
    if spec.balancer.enabled:
        roles.append(role("balancer", 0, Resources(cpu="500m", memory="1Gi"), identity=True))
    if spec.volunteers.enabled:
        for i in range(spec.volunteers.relays):
            public = network.relay_public_address(i)
            roles.append(role("relay", i, backbone_resources, identity=True,
                              extra_args=("--public-address", public) if public else ()))
        roles.insert(0, auth_role(spec, network, manifest_path, run_dir))
    return roles


def auth_role(spec: SwarmSpec, network: Network, manifest_path: str, run_dir: str) -> Role:
    """The token service: it signs access tokens and joins no DHT (it needs no token itself)."""
    args = ("--swarm-key", network.access_path("swarm-auth.pem"), "--swarm-info", network.access_path("swarm-info.json"))
    if spec.volunteers.allowlist_secret:
        args += ("--allowlist-file", network.access_path("allowlist"))
    role = make_role("auth", 0, network, manifest_path, run_dir, [], Resources(cpu="250m", memory="512Mi"),
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


def volunteer_info(manifest: Manifest, network: Network, relay_peer_ids: list[str],
                   plan_signer: str | None = None) -> dict:
    """What the token service hands a joining volunteer: the resource to contribute to, the
    relays it bootstraps from (backbone peers are inside the cluster, out of its reach) and
    whose averaging plan to follow."""
    relays = relay_maddrs(network, relay_peer_ids, public=True)
    info = {"kind": manifest.kind, "name": manifest.metadata.name,
            "manifest": manifest.model_dump(by_alias=True, mode="json", exclude_none=True),
            "initialPeers": relays, "relays": relays}
    if plan_signer:
        info["planSigner"] = plan_signer
    return info
