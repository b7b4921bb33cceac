"""Labs on the allowlist (issue 29): a lab pools a cluster's peers with one invite. Each of its
peers gets a token of its own, naming the role it runs, for the roles the lab may run and no more
than its peer quota at once; taking the lab off the allowlist (the manifest's or the Secret's
file) refuses its next renewals. The token service is a real gRPC server over TLS on 127.0.0.1."""

from __future__ import annotations

import argparse
import time

import grpc
import pytest
from rich.console import Console
from hivemind.utils.crypto import RSAPrivateKey

from hivekeeper.auth import protocol
from hivekeeper.auth.authorizer import SwarmAuthorizer
from hivekeeper.auth.client import AccessRefused, describe_swarm, pinned_channel, request_access
from hivekeeper.auth.gateway import Allowlist, TokenService, serve_gateway
from hivekeeper.auth.labs import Lab, PeerQuota, QuotaExceeded, parse_access_list, split_subject, token_subject
from hivekeeper.auth.tokens import mint_invite, verify_access_token
from hivekeeper.commands.run import register
from hivekeeper.kinds import KIND_MODULES, runtime
from hivekeeper.peer_table import lab_table, status_view
from hivekeeper.metrics import SwarmMetrics
from hivekeeper.swarm.parties import export_parties, labs_of, parties_of, swarm_figures
from hivekeeper.spec import swarm, blockserver, expertpool

HOUR = 3600.0
SWARM_INFO = {"kind": "Swarm", "name": "digits", "manifest": {"kind": "Swarm"}, "initialPeers": [], "relays": []}
LAB_B = Lab("lab-b", 2, frozenset({"trainer", "backbone"}))


@pytest.fixture(scope="module")
def swarm_key() -> RSAPrivateKey:
    return RSAPrivateKey()


@pytest.fixture
def gateway(swarm_key, tmp_path):
    allowlist_file = tmp_path / "allowlist"
    allowlist_file.write_text("carol\nlab-c maxPeers=1 roles=auxiliary  # a lab from the Secret\n")
    refusals: list[str] = []
    service = TokenService(swarm_key, Allowlist(["alice"], allowlist_file, {"lab-b": LAB_B}), lambda: SWARM_INFO,
                           token_ttl=HOUR, on_refuse=refusals.append)
    server = serve_gateway(service, "127.0.0.1", 0)
    server.address, server.allowlist_file, server.refusals, server.service = \
        f"127.0.0.1:{server.port}", allowlist_file, refusals, service
    yield server
    server.stop(grace=0)


def invite(key: RSAPrivateKey, identity: str) -> str:
    return mint_invite(key, identity, time.time() + HOUR)


def refusal(call) -> AccessRefused:
    with pytest.raises(AccessRefused) as caught:
        call()
    return caught.value


def test_each_peer_of_a_lab_gets_a_token_of_its_own_naming_its_role(gateway, swarm_key):
    lab_b = invite(swarm_key, "lab-b")
    trainer_key, backbone_key = RSAPrivateKey(), RSAPrivateKey()
    trainer = request_access(gateway.address, lab_b, trainer_key, role="trainer", peer="trainer-0")
    backbone = request_access(gateway.address, lab_b, backbone_key, role="backbone", peer="backbone-0")
    assert (trainer.identity, trainer.role) == ("lab-b", "trainer")
    assert (backbone.identity, backbone.role) == ("lab-b", "backbone")
    assert trainer.token.public_key == trainer_key.get_public_key().to_bytes()
    assert verify_access_token(backbone.token, swarm_key.get_public_key())
    assert gateway.service.quota.held() == {"lab-b": 2}
    # a single volunteer names no role and gets a token as before
    assert request_access(gateway.address, invite(swarm_key, "alice"), RSAPrivateKey()).role is None


def test_a_role_the_lab_may_not_run_and_a_peer_that_names_none_are_refused(gateway, swarm_key):
    lab_b = invite(swarm_key, "lab-b")
    denied = refusal(lambda: request_access(gateway.address, lab_b, RSAPrivateKey(), role="auxiliary", peer="aux-0"))
    assert denied.code == "PERMISSION_DENIED" and "lab 'lab-b' may run backbone, trainer, not auxiliary" in str(denied)
    unnamed = refusal(lambda: request_access(gateway.address, lab_b, RSAPrivateKey()))
    assert unnamed.code == "INVALID_ARGUMENT" and "names its role and itself" in str(unnamed)
    assert gateway.refusals == ["role_not_allowed", "malformed"]
    assert gateway.service.quota.held() == {}  # nothing refused takes a slot


def test_the_quota_counts_peers_not_requests_and_a_refusal_names_it(gateway, swarm_key):
    lab_b = invite(swarm_key, "lab-b")
    for name in ("trainer-0", "trainer-1"):
        request_access(gateway.address, lab_b, RSAPrivateKey(), role="trainer", peer=name)
    over = refusal(lambda: request_access(gateway.address, lab_b, RSAPrivateKey(), role="trainer", peer="trainer-2"))
    assert over.code == "PERMISSION_DENIED"
    assert "lab 'lab-b' has 2 peers holding a token, its quota (maxPeers 2)" in str(over)
    assert gateway.refusals == ["over_quota"]
    # a peer that renews, or restarts with a new key under its name, keeps its slot
    again = request_access(gateway.address, lab_b, RSAPrivateKey(), role="trainer", peer="trainer-1")
    assert again.role == "trainer" and gateway.service.quota.held() == {"lab-b": 2}
    # the probe a joining machine makes first reads the swarm without a token or a slot
    assert describe_swarm(gateway.address, lab_b, RSAPrivateKey()) == SWARM_INFO


def test_a_slot_frees_when_its_token_runs_out():
    quota, now = PeerQuota(), 1000.0
    quota.take(LAB_B, "trainer-0", now + 60, now)
    quota.take(LAB_B, "trainer-1", now + 90, now)
    with pytest.raises(QuotaExceeded, match=r"in 60 s at most"):
        quota.take(LAB_B, "trainer-2", now + 60, now)
    quota.take(LAB_B, "trainer-2", now + 120, now + 61)  # trainer-0's token ran out
    assert quota.held(now + 61) == {"lab-b": 2}


def test_a_lab_off_the_allowlist_or_its_file_gets_no_renewal(gateway, swarm_key):
    lab_c = invite(swarm_key, "lab-c")
    authorizer = SwarmAuthorizer(gateway.address, lab_c, RSAPrivateKey(), role="auxiliary", peer="auxiliary-0")
    assert authorizer.admitted_as is None  # no token yet
    assert authorizer.fetch_grant().identity == "lab-c"
    assert authorizer.admitted_as == "lab-c"  # what its reports and peer_info name
    internal = SwarmAuthorizer(gateway.address, mint_invite(swarm_key, "digits/trainer-0", time.time() + HOUR,
                                                            internal=True), RSAPrivateKey(), role="trainer")
    internal.fetch_grant()
    assert internal.admitted_as is None  # the swarm's own peer
    gateway.allowlist_file.write_text("carol\n")  # the host's admin takes lab-c out of the Secret
    gone = refusal(authorizer.fetch_grant)
    assert gone.code == "PERMISSION_DENIED" and "'lab-c' is not on this swarm's allowlist" in str(gone)


def test_a_request_with_a_bad_role_or_peer_is_malformed(gateway, swarm_key):
    key = RSAPrivateKey()
    base = protocol.join_request(invite(swarm_key, "lab-b"), key, time.time())
    for extra in ({"role": "monitor", "peer": "m"}, {"role": ["trainer"], "peer": "t"}, {"role": "trainer", "peer": ""},
                  {"role": "trainer", "peer": 7}, {"role": "trainer", "peer": "t", "probe": "yes"}):
        with pinned_channel(gateway.address, gateway.key_fingerprint) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(protocol.JOIN_METHOD)(protocol.encode({**base, **extra}), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, extra
        assert "not a Join request" in caught.value.details()


def test_the_allowlist_file_names_labs_and_says_which_line_is_wrong():
    listed = parse_access_list("# who may join\ncarol\nlab-b maxPeers=8 roles=trainer,backbone # pooled\n\n")
    assert listed.identities == {"carol"}
    assert listed.labs == {"lab-b": Lab("lab-b", 8, frozenset({"trainer", "backbone"}))}
    for text, message in [("carol\nlab-b maxPeers=8", "line 2: lab 'lab-b' needs maxPeers and roles"),
                          ("lab-b maxPeers=0 roles=trainer", "line 1: maxPeers='0' is not a whole number"),
                          ("lab-b maxPeers=2 roles=trainer,monitor", "line 1: roles: monitor: each is one of"),
                          ("Lab_B maxPeers=2 roles=trainer", "line 1: 'Lab_B' is not a lab name"),
                          ("lab-b maxpeers=2 roles=trainer", "line 1: 'maxpeers=2' is not one of"),
                          ("b maxPeers=1 roles=server\nb maxPeers=2 roles=server", "line 2: lab 'b' is listed twice")]:
        with pytest.raises(ValueError, match=message):
            parse_access_list(text)
    # a name that is a lab in the manifest stays one, whatever the file says of it
    both = Allowlist(["alice"], labs={"lab-b": LAB_B})
    assert both.lab("lab-b") == LAB_B and both.lab("alice") is None and "lab-b" in both


def test_token_subjects_name_the_identity_and_the_role():
    assert split_subject(token_subject("lab-b", "trainer")) == ("lab-b", "trainer")
    assert split_subject(token_subject("alice", None)) == ("alice", None)
    # the swarm's own roles are named RUN/ROLE-INDEX: no lab role, the whole name is the identity
    assert split_subject("digits/trainer-0") == ("digits/trainer-0", None)
    assert split_subject(token_subject("digits/trainer-0", "trainer")) == ("digits/trainer-0", "trainer")


@pytest.mark.parametrize("kind", sorted(KIND_MODULES))
def test_each_kind_grants_its_lab_roles_to_the_roles_that_run_them(kind):
    spec_module = {"Swarm": swarm, "BlockServer": blockserver, "ExpertPool": expertpool}[kind]
    granted = {role: entry.lab_role for role, entry in runtime(kind).role_modules.items() if entry.lab_role}
    assert set(granted.values()) == set(spec_module.LAB_ROLES)
    # and `hivekeeper run ROLE` hands the word to the role's token requests
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for role, word in granted.items():
        args, _ = parser.parse_known_args(["run", role, "--manifest", "m.yaml"])
        assert args.lab_role == word


def test_status_sums_the_peers_by_lab():
    reports = [{"name": "trainer-0", "role": "trainer", "samplesPerSecond": 100.0},
               {"name": "backbone-0", "role": "backbone"},
               {"name": "trainer-0", "role": "trainer", "samplesPerSecond": 80.0, "lab": "lab-b"},
               {"name": "trainer-1", "role": "trainer", "samplesPerSecond": 70.0, "lab": "lab-b"}]
    console = Console(width=200, record=True)
    console.print(status_view("digits", reports))
    text = console.export_text()
    lines = [[word for word in line.split() if word != "│"] for line in text.splitlines()]
    assert ["(host)", "2", "1", "backbone,", "1", "trainer", "100"] in lines, text
    assert ["lab-b", "2", "2", "trainer", "150"] in lines, text
    # without other labs, only the peers
    assert lab_table(reports[:2]) is None and status_view("digits", reports[:2]).columns[1].header == "role"


def test_the_monitor_sums_each_partys_part():
    reports = [{"role": "backbone"}, {"role": "trainer", "samplesPerSecond": 100.04, "samples": 3000,
                                      "averagingBytesSent": 10},
               {"role": "trainer", "lab": "lab-b", "samplesPerSecond": 50.0, "samples": 1000, "averagingBytesSent": 5},
               {"role": "backbone", "lab": "lab-b"}, {"role": "trainer", "lab": "lab-b", "samples": "garbage"}]
    assert labs_of(reports, "digits") == [
        {"name": "digits", "host": True, "peers": 2, "samplesPerSecond": 100.0, "samples": 3000, "share": 0.75,
         "averagingBytesSent": 10},
        {"name": "lab-b", "host": False, "peers": 3, "samplesPerSecond": 50.0, "samples": 1000, "share": 0.25,
         "averagingBytesSent": 5}]
    assert labs_of(reports[:2], "digits") is None  # the host alone: nothing to break down

    # what a joining lab's backbone (and the monitor) show and export: the swarm's figures
    for r, epoch in zip(reports, (None, 7, 9, None, 8)):
        if epoch is not None:
            r["globalEpoch"] = epoch
    figures = swarm_figures(reports, "digits")
    assert figures["globalStep"] == 9 and figures["samplesPerSecond"] == 150.0 and len(figures["labs"]) == 2
    metrics = SwarmMetrics()

    def shares() -> dict[str, float]:
        return {s.labels["lab"]: s.value for m in metrics.registry.collect() for s in m.samples
                if s.name == "hivekeeper_lab_sample_share"}

    export_parties(metrics, parties_of(reports, "digits"))
    assert shares() == {"digits": 0.75, "lab-b": 0.25}
    export_parties(metrics, parties_of(reports[:2], "digits"))  # lab B gone: its series go; the host's stays
    assert shares() == {"digits": 1.0}
