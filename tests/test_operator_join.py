"""A lab's resource that joins another lab's swarm (spec.join), on the operator's side: what the
host's token service answers becomes what the lab runs (only its contribution, numbered apart,
bootstrapping from the host, each pod asking for its own token with the lab's invite), and every
way of not being admitted ends in the Joined condition and an Event, with no pod left to
crash-loop. The token service's own answers: tests/test_auth.py (the probe)."""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonschema
import pytest
import yaml

pytest.importorskip("kopf", reason="the operator extra is not installed (pip install -e '.[operator]')")

from conftest import EXAMPLES, deep_update  # noqa: E402
from hivekeeper.kinds import runtime  # noqa: E402
from hivekeeper.spec import parse_manifest  # noqa: E402
from hivekeeper.spec.crd import jsonschema_for  # noqa: E402
from hivekeeper.topology import lab_index_base  # noqa: E402
from hivekeeper_operator import joining  # noqa: E402
from hivekeeper_operator.network import JOIN_DIR  # noqa: E402
from hivekeeper_operator.plan import Request, plan  # noqa: E402
from hivekeeper_operator.pods import WorkloadSettings  # noqa: E402
from test_operator import (NS, STS, apply_swarm, children, client, cluster, condition, events,  # noqa: E402,F401
                           monitor, start_operator, swarm, wait_for)

GATEWAY = "gateway.lab-a.example.org:31336"
RELAY = "/dns4/relay.lab-a.example.org/tcp/31337/p2p/QmRelayOfLabAxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
SIGNER = "QmBalancerOfLabAxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
PEER = "QmcMnYTosWBs1ZaJR1dwEV3eRk1SHoPoTggxmWwZJGKG96"


def host_answer(name: str = "digits", **changes: Any) -> dict[str, Any]:
    """What lab A's token service tells lab B about its Swarm (hivekeeper.topology.volunteer_info)."""
    host = yaml.safe_load((EXAMPLES / "swarm-digits-volunteers.yaml").read_text())
    host = deep_update(host, {"metadata": {"name": name}, **changes})
    manifest = parse_manifest(host).model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"status"})
    manifest["metadata"] = {"name": name}
    return {"identity": "lab-b", "swarm": {"kind": "Swarm", "name": name, "manifest": manifest,
                                           "initialPeers": [RELAY], "relays": [RELAY], "planSigner": SIGNER}}


def joining_swarm(**spec: Any) -> Any:
    return parse_manifest({"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "Swarm",
                           "metadata": {"name": "lab-b-part", "namespace": "lab-b"},
                           "spec": {"join": {"gateway": GATEWAY, "inviteSecret": "lab-a-invite"},
                                    "trainers": {"replicas": 2, "resources": {"cpu": 3}}, "auxiliary": {"replicas": 1},
                                    **spec}})


def joined_plan(answer: dict[str, Any] | None = None):
    joining_manifest = joining_swarm()
    outcome = joining.join(joining_manifest, answer or host_answer())
    assert outcome.host is not None, outcome
    host = outcome.host
    ids = {name: PEER for name in runtime("Swarm").identity_roles(host.manifest) if name.startswith("backbone-")}
    owner = {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "Swarm",
             "metadata": {"name": "lab-b-part", "namespace": "lab-b", "uid": "0000-2222"}}
    return host, plan(Request(owner, host.manifest, ids, {"backbone-0.key": "a2V5"},
                              WorkloadSettings(image="hivekeeper:test"), joined=host))


def args_of(role) -> dict[str, list[str]]:
    """A role's arguments by flag."""
    out: dict[str, list[str]] = {}
    flag = None
    for arg in role.args[1:]:
        if arg.startswith("--"):
            flag = arg
            out[flag] = []
        elif flag:
            out[flag].append(arg)
    return out


def test_the_lab_computes_the_hosts_swarm_with_its_own_peers():
    answer = host_answer(spec={"averaging": {"timeoutSeconds": 25}, "trainers": {"replicas": 5}})
    host, _ = joined_plan(answer)
    read = host.document["spec"]
    assert host.identity == "lab-b" and host.name == "digits" and host.document["metadata"] == {"name": "digits"}
    assert read["task"]["name"] == "digits" and read["averaging"]["timeoutSeconds"] == 25  # the host's
    assert read["trainers"]["resources"]["cpu"] == 3 and read["trainers"]["replicas"] == 5  # its, the host's count
    assert "join" not in read and read["volunteers"]["enabled"]  # the pods read the host's manifest, valid as it is
    planned = host.manifest.spec
    assert planned.trainers.replicas == 2 and planned.auxiliary.replicas == 1 and planned.join.gateway == GATEWAY
    assert not planned.volunteers.enabled and host.manifest.metadata.name == "lab-b-part"


def test_the_lab_runs_only_its_contribution_numbered_apart_and_admitted_by_its_invite():
    host, wanted = joined_plan()
    assert sorted(c.name for c in wanted.components) == ["auxiliary", "backbone", "trainer"]
    base = lab_index_base("lab-b")
    assert base > 1000
    trainers = [r for r in wanted.roles if r.component == "trainer"]
    assert [r.name for r in trainers] == ["trainer-0", "trainer-1"]  # the pods' ordinals
    for role in wanted.roles:
        args = args_of(role)
        assert args["--index"] == [str(base + role.index)], role.args
        assert args["--gateway"] == [GATEWAY] and args["--invite"] == [f"{JOIN_DIR}/join-invite"]
        assert RELAY in args["--initial-peers"]
    for role in trainers:
        args = args_of(role)
        assert args["--plan-signer"] == [SIGNER]  # the host's balancer plans the lab's trainers too
        assert any("lab-b-part-backbone-0" in peer for peer in args["--initial-peers"])  # and its own backbone
    config = next(c for c in wanted.children if c["kind"] == "ConfigMap")
    assert json.loads(config["data"]["manifest.json"]) == host.document
    sts = next(c for c in wanted.children if c["kind"] == "StatefulSet" and c["metadata"]["name"].endswith("trainer"))
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["join-invite"]["secret"]["secretName"] == "lab-a-invite"
    assert not any(c["kind"] == "Secret" and "invites" in c["metadata"]["name"] for c in wanted.children)


@pytest.mark.parametrize("answer,reason", [
    ({"reason": "InviteRefused", "message": "'lab-b' is not on this swarm's allowlist"}, "InviteRefused"),
    ({"reason": "GatewayUnreachable", "message": "no answer"}, "GatewayUnreachable"),
    ({"identity": "lab-b", "swarm": {"kind": "BlockServer", "name": "llama"}}, joining.HOST_KIND_MISMATCH),
    (deep_update(host_answer(), {"swarm": {"manifest": {"spec": {"task": {"name": "no-such-task"}}}}}),
     joining.HOST_TASK_UNSUPPORTED),
])
def test_an_answer_that_admits_nothing_says_why(answer, reason):
    outcome = joining.join(joining_swarm(), answer)
    assert outcome.host is None and outcome.reason == reason and outcome.message
    assert outcome.keeps_peers == (reason == "GatewayUnreachable")


def test_an_invite_secret_without_its_key_or_missing_says_so():
    good = {"data": {"invite": base64.b64encode(b"hk1.abc.def\n").decode()}}
    assert joining.invite_of(good, "s") == ("hk1.abc.def", "")
    assert "does not exist" in joining.invite_of(None, "s")[1]
    assert "no key 'invite'" in joining.invite_of({"data": {"other": "eA=="}}, "s")[1]


def test_probes_are_asked_again_after_a_while_or_for_a_new_invite():
    now = [0.0]
    calls: list[str] = []

    def prober(gateway: str, invite: str) -> dict[str, Any]:
        calls.append(invite)
        return {"reason": "GatewayUnreachable", "message": ""} if invite == "down" else {"identity": "lab-b"}

    cache = joining.ProbeCache(prober, clock=lambda: now[0])
    for _ in range(3):
        cache.answer(("ns", "r"), GATEWAY, "one")
    assert calls == ["one"]
    cache.answer(("ns", "r"), GATEWAY, "down")
    now[0] += joining.RETRY_SECONDS + 1
    cache.answer(("ns", "r"), GATEWAY, "down")  # a refusal is asked again sooner than an admission
    assert calls == ["one", "down", "down"]
    cache.answer(("ns", "r"), GATEWAY, "one")
    now[0] += joining.RETRY_SECONDS + 1
    cache.answer(("ns", "r"), GATEWAY, "one")
    assert calls == ["one", "down", "down", "one"]


# ---------------------------------------------------------------------------------------------
# The reconciler against the API emulator (tests/test_operator.py's fixtures): the host's token
# service is a fake prober that answers by invite


def test_a_joining_swarm_runs_once_admitted_keeps_its_peers_through_a_partition_and_stops_refused(
        cluster, client, start_operator):
    import kubernetes

    answers = {"good": host_answer(), "down": {"reason": "GatewayUnreachable", "message": "no answer from lab A"},
               "revoked": {"reason": "InviteRefused", "message": "'lab-b' is not on this swarm's allowlist"}}
    probed: list[str] = []

    def prober(gateway: str, invite: str) -> dict[str, Any]:
        probed.append(invite)
        return answers[invite]

    start_operator(join_prober=prober)
    name = "lab-b-part"
    manifest = {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "Swarm", "metadata": {"name": name},
                "spec": {"join": {"gateway": GATEWAY, "inviteSecret": "lab-a-invite"}, "trainers": {"replicas": 2}}}
    apply_swarm(client, manifest)

    def joined(reason: str) -> dict[str, Any] | None:
        obj = swarm(cluster, name) or {}
        found = [c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == "Joined"]
        return obj if found and found[0]["reason"] == reason else None

    waiting = wait_for(lambda: joined(joining.INVITE_MISSING), what="Joined: InviteMissing")
    assert waiting["status"]["phase"] == "Pending" and "lab-a-invite" in condition(waiting, "Joined")["message"]
    assert not [k for k in children(cluster, name) if k[0] == "StatefulSet"] and probed == []
    assert any(e["reason"] == joining.INVITE_MISSING and e["type"] == "Warning" for e in events(cluster, name))

    core = kubernetes.client.CoreV1Api(client)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "lab-a-invite"},
              "data": {"invite": base64.b64encode(b"good").decode()}}
    core.create_namespaced_secret(NS, secret)
    running = wait_for(lambda: joined("Joined"), what="Joined")
    assert condition(running, "Joined")["status"] == "True"
    jsonschema.validate(running, jsonschema_for("Swarm"))  # the emulator does not check a status write
    sets = {k[1] for k in children(cluster, name) if k[0] == "StatefulSet"}
    assert sets == {f"{name}-backbone", f"{name}-trainer", f"{name}-auxiliary"}  # no monitor, balancer, door
    assert cluster.object(STS, NS, f"{name}-trainer")["spec"]["replicas"] == 2

    def reinvite(text: str) -> None:
        core.patch_namespaced_secret("lab-a-invite", NS, {"data": {"invite": base64.b64encode(text.encode()).decode()}})

    reinvite("down")  # a partition: the lab's peers run on and retry
    wait_for(lambda: joined("GatewayUnreachable"), what="Joined: GatewayUnreachable")
    assert {k[1] for k in children(cluster, name) if k[0] == "StatefulSet"} == sets
    reinvite("revoked")  # refused: the lab's peers stop rather than be refused over and over
    stopped = wait_for(lambda: (obj := joined("InviteRefused")) and not [
        k for k in children(cluster, name) if k[0] == "StatefulSet"] and obj, what="the lab's peers stopped")
    assert stopped["status"]["phase"] == "Pending" and "allowlist" in condition(stopped, "Joined")["message"]
    jsonschema.validate(stopped, jsonschema_for("Swarm"))
    assert any(e["reason"] == "InviteRefused" for e in events(cluster, name))


@pytest.mark.parametrize("kind,example,own,components", [
    ("BlockServer", "blockserver-volunteers.yaml", {"servers": {"replicas": 1, "device": "auto"}},
     ["backbone-blocks", "block-server"]),
    ("ExpertPool", "expertpool-volunteers.yaml", {"servers": {"replicas": 1}, "trainers": {"replicas": 0}},
     ["backbone-experts", "expert-server"]),
])
def test_the_other_kinds_join_with_their_servers(kind, example, own, components):
    host = yaml.safe_load((EXAMPLES / example).read_text())
    document = parse_manifest(host).model_dump(by_alias=True, mode="json", exclude_none=True, exclude={"status"})
    name = host["metadata"]["name"]
    answer = {"identity": "lab-b", "swarm": {"kind": kind, "name": name, "manifest": {**document, "metadata": {"name": name}},
                                             "initialPeers": [RELAY], "relays": [RELAY]}}
    joining_manifest = parse_manifest({"apiVersion": "hivekeeper.dev/v1alpha1", "kind": kind,
                                       "metadata": {"name": "part", "namespace": "lab-b"},
                                       "spec": {"join": {"gateway": GATEWAY, "inviteSecret": "i"}, **own}})
    outcome = joining.join(joining_manifest, answer)
    assert outcome.host is not None, outcome
    ids = {n: PEER for n in runtime(kind).identity_roles(outcome.host.manifest)}
    owner = {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": kind,
             "metadata": {"name": "part", "namespace": "lab-b", "uid": "0000-3333"}}
    wanted = plan(Request(owner, outcome.host.manifest, ids, {}, WorkloadSettings(image="hivekeeper:test"),
                          joined=outcome.host))
    assert sorted(c.name for c in wanted.components) == components
    base = lab_index_base("lab-b")
    assert all(args_of(r)["--index"] == [str(base + r.index)] and args_of(r)["--gateway"] == [GATEWAY]
               for r in wanted.roles)
