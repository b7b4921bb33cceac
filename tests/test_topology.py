"""The topology: every role the spec asks for, backbone peers with stable identities that
everyone else bootstraps from, distinct ports."""

from __future__ import annotations

from conftest import write_manifest
from hivekeeper.local.runner import prepare_run
from hivekeeper.spec import load_manifest


def test_roles_follow_the_spec(tmp_path):
    manifest = load_manifest(write_manifest(tmp_path, {"spec": {"backbone": {"replicas": 2},
                                                                "trainers": {"replicas": 3},
                                                                "auxiliary": {"replicas": 1}}}))
    _, roles = prepare_run(manifest, tmp_path / "run")
    names = [r.name for r in roles]
    assert names == ["backbone-0", "backbone-1", "trainer-0", "trainer-1", "trainer-2", "auxiliary-0", "monitor-0",
                     "balancer-0"]
    assert [r.name for r in roles if r.completes_run] == ["monitor-0"]
    # the balancer signs the averaging plan with a stable key; peers are told whose signature to trust
    balancer = roles[-1]
    assert "--identity" in balancer.args
    signers = {r.args[r.args.index("--plan-signer") + 1] for r in roles if "--plan-signer" in r.args}
    assert len(signers) == 1 and {r.component for r in roles if "--plan-signer" in r.args} == {
        "trainer", "auxiliary", "monitor"}

    metrics_ports = [r.ports["metrics"] for r in roles]
    assert len(set(metrics_ports)) == len(roles)

    backbone_maddrs = set()
    for role in roles[:2]:
        assert "--identity" in role.args and role.ports["p2p"] > 0
        backbone_maddrs.add(f"/tcp/{role.ports['p2p']}/")
    for role in roles:
        peers = role.args[role.args.index("--initial-peers") + 1:]
        # everyone bootstraps from the backbone; a backbone peer from the other backbone peers
        expected = 1 if role.component == "backbone" else 2
        assert len(peers) == expected and all("/p2p/" in p for p in peers)


def test_backbone_identity_is_stable_across_runs(tmp_path):
    manifest = load_manifest(write_manifest(tmp_path))
    _, first = prepare_run(manifest, tmp_path / "run")
    _, second = prepare_run(manifest, tmp_path / "run")
    peer_id = lambda roles: roles[-1].args[roles[-1].args.index("--initial-peers") + 1].rsplit("/", 1)[1]
    assert peer_id(first) == peer_id(second)
