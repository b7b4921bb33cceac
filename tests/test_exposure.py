"""A group's peers exposed outside their cluster (`network.expose`, hivekeeper_operator.exposure):
what the operator plans for each way (the Services, host ports and arguments), what every pod's
command line becomes once the launcher has expanded it, how a LoadBalancer's address reaches its
peer, and the public backbone a joining lab bootstraps from. Across two namespaces of a real
cluster: tests/e2e/test_2_swarm.py."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")

from conftest import EXAMPLES, deep_update  # noqa: E402
from hivekeeper.cli import build_parser  # noqa: E402
from hivekeeper.errors import UserError  # noqa: E402
from hivekeeper.spec.manifest import parse_manifest  # noqa: E402
from hivekeeper_operator import exposure, launch  # noqa: E402
from test_operator_plan import PEER, _by_name, plan_of  # noqa: E402

NODE_IP, POD_IP = "192.0.2.7", "10.244.0.9"


def swarm(changes: dict, example: str = "swarm-digits.yaml") -> dict:
    document = yaml.safe_load((EXAMPLES / example).read_text())
    document["metadata"]["namespace"] = "default"
    return deep_update(document, {"spec": changes})


def commands(plan) -> dict[str, list[str]]:
    """Each role's `hivekeeper run` arguments as its pod runs them (the launcher's expansion)."""
    roles = json.loads(next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["roles.json"])
    environ = {"POD_IP": POD_IP, "HOST_IP": NODE_IP}
    out = {}
    for name in roles:
        component, index = name.rsplit("-", 1)
        out[name] = launch.resolve(roles, component, int(index), environ)
    return out


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def container(plan, component: str, name: str = "digits") -> dict:
    return _by_name(plan)[("StatefulSet", f"{name}-{component}")]["spec"]["template"]["spec"]["containers"][0]


def test_node_ports_give_each_peer_a_service_and_its_nodes_address():
    plan = plan_of(parse_manifest(swarm({"trainers": {"network": {"expose": "NodePort", "port": 31000}}})))
    children = _by_name(plan)
    for i in range(3):
        service = children[("Service", f"digits-trainer-{i}-public")]["spec"]
        assert service["type"] == "NodePort" and service["externalTrafficPolicy"] == "Local"
        assert service["ports"] == [{"name": "p2p", "port": 31000 + i, "targetPort": "p2p", "protocol": "TCP",
                                     "nodePort": 31000 + i}]
        assert service["selector"]["statefulset.kubernetes.io/pod-name"] == f"digits-trainer-{i}"
    args = commands(plan)
    assert [option(args[f"trainer-{i}"], "--public-address") for i in range(3)] == [
        f"{NODE_IP}:31000", f"{NODE_IP}:31001", f"{NODE_IP}:31002"]
    assert option(args["trainer-0"], "--announce-host") == POD_IP  # peers in the cluster keep the pod IP
    assert all(option(args[name], "--public-address") is None for name in args if not name.startswith("trainer"))
    env = {e["name"]: e for e in container(plan, "trainer")["env"]}
    assert env["HOST_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}
    assert "HOST_IP" not in {e["name"] for e in container(plan, "auxiliary")["env"]}
    parsed = build_parser().parse_args(["run", *args["trainer-1"]])
    assert parsed.public_address == f"{NODE_IP}:31001"


def test_a_public_host_is_announced_instead_of_the_nodes():
    plan = plan_of(parse_manifest(swarm({"trainers": {"network": {"expose": "NodePort", "port": 31000,
                                                                    "publicHost": "lab-a.example.org"}}})))
    assert option(commands(plan)["trainer-2"], "--public-address") == "lab-a.example.org:31002"


def test_host_ports_take_the_p2p_port_on_each_node():
    plan = plan_of(parse_manifest(swarm({"backbone": {"network": {"expose": "HostPort", "port": 4001}}})))
    assert container(plan, "backbone")["ports"][0] == {"name": "p2p", "containerPort": 31337, "protocol": "TCP",
                                                       "hostPort": 4001}
    assert option(commands(plan)["backbone-0"], "--public-address") == f"{NODE_IP}:4001"
    assert not [name for kind, name in _by_name(plan) if kind == "Service" and name.endswith("-public")]


def test_a_load_balancer_peer_announces_its_address_once_its_service_has_one():
    manifest = parse_manifest(swarm({"auxiliary": {"network": {"expose": "LoadBalancer"}}}))
    pending = plan_of(manifest)
    service = _by_name(pending)[("Service", "digits-auxiliary-0-public")]["spec"]
    assert service["type"] == "LoadBalancer" and service["ports"][0]["port"] == 31337
    assert "nodePort" not in service["ports"][0]
    assert option(commands(pending)["auxiliary-0"], "--public-address") is None  # its pod IP alone, meanwhile
    live = {"digits-auxiliary-0-public": {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.4"}]}}}}
    hosts = exposure.public_hosts("digits", exposure.awaited_hosts(pending.roles), live.get)
    assert hosts == {"auxiliary-0": "203.0.113.4"}
    ready = plan_of(manifest, peer_hosts=hosts)
    assert option(commands(ready)["auxiliary-0"], "--public-address") == "203.0.113.4:31337"
    assert ready.hashes["auxiliary"] != pending.hashes["auxiliary"]  # the peer restarts to announce it


def test_client_only_trainers_run_in_client_mode_with_no_address_and_no_service():
    plan = plan_of(parse_manifest(swarm({"trainers": {"network": {"expose": "ClientOnly"}}})))
    args = commands(plan)
    assert all("--client-mode" in args[f"trainer-{i}"] and "--public-address" not in args[f"trainer-{i}"]
               for i in range(3))
    assert "--client-mode" not in args["auxiliary-0"]
    assert not [name for kind, name in _by_name(plan) if kind == "Service" and name.endswith("-public")]


def test_a_joining_lab_is_handed_the_hosts_public_backbone():
    document = swarm({"backbone": {"network": {"expose": "NodePort", "port": 31500, "publicHost": "lab-a.example.org"}}},
                     "swarm-digits-volunteers.yaml")
    plan = plan_of(parse_manifest(document))
    info = json.loads(next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["swarm-info.json"])
    assert info["initialPeers"][0] == f"/dns4/lab-a.example.org/tcp/31500/p2p/{PEER}"
    assert info["initialPeers"][1:] == info["relays"]
    # a node's own IP is known only in its pod: a NodePort backbone without publicHost is not handed out
    document["spec"]["backbone"]["network"].pop("publicHost")
    plan = plan_of(parse_manifest(document))
    info = json.loads(next(c for c in plan.children if c["kind"] == "ConfigMap")["data"]["swarm-info.json"])
    assert info["initialPeers"] == info["relays"]


def test_node_ports_of_a_group_the_door_or_another_group_are_refused_by_name():
    with pytest.raises(UserError, match="node port 31001 is backbone's too"):
        parse_manifest(swarm({"trainers": {"network": {"expose": "NodePort", "port": 31000}},
                              "backbone": {"network": {"expose": "NodePort", "port": 31001}}}))
    open_door = {"volunteers": {"serviceType": "NodePort", "publicHost": "lab-a.example.org", "relayPort": 31000,
                                "gatewayPort": 30999}}
    with pytest.raises(UserError, match="node port 31000 is volunteers.relayPort's too"):
        parse_manifest(swarm({**open_door, "trainers": {"network": {"expose": "NodePort", "port": 31000}}},
                             "swarm-digits-volunteers.yaml"))


@pytest.mark.parametrize("example,group", [("blockserver.yaml", "servers"), ("expertpool.yaml", "servers")])
def test_every_kinds_servers_and_backbone_can_be_exposed(example, group):
    document = yaml.safe_load((EXAMPLES / example).read_text())
    document["metadata"]["namespace"] = "default"
    document["spec"][group] = {**document["spec"].get(group, {}), "network": {"expose": "NodePort", "port": 32000}}
    document["spec"]["backbone"] = {"network": {"expose": "HostPort"}}
    manifest = parse_manifest(document)
    plan = plan_of(manifest)
    args = commands(plan)
    servers = sorted(name for name in args if option(args[name], "--public-address") and "backbone" not in name)
    assert [option(args[name], "--public-address") for name in servers] == [
        f"{NODE_IP}:{32000 + i}" for i in range(len(servers))] and servers
    backbone = next(name for name in args if "backbone" in name)
    assert option(args[backbone], "--public-address") == f"{NODE_IP}:31337"
    document["spec"][group]["network"] = {"expose": "ClientOnly"}
    with pytest.raises(UserError, match="cannot be ClientOnly"):
        parse_manifest(document)
