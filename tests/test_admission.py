"""Admission of every RPC (hivemind_ext.admission), between real p2p daemons on loopback.

A server process with the gate installed serves a unary, a streaming and a raw stream handler.
Callers, each in its own process: one with a valid token (served), a stranger with no gate (it
knows the address and handler names, and gets refusals), one that presents a token stolen from
another peer (refused: it cannot sign for its own peer ID with that token's key), one with an
expired token, and one whose token runs out while it is calling (a revoked identity: refused
once the token expires). Nothing a refused caller sent reaches a handler."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from dataclasses import dataclass
from typing import Any, Optional

import pytest
from hivemind.p2p import P2P, P2PHandlerError, PeerID
from hivemind.proto import test_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivekeeper.auth.tokens import issue_access_token

pytestmark = [pytest.mark.isolated, pytest.mark.swarm, pytest.mark.timeout(180)]

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
HANDLERS = ("unary", "stream", "raw")


@dataclass
class Credentials:
    """A peer's key and token, as SwarmAuthorizer holds them (without a token service)."""

    key: RSAPrivateKey
    token: AccessToken
    swarm_public_key: RSAPublicKey

    @property
    def private_key(self) -> RSAPrivateKey:
        return self.key

    async def get_token(self) -> AccessToken:
        return self.token


def credentials(swarm_key: RSAPrivateKey, ttl: float = 3600.0, key: RSAPrivateKey | None = None,
                token_key: RSAPrivateKey | None = None) -> Credentials:
    """`key` signs the admission; the token vouches for `token_key` (default: the same key)."""
    key = key or RSAPrivateKey()
    token = issue_access_token(swarm_key, "someone", (token_key or key).get_public_key().to_bytes(), ttl)
    return Credentials(key, token, swarm_key.get_public_key())


def _server(creds: Optional[Credentials], out: mp.Queue, stop: Any) -> None:
    """Serves the test handlers, behind the gate when given credentials."""
    from hivekeeper.hivemind_ext.admission import install, installed_gate

    if creds is not None:
        install(creds)
    served: list[str] = []

    async def main() -> None:
        p2p = await P2P.create(host_maddrs=LOOPBACK)

        async def unary(request: test_pb2.TestRequest, _context) -> test_pb2.TestResponse:
            served.append(f"unary {request.number}")
            return test_pb2.TestResponse(number=request.number + 1)

        async def stream(requests, _context):
            async for request in requests:
                served.append(f"stream {request.number}")
                yield test_pb2.TestResponse(number=request.number * 2)

        async def raw(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            served.append(f"raw {(await P2P.receive_raw_data(reader)).decode()}")
            await P2P.send_raw_data(b"pong", writer)
            writer.close()

        await p2p.add_protobuf_handler("test.unary", unary, test_pb2.TestRequest)
        await p2p.add_protobuf_handler("test.stream", stream, test_pb2.TestRequest, stream_input=True,
                                       stream_output=True)
        await p2p.add_binary_stream_handler("test.raw", raw)
        out.put((p2p.peer_id.to_bytes(), [str(m) for m in await p2p.get_visible_maddrs()]))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        gate = installed_gate()
        out.put((served, gate.refusals.snapshot() if gate else {}))
        await p2p.shutdown()

    asyncio.run(main())
    _remove_table()


def _remove_table() -> None:
    """A forked process exits without atexit: remove its gate's table itself."""
    import shutil

    from hivekeeper.hivemind_ext.admission import installed_gate

    gate = installed_gate()
    if gate is not None:
        shutil.rmtree(gate.admitted.directory, ignore_errors=True)


async def _call(p2p: P2P, peer: PeerID, handler: str, number: int) -> str:
    """'ok' with the answer, or the error's message."""
    try:
        if handler == "unary":
            reply = await p2p.call_protobuf_handler(peer, "test.unary", test_pb2.TestRequest(number=number),
                                                    test_pb2.TestResponse)
            return f"ok {reply.number}"
        if handler == "stream":
            async def requests():
                yield test_pb2.TestRequest(number=number)

            replies = await p2p.iterate_protobuf_handler(peer, "test.stream", requests(), test_pb2.TestResponse)
            return f"ok {[reply.number async for reply in replies]}"
        _, reader, writer = await p2p.call_binary_stream_handler(peer, "test.raw")
        await P2P.send_raw_data(str(number).encode(), writer)
        reply = await P2P.receive_raw_data(reader)
        writer.close()
        return f"ok {reply.decode()}" if reply == b"pong" else f"bad reply {reply[:60]!r}"
    except (P2PHandlerError, asyncio.IncompleteReadError, ConnectionError) as e:
        return f"{type(e).__name__}: {e}"


def _caller(out: mp.Queue, creds: Optional[Credentials], server: tuple[bytes, list[str]], number: int,
            wait_before_second: float = 0.0) -> None:
    """Calls each handler, and (`wait_before_second` > 0) calls again after that long."""
    if creds is not None:
        from hivekeeper.hivemind_ext.admission import install

        install(creds)

    async def main() -> list[dict[str, str]]:
        peer = PeerID(server[0])
        p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=server[1])
        try:
            rounds = [{h: await _call(p2p, peer, h, number) for h in HANDLERS}]
            if wait_before_second:
                await asyncio.sleep(wait_before_second)
                rounds.append({h: await _call(p2p, peer, h, number + 1) for h in HANDLERS})
            return rounds
        finally:
            await p2p.shutdown()

    out.put(asyncio.run(main()))
    _remove_table()


def _run(target, *args) -> Any:
    """`target(queue, *args)` in a forked process; what it puts on the queue."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    process = ctx.Process(target=target, args=(out, *args))
    process.start()
    try:
        return out.get(timeout=60)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


@pytest.fixture
def server(request, no_leaked_p2pd):
    """A gated server (indirect parameter False: one that checks no tokens)."""
    swarm_key = RSAPrivateKey()
    ctx = mp.get_context("fork")
    out, stop = ctx.Queue(), ctx.Event()
    gated = getattr(request, "param", True)
    process = ctx.Process(target=_server, args=(credentials(swarm_key) if gated else None, out, stop))
    process.start()
    address = out.get(timeout=60)
    try:
        yield swarm_key, address
        stop.set()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


def refused(result: str) -> bool:
    return "hivekeeper admission refused" in result


def test_token_holders_are_served_and_strangers_get_nothing(server):
    swarm_key, address = server
    holder = _run(_caller, credentials(swarm_key), address, 10)
    assert holder == [{"unary": "ok 11", "stream": "ok [20]", "raw": "ok pong"}]

    stranger = _run(_caller, None, address, 20)[0]
    assert refused(stranger["unary"]) and refused(stranger["stream"]), stranger
    assert not stranger["raw"].startswith("ok"), stranger  # a raw stream gets an error frame, no pong

    thief_key = RSAPrivateKey()  # presents a token made out to another key
    thief = _run(_caller, credentials(swarm_key, key=thief_key, token_key=RSAPrivateKey()), address, 30)[0]
    assert all("bad_proof" in thief[h] for h in HANDLERS), thief

    other_swarm = _run(_caller, credentials(RSAPrivateKey()), address, 40)[0]
    assert all("bad_signature" in other_swarm[h] for h in HANDLERS), other_swarm

    expired = _run(_caller, credentials(swarm_key, ttl=-1.0), address, 50)[0]
    assert all("expired" in expired[h] for h in HANDLERS), expired


@pytest.mark.parametrize("server", [False], indirect=True)
def test_a_peer_that_checks_no_tokens_is_called_as_before(server):
    swarm_key, address = server
    assert _run(_caller, credentials(swarm_key), address, 10) == [{"unary": "ok 11", "stream": "ok [20]", "raw": "ok pong"}]


def test_a_revoked_identity_loses_access_when_its_token_runs_out(server):
    swarm_key, address = server
    ttl = 6.0  # the token service would not renew it: this peer keeps presenting the old token
    first, second = _run(_caller, credentials(swarm_key, ttl=ttl), address, 10, ttl + 1.0)
    assert first == {"unary": "ok 11", "stream": "ok [20]", "raw": "ok pong"}
    assert all(refused(second[h]) and "expired" in second[h] for h in HANDLERS), second


def test_refusals_are_counted_and_refused_input_is_never_served(no_leaked_p2pd):
    swarm_key = RSAPrivateKey()
    ctx = mp.get_context("fork")
    out, stop = ctx.Queue(), ctx.Event()
    process = ctx.Process(target=_server, args=(credentials(swarm_key), out, stop))
    process.start()
    try:
        address = out.get(timeout=60)
        _run(_caller, None, address, 20)  # 3 calls, 3 refusals: not_admitted
        _run(_caller, credentials(RSAPrivateKey()), address, 40)  # one admission refused: bad_signature
        _run(_caller, credentials(swarm_key), address, 10)
        stop.set()
        served, refusals = out.get(timeout=30)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    assert sorted(served) == ["raw 10", "stream 10", "unary 10"]
    assert refusals["not_admitted"] == 3 and refusals["bad_signature"] >= 1, refusals
