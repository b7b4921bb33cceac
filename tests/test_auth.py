"""Admission by token without a DHT: the swarm key, invites, access tokens, the token service
(a real gRPC server over TLS on 127.0.0.1, pinned by the swarm key's fingerprint) and the
authorizer's dealings with it."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey

from conftest import REPO, wait_for, write_manifest
from hivekeeper.auth import protocol
from hivekeeper.auth.authorizer import make_authorizer
from hivekeeper.auth.client import AccessRefused, GatewayUnavailable, UntrustedGateway, pinned_channel, request_access
from hivekeeper.auth.gateway import Allowlist, TokenService, serve_gateway
from hivekeeper.auth.keys import (
    load_or_create_swarm_key,
    load_swarm_key,
    load_swarm_public_key,
    public_key_text,
    unwrap_private_key,
)
from hivekeeper.auth.tls import (
    GATEWAY_TLS_NAME,
    RotatingCertificate,
    certificate_fingerprint,
    fetch_certificate,
    key_fingerprint,
)
from hivekeeper.auth.tokens import (
    _INVITE_DOMAIN,
    InvalidToken,
    _b64,
    _token_bytes,
    issue_access_token,
    mint_invite,
    read_invite,
    token_expiry,
    verify_access_token,
)

HOUR = 3600.0
SWARM_INFO = {"kind": "Swarm", "name": "digits", "manifest": {"kind": "Swarm"},
              "initialPeers": ["/ip4/127.0.0.1/tcp/1/p2p/QmRelay"], "relays": ["/ip4/127.0.0.1/tcp/1/p2p/QmRelay"]}


@pytest.fixture(scope="module")
def swarm_key() -> RSAPrivateKey:
    return RSAPrivateKey()


@pytest.fixture(scope="module")
def other_key() -> RSAPrivateKey:
    return RSAPrivateKey()


@pytest.fixture(scope="module")
def peer_key() -> RSAPrivateKey:
    return RSAPrivateKey()


def invite(key: RSAPrivateKey, identity: str = "alice", hours: float = 1.0, internal: bool = False) -> str:
    return mint_invite(key, identity, time.time() + hours * HOUR, internal=internal)


# --- the swarm key ----------------------------------------------------------------------------


def test_swarm_key_is_created_once_private_and_reloaded(tmp_path):
    path = tmp_path / "keys" / "swarm-auth.pem"
    first = load_or_create_swarm_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(path.parent) == ["swarm-auth.pem"]  # no temporary file left behind
    again = load_or_create_swarm_key(path)
    public = first.get_public_key().to_bytes()
    assert again.get_public_key().to_bytes() == load_swarm_key(path).get_public_key().to_bytes() == public
    (tmp_path / "swarm.pub").write_text(public_key_text(first.get_public_key()) + "\n")
    assert load_swarm_public_key(tmp_path / "swarm.pub").to_bytes() == load_swarm_public_key(path).to_bytes() == public
    signature = again.sign(b"data")  # the reloaded key signs for the same public key
    assert first.get_public_key().verify(b"data", signature)


def test_racing_creators_end_up_with_one_key(tmp_path):
    path = tmp_path / "swarm-auth.pem"
    keys = []
    threads = [threading.Thread(target=lambda: keys.append(load_or_create_swarm_key(path))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({key.get_public_key().to_bytes() for key in keys}) == 1
    assert os.listdir(tmp_path) == ["swarm-auth.pem"]


# --- invites ----------------------------------------------------------------------------------


def test_invite_round_trip(swarm_key):
    text = invite(swarm_key, "pool/trainer-0", internal=True)
    assert text.startswith("hk1.") and all(c.isalnum() or c in "._-" for c in text)  # URL-safe
    read = read_invite(text + "\n", swarm_key.get_public_key())  # as read from a file
    assert (read.identity, read.internal) == ("pool/trainer-0", True)
    assert read_invite(invite(swarm_key, "bob"), swarm_key.get_public_key()).internal is False
    assert read.key_fingerprint == key_fingerprint(swarm_key.get_public_key())


def test_key_fingerprint_is_the_sha256_of_the_public_key_info(swarm_key, other_key):
    """The invite's pin, as anyone can recompute it: `openssl pkey -pubin -outform DER | sha256`."""
    public = unwrap_private_key(swarm_key).public_key()
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    expected = base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()
    assert key_fingerprint(swarm_key.get_public_key()) == key_fingerprint(public) == expected
    assert key_fingerprint(other_key.get_public_key()) != expected
    certificate = RotatingCertificate(unwrap_private_key(swarm_key)).current()[1]
    assert certificate_fingerprint(certificate) == expected
    names = x509.load_pem_x509_certificate(certificate).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == [GATEWAY_TLS_NAME]


def _signed_invite(key: RSAPrivateKey, claims: dict) -> str:
    """An invite with exactly these claims, signed by `key` as mint_invite signs."""
    payload = _b64(json.dumps(claims).encode())
    return f"hk1.{payload}.{_b64(base64.b64decode(key.sign(_INVITE_DOMAIN + payload.encode())))}"


def _tampered(text: str) -> str:
    """The payload of an invite for "alice" rewritten to name "mallory", signature kept."""
    prefix, payload, signature = text.split(".")
    claims = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).replace(b"alice", b"mallory")
    return ".".join([prefix, base64.urlsafe_b64encode(claims).rstrip(b"=").decode(), signature])


@pytest.mark.parametrize("case, reason, message", [
    ("expired", "expired", "expired at"),
    ("tampered", "bad_signature", "not signed by this swarm's key"),
    ("another swarm", "bad_signature", "not signed by this swarm's key"),
    ("empty", "malformed", "not a hivekeeper invite"),
    ("garbage", "malformed", "not a hivekeeper invite"),
    ("not base64", "malformed", "damaged"),
    ("truncated", "bad_signature", "not signed by this swarm's key"),
    ("not json", "malformed", "damaged"),
    ("not text", "malformed", "is text"),
    ("older hivekeeper", "malformed", "'alice' was made by an older hivekeeper .*: mint a new invite"),
    ("names another key", "bad_signature", "names another swarm key than the one that signed it"),
])
def test_bad_invites_are_refused_with_a_reason(swarm_key, other_key, case, reason, message):
    good = invite(swarm_key)
    text = {
        "expired": mint_invite(swarm_key, "alice", time.time() - 1),
        "tampered": _tampered(good),
        "another swarm": invite(other_key),
        "empty": "",
        "garbage": "\x00\xff definitely not an invite",
        "not base64": "hk1.!!!.???",
        "truncated": good[:-7],
        "not json": "hk1." + base64.urlsafe_b64encode(b"{nope").decode() + ".AAAA",
        "not text": b"hk1.abc.def",
        "older hivekeeper": _signed_invite(swarm_key, {"sub": "alice", "exp": time.time() + HOUR, "int": False}),
        "names another key": _signed_invite(swarm_key, {"sub": "alice", "exp": time.time() + HOUR,
                                                        "key": key_fingerprint(other_key.get_public_key())}),
    }[case]
    with pytest.raises(InvalidToken, match=message) as refused:
        read_invite(text, swarm_key.get_public_key())
    assert refused.value.reason == reason


# --- access tokens ----------------------------------------------------------------------------


def test_access_token_checks(swarm_key, other_key, peer_key):
    public = swarm_key.get_public_key()
    peer = peer_key.get_public_key().to_bytes()
    token = issue_access_token(swarm_key, "alice", peer, ttl_seconds=HOUR)
    assert token.username == "alice" and token.public_key == peer
    assert token.expiration_time.endswith("+00:00")  # ISO-8601, UTC
    assert verify_access_token(token, public)

    def changed(**fields) -> AccessToken:
        copy = AccessToken()
        copy.CopyFrom(token)
        for name, value in fields.items():
            setattr(copy, name, value)
        return copy

    verdicts = {
        "expired": verify_access_token(issue_access_token(swarm_key, "alice", peer, HOUR, now=time.time() - 2 * HOUR),
                                       public),
        "expires later than signed": verify_access_token(changed(expiration_time="2999-01-01T00:00:00+00:00"), public),
        "another identity": verify_access_token(changed(username="mallory"), public),
        "another key": verify_access_token(changed(public_key=other_key.get_public_key().to_bytes()), public),
        "another swarm": verify_access_token(issue_access_token(other_key, "alice", peer, HOUR), public),
        "no token": verify_access_token(AccessToken(), public),
        "garbage signature": verify_access_token(changed(signature=b"\x00garbage"), public),
    }
    assert {case: (bool(check), check.reason) for case, check in verdicts.items()} == {
        "expired": (False, "expired"),
        "expires later than signed": (False, "bad_signature"),
        "another identity": (False, "bad_signature"),
        "another key": (False, "bad_signature"),
        "another swarm": (False, "bad_signature"),
        "no token": (False, "bad_signature"),
        "garbage signature": (False, "bad_signature"),
    }
    # expiry must be a zoned ISO-8601 time, even with a good signature
    for bad_time in ("tomorrow", "2999-01-01T00:00:00"):
        unsigned = changed(expiration_time=bad_time, signature=b"")
        unsigned.signature = swarm_key.sign(_token_bytes(unsigned))
        assert verify_access_token(unsigned, public).reason == "malformed"


# --- the token service ------------------------------------------------------------------------


@pytest.fixture
def gateway(swarm_key, tmp_path):
    allowlist_file = tmp_path / "allowlist"
    allowlist_file.write_text("# volunteers\ncarol\n")
    refusals: list[str] = []
    issued: list[tuple[str, bool]] = []
    service = TokenService(swarm_key, Allowlist(["alice"], allowlist_file), lambda: SWARM_INFO, token_ttl=HOUR,
                           on_issue=lambda identity, internal: issued.append((identity, internal)),
                           on_refuse=refusals.append)
    server = serve_gateway(service, "127.0.0.1", 0)
    server.address = f"127.0.0.1:{server.port}"
    server.allowlist_file, server.refusals, server.issued = allowlist_file, refusals, issued
    yield server
    server.stop(grace=0)


def join_raw(gateway, body: bytes | dict) -> tuple[grpc.StatusCode, str]:
    """One Join call as any client could make it; the status and its message."""
    data = body if isinstance(body, bytes) else protocol.encode(body)
    with pinned_channel(gateway.address, gateway.key_fingerprint) as channel:
        try:
            channel.unary_unary(protocol.JOIN_METHOD)(data, timeout=10)
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_allowlisted_identity_gets_a_token_and_the_swarm(gateway, swarm_key, peer_key):
    grant = request_access(gateway.address, invite(swarm_key, "alice"), peer_key)
    assert grant.identity == "alice"
    assert grant.token.public_key == peer_key.get_public_key().to_bytes()
    assert verify_access_token(grant.token, swarm_key.get_public_key())
    assert grant.swarm_public_key.to_bytes() == swarm_key.get_public_key().to_bytes()
    assert grant.swarm == SWARM_INFO
    assert HOUR - 60 < grant.expires_at - time.time() <= HOUR
    # a token never outlives its invite
    short = request_access(gateway.address, invite(swarm_key, "alice", hours=0.1), peer_key)
    assert short.expires_at - time.time() <= 0.1 * HOUR
    # the swarm's own roles need no allowlist entry
    assert request_access(gateway.address, invite(swarm_key, "digits/trainer-0", internal=True), peer_key).identity
    assert gateway.issued == [("alice", False), ("alice", False), ("digits/trainer-0", True)]


@pytest.mark.parametrize("case, code, message, reason", [
    ("not allowlisted", grpc.StatusCode.PERMISSION_DENIED, "'mallory' is not on this swarm's allowlist",
     "not_allowlisted"),
    ("expired invite", grpc.StatusCode.UNAUTHENTICATED, "expired", "expired"),
    ("another swarm's invite", grpc.StatusCode.UNAUTHENTICATED, "not signed by this swarm's key", "bad_signature"),
    ("proof by another key", grpc.StatusCode.UNAUTHENTICATED, "not signed by the key", "bad_proof"),
    ("stale request", grpc.StatusCode.UNAUTHENTICATED, "off the gateway's clock", "clock_skew"),
    ("garbage bytes", grpc.StatusCode.INVALID_ARGUMENT, "not a Join request", "malformed"),
    ("a JSON list", grpc.StatusCode.INVALID_ARGUMENT, "not a Join request", "malformed"),
    ("missing fields", grpc.StatusCode.INVALID_ARGUMENT, "not a Join request", "malformed"),
    ("not a key", grpc.StatusCode.INVALID_ARGUMENT, "not a Join request", "malformed"),
    ("garbage invite", grpc.StatusCode.INVALID_ARGUMENT, "not a hivekeeper invite", "malformed"),
])
def test_gateway_refusals(gateway, swarm_key, other_key, peer_key, case, code, message, reason):
    now = time.time()
    good = protocol.join_request(invite(swarm_key, "alice"), peer_key, now)
    body = {
        "not allowlisted": protocol.join_request(invite(swarm_key, "mallory"), peer_key, now),
        "expired invite": protocol.join_request(mint_invite(swarm_key, "alice", now - 1), peer_key, now),
        "another swarm's invite": protocol.join_request(invite(other_key, "alice"), peer_key, now),
        "proof by another key": protocol.join_request(invite(swarm_key, "alice"), peer_key, now, signer=other_key),
        "stale request": protocol.join_request(invite(swarm_key, "alice"), peer_key, now - 600),
        "garbage bytes": b"\xff\x00\x13garbage",
        "a JSON list": b"[1, 2, 3]",
        "missing fields": {"invite": good["invite"]},
        "not a key": {**good, "publicKey": "ssh-rsa not-a-key"},
        "garbage invite": {**good, "invite": "hello"},
    }[case]
    status, details = join_raw(gateway, body)
    assert status == code and message in details
    assert gateway.refusals[-1] == reason
    assert join_raw(gateway, good) == (grpc.StatusCode.OK, "")  # the same gateway still admits


def test_refused_client_gets_one_clear_error(gateway, swarm_key, peer_key):
    with pytest.raises(AccessRefused, match="PERMISSION_DENIED.*'mallory' is not on this swarm's allowlist"):
        request_access(gateway.address, invite(swarm_key, "mallory"), peer_key)
    # an invite that cannot work is refused before asking anyone
    with pytest.raises(AccessRefused, match="has expired"):
        request_access("127.0.0.1:1", mint_invite(swarm_key, "alice", time.time() - 1), peer_key)
    with pytest.raises(AccessRefused, match="not a hivekeeper invite"):
        request_access("127.0.0.1:1", "not an invite", peer_key)
    older = _signed_invite(swarm_key, {"sub": "alice", "exp": time.time() + HOUR, "int": False})
    with pytest.raises(AccessRefused, match="INVALID_ARGUMENT.*older hivekeeper .*: mint a new invite"):
        request_access("127.0.0.1:1", older, peer_key)


def test_join_refuses_an_identity_off_the_allowlist_and_a_silent_gateway_clearly(gateway, swarm_key, tmp_path):
    """`hivekeeper join` exits 2 with the reason on stderr, before starting anything."""
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        silent = f"127.0.0.1:{unused.getsockname()[1]}"
    cases = {"stranger": (gateway.address, invite(swarm_key, "mallory"), "not on this swarm's allowlist"),
             "nobody": (silent, invite(swarm_key, "alice"), "token service does not answer")}
    for name, (address, token, reason) in cases.items():
        done = subprocess.run([sys.executable, "-m", "hivekeeper", "join", address, "--token", token, "--run-dir",
                               str(tmp_path / name), "--dry-run"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and reason in done.stderr, (name, done.stderr)
        assert not (tmp_path / name / "manifest.json").exists()


def test_the_probe_tells_a_joining_lab_what_it_joins_or_why_not(gateway, swarm_key, other_key):
    """What the operator asks for a lab's resource with spec.join (hivekeeper.auth.probe, run as
    the operator runs it: a process of its own), and each reason it can be refused."""
    from hivekeeper.auth.probe import probe
    from hivekeeper_operator.joining import subprocess_prober

    assert subprocess_prober(gateway.address, invite(swarm_key, "alice")) == {"identity": "alice", "swarm": SWARM_INFO}
    cases = {
        "GatewayUnreachable": (f"127.0.0.1:{free_port()}", invite(swarm_key, "alice")),
        "GatewayKeyMismatch": (gateway.address, invite(other_key, "alice")),  # another swarm's invite
        "InviteRefused": (gateway.address, invite(swarm_key, "mallory")),  # off the allowlist, or revoked
        "InviteExpired": (gateway.address, invite(swarm_key, "alice", hours=-1)),
        "InviteInvalid": (gateway.address, "hk1.not-an-invite"),
    }
    for reason, (address, text) in cases.items():
        answer = probe(address, text, timeout=3)
        assert answer.get("reason") == reason and answer["message"], (reason, answer)


def test_health_service_reports_serving(gateway):
    with pinned_channel(gateway.address, gateway.key_fingerprint) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "hivekeeper.Gateway"):
            assert check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_allowlist_file_edits_take_effect_without_restart(gateway, swarm_key, peer_key):
    dave = invite(swarm_key, "dave")
    with pytest.raises(AccessRefused, match="PERMISSION_DENIED"):
        request_access(gateway.address, dave, peer_key)
    gateway.allowlist_file.write_text("carol\ndave  # added\n")
    assert request_access(gateway.address, dave, peer_key).identity == "dave"
    assert request_access(gateway.address, invite(swarm_key, "carol"), peer_key).identity == "carol"
    # a Secret update swaps the file: removing someone refuses their next request
    replacement = gateway.allowlist_file.with_name("allowlist.new")
    replacement.write_text("carol\n")
    os.replace(replacement, gateway.allowlist_file)
    with pytest.raises(AccessRefused, match="'dave' is not on this swarm's allowlist"):
        request_access(gateway.address, dave, peer_key)
    gateway.allowlist_file.unlink()  # no file: the manifest's list still counts
    assert request_access(gateway.address, invite(swarm_key, "alice"), peer_key).identity == "alice"
    with pytest.raises(AccessRefused, match="PERMISSION_DENIED"):
        request_access(gateway.address, invite(swarm_key, "carol"), peer_key)


def test_client_trusts_only_the_key_that_signed_its_invite(swarm_key, other_key, peer_key):
    """Even behind the swarm's own certificate, a reply cannot hand out a key of its own choosing."""
    def reply(reply_key: RSAPrivateKey, token_key: RSAPrivateKey) -> dict:
        return {"identity": "alice", "swarm": {}, "swarmPublicKey": public_key_text(reply_key.get_public_key()),
                "accessToken": base64.b64encode(issue_access_token(
                    token_key, "alice", peer_key.get_public_key().to_bytes(), HOUR).SerializeToString()).decode()}

    rogue = TokenService(swarm_key, Allowlist(), lambda: {})
    server = serve_gateway(rogue)
    try:
        for reply_key, token_key, why in [(other_key, other_key, "its swarm key is not the one the invite names"),
                                          (swarm_key, other_key, "token does not check out .bad_signature")]:
            rogue.admit = lambda raw: reply(reply_key, token_key)  # issues anything to anyone
            with pytest.raises(AccessRefused, match=why):
                request_access(f"127.0.0.1:{server.port}", invite(swarm_key, "alice"), peer_key)
    finally:
        server.stop(grace=0)


# --- TLS, pinned by the invite ----------------------------------------------------------------


def test_gateway_speaks_tls_only_with_a_certificate_for_the_swarm_key(gateway, swarm_key):
    with grpc.insecure_channel(gateway.address) as channel:  # what the gateway spoke before
        with pytest.raises(grpc.RpcError) as plaintext:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    served = fetch_certificate(gateway.address, timeout=5)
    assert certificate_fingerprint(served) == gateway.key_fingerprint == key_fingerprint(swarm_key.get_public_key())
    assert gateway.refusals == [] and gateway.issued == []


def test_client_refuses_a_gateway_without_the_invites_key_before_sending_the_invite(swarm_key, other_key, peer_key):
    """A man in the middle: a token service with a key of its own, at the address the volunteer dials."""
    received: list[bytes] = []
    impostor = TokenService(other_key, Allowlist(["alice"]), lambda: SWARM_INFO)
    impostor.admit = lambda raw: received.append(raw) or {}
    server = serve_gateway(impostor)
    address = f"127.0.0.1:{server.port}"
    try:
        with pytest.raises(UntrustedGateway, match=f"UNAUTHENTICATED.*at {address} does not hold the swarm key the "
                                                   "invite names .*the invite was not sent") as refused:
            request_access(address, invite(swarm_key, "alice"), peer_key)
        assert isinstance(refused.value, AccessRefused)  # final: the authorizer does not retry it
        assert key_fingerprint(other_key.get_public_key()) in str(refused.value)
        assert key_fingerprint(swarm_key.get_public_key()) in str(refused.value)
        assert received == []
        # the same impostor, dialed with its own swarm's invite, is trusted
        with pinned_channel(address, server.key_fingerprint) as channel:
            channel.unary_unary(protocol.JOIN_METHOD)(b"{}", timeout=10)
        assert received == [b"{}"]
    finally:
        server.stop(grace=0)


def test_client_refuses_a_gateway_that_speaks_plaintext(swarm_key, peer_key):
    """A token service of an older hivekeeper: no TLS, so nothing to pin; not worth retrying."""
    plain = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = plain.add_insecure_port("127.0.0.1:0")
    plain.start()
    try:
        with pytest.raises(AccessRefused, match="FAILED_PRECONDITION.*does not speak TLS"):
            request_access(f"127.0.0.1:{port}", invite(swarm_key, "alice"), peer_key)
    finally:
        plain.stop(0).wait()
    with pytest.raises(AccessRefused, match="INVALID_ARGUMENT.*not HOST:PORT"):
        request_access("no-port-here", invite(swarm_key, "alice"), peer_key)


def test_gateway_renews_its_certificate_and_clients_follow(swarm_key, other_key, peer_key):
    clock = [time.time() - 1.5 * 24 * 3600]  # made a day and a half ago (clients check validity on the real clock)
    certificate = RotatingCertificate(unwrap_private_key(swarm_key), days=2, clock=lambda: clock[0])
    server = serve_gateway(TokenService(swarm_key, Allowlist(["alice"]), lambda: SWARM_INFO), certificate=certificate)
    address = f"127.0.0.1:{server.port}"
    try:
        first = fetch_certificate(address, timeout=5)
        assert request_access(address, invite(swarm_key, "alice"), peer_key).identity == "alice"
        assert fetch_certificate(address, timeout=5) == first  # not yet half way through
        clock[0] = time.time()
        renewed = fetch_certificate(address, timeout=5)  # each new connection may get a new certificate
        assert renewed != first and certificate_fingerprint(renewed) == certificate_fingerprint(first)
        assert x509.load_pem_x509_certificate(renewed).not_valid_after_utc > \
            x509.load_pem_x509_certificate(first).not_valid_after_utc
        assert request_access(address, invite(swarm_key, "alice"), peer_key).identity == "alice"
    finally:
        server.stop(grace=0)
    with pytest.raises(ValueError, match="must hold the swarm's key"):
        serve_gateway(TokenService(swarm_key, Allowlist(), dict), certificate=RotatingCertificate(
            unwrap_private_key(other_key)))


# --- the authorizer and the gateway -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_authorizer_waits_for_a_gateway_that_starts_late(swarm_key, peer_key, tmp_path):
    port = free_port()
    invite_path = tmp_path / "alice.invite"
    invite_path.write_text(invite(swarm_key, "alice") + "\n")
    servers = []
    starter = threading.Timer(1.5, lambda: servers.append(serve_gateway(
        TokenService(swarm_key, Allowlist(["alice"]), lambda: SWARM_INFO), "127.0.0.1", port)))
    starter.start()
    try:
        started = time.monotonic()
        authorizer = make_authorizer(f"127.0.0.1:{port}", invite_path, private_key=peer_key, patience=30)
        assert time.monotonic() - started >= 1.0
        assert authorizer.grant.identity == "alice" and authorizer.is_token_valid(authorizer.grant.token)
        assert authorizer.local_public_key.to_bytes() == peer_key.get_public_key().to_bytes()
    finally:
        starter.join()
        for server in servers:
            server.stop(grace=0)
    with pytest.raises(GatewayUnavailable):  # nobody there, and not forever
        make_authorizer(f"127.0.0.1:{port}", invite_path, private_key=peer_key, patience=1)


def sleep_until_it_expires_in(token: AccessToken, seconds: float) -> None:
    """Sleeps until `token` has `seconds` left: a point in its last quarter set by its real
    expiry, not by how long the steps before took (a loaded machine took seconds for them)."""
    time.sleep(max(0.0, token_expiry(token) - time.time() - seconds))


def test_authorizer_refreshes_in_the_last_quarter_and_outlives_a_gateway_outage(swarm_key, peer_key, tmp_path):
    ttl = 16.0  # its last quarter, 4 s, holds the steps in it on a machine ten times slower than idle
    service = TokenService(swarm_key, Allowlist(["alice"]), lambda: SWARM_INFO, token_ttl=ttl)
    server = serve_gateway(service)
    invite_path = tmp_path / "alice.invite"
    invite_path.write_text(invite(swarm_key, "alice"))
    authorizer = make_authorizer(f"127.0.0.1:{server.port}", invite_path, private_key=peer_key, patience=5)
    first = asyncio.run(authorizer.get_token())
    assert not authorizer.does_token_need_refreshing(first)
    peer = peer_key.get_public_key().to_bytes()
    assert authorizer.does_token_need_refreshing(issue_access_token(swarm_key, "alice", peer, ttl_seconds=ttl / 5))
    assert not authorizer.does_token_need_refreshing(issue_access_token(swarm_key, "alice", peer, ttl_seconds=ttl / 3))
    assert not authorizer.is_token_valid(issue_access_token(swarm_key, "alice", peer, ttl_seconds=-1))
    sleep_until_it_expires_in(first, ttl / 4 - 0.5)  # into the last quarter: the next request renews, in the background
    assert authorizer.does_token_need_refreshing(first)
    assert asyncio.run(authorizer.get_token()) is first
    wait_for(lambda: authorizer.grant.token is not first, timeout=30, what="the renewal", interval=0.05)
    renewed = asyncio.run(authorizer.get_token())
    assert renewed.expiration_time > first.expiration_time
    server.stop(grace=0)
    sleep_until_it_expires_in(renewed, ttl / 4 - 0.5)  # the gateway is gone: the current token serves until it runs out
    assert asyncio.run(authorizer.get_token()) is renewed
    wait_for(lambda: not authorizer._renewing, timeout=30, what="the failed renewal", interval=0.05)
    assert asyncio.run(authorizer.get_token()) is renewed


# --- the auth role ----------------------------------------------------------------------------


def test_auth_role_serves_tokens_health_and_metrics(tmp_path, swarm_key, peer_key):
    manifest = write_manifest(tmp_path, {"spec": {"volunteers": {"enabled": True, "allowlist": ["alice"]}}})
    key = load_or_create_swarm_key(tmp_path / "swarm-auth.pem")
    (tmp_path / "swarm-info.json").write_text(json.dumps(SWARM_INFO))
    (tmp_path / "allowlist").write_text("carol\n")
    grpc_port, metrics_port = free_port(), free_port()
    role = subprocess.Popen(
        [sys.executable, "-m", "hivekeeper", "run", "auth", "--manifest", str(manifest),
         "--swarm-key", str(tmp_path / "swarm-auth.pem"), "--swarm-info", str(tmp_path / "swarm-info.json"),
         "--allowlist-file", str(tmp_path / "allowlist"), "--grpc-port", str(grpc_port),
         "--metrics-port", str(metrics_port)],
        cwd=REPO, stderr=open(tmp_path / "auth.log", "wb"))

    def http(path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=2) as reply:
                return reply.read().decode()
        except OSError:
            return None

    try:
        wait_for(lambda: http("/readyz") == "ready\n", timeout=180, what="the auth role to be ready")
        gateway = f"127.0.0.1:{grpc_port}"
        for identity in ("alice", "carol"):
            assert request_access(gateway, invite(key, identity), peer_key).swarm == SWARM_INFO
        with pytest.raises(AccessRefused, match="PERMISSION_DENIED"):
            request_access(gateway, invite(key, "mallory"), peer_key)
        with pytest.raises(UntrustedGateway):  # another swarm's invite: refused before it is sent
            request_access(gateway, invite(swarm_key, "alice"), peer_key)
        metrics = http("/metrics")
        assert 'hivekeeper_auth_tokens_issued_total{kind="volunteer"} 2.0' in metrics
        assert 'hivekeeper_auth_refusals_total{reason="not_allowlisted"} 1.0' in metrics
        assert 'hivekeeper_auth_refusals_total{reason="bad_signature"} 0.0' in metrics
        status = json.loads(http("/status"))
        assert status["gateway"] == gateway and status["keyFingerprint"] == key_fingerprint(key.get_public_key())
        with pinned_channel(gateway, key_fingerprint(key.get_public_key())) as channel:
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        role.send_signal(signal.SIGTERM)
        assert role.wait(timeout=15) == 0
    finally:
        if role.poll() is None:
            role.kill()
            role.wait()
