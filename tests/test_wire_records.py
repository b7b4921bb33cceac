"""What peers tell each other, without peers: BlockServer records in the DHT (tolerant of fields a
newer server adds, strict about the ones this version needs), refusals as structured data (and a
clear error when a peer sends garbage instead), bans with exponential backoff, and the expert
records the ExpertPool's beam search reads."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer, ValueWithExpiration

from hivekeeper.blocks import protocol
from hivekeeper.blocks.client import BAN_BACKOFF, BAN_SECONDS, RemoteSequence, ServerError
from hivekeeper.blocks.protocol import ServerInfo, ServerState
from hivekeeper.experts.beam import successors

PEERS = [PeerID(bytes([0, 36, i]) + bytes(35)).to_base58() for i in range(3)]


def record(**changes) -> dict:
    info = ServerInfo(peer_id=PEERS[0], name="server-0", state=ServerState.ONLINE, start=0, end=2,
                      throughput=10.0, inference_rps=5.0, forward_rps=10.0, network_rps=1e6, cache_tokens_left=64)
    return {**info.to_record(), **changes}


def test_a_record_travels_as_plain_strings_and_parses_back():
    wire = MSGPackSerializer.loads(MSGPackSerializer.dumps(record()))  # msgpack with strict types, as the DHT
    assert wire["state"] == "online" and type(wire["state"]) is str
    info = ServerInfo.from_record(wire)
    assert info.state is ServerState.ONLINE and str(info.state) == "online" and info == ServerInfo.from_record(record())


def test_a_record_with_fields_this_version_does_not_know_still_parses():
    info = ServerInfo.from_record(record(region="eu-west", gpu={"name": "H100"}, version="hivekeeper-blocks/1.4"))
    assert info is not None and (info.start, info.end, info.state) == (0, 2, ServerState.ONLINE)
    assert ServerInfo.from_record(record(throughput=7)).throughput == 7.0  # msgpack may carry an int


@pytest.mark.parametrize("changes, reason", [
    ({"start": "0"}, "field 'start': '0' is not a valid int"),
    ({"end": True}, "field 'end': True is not a valid int"),
    ({"state": "sleeping"}, "field 'state': 'sleeping' is not a valid ServerState"),
    ({"state": ["online"]}, "is not a valid ServerState"),
    ({"throughput": float("nan")}, "field 'throughput'"),
    ({"version": "hivekeeper-blocks/2"}, "version 'hivekeeper-blocks/2' is not hivekeeper-blocks/1"),
    ({"version": "petals/1"}, "is not hivekeeper-blocks/1"),
    ({"start": 2, "end": 2}, "span 2:2 is empty"),
])
def test_a_malformed_record_is_rejected_with_a_reason_logged_once(caplog, changes, reason):
    caplog.set_level(logging.DEBUG, logger="hivekeeper.blocks.protocol")
    bad = record(peer_id=f"{PEERS[1]}-{reason}", **changes)
    assert ServerInfo.from_record(bad) is None
    assert ServerInfo.from_record(bad) is None
    logged = [r for r in caplog.records if r.fields["peer_id"] == bad["peer_id"][:60]]
    assert len(logged) == 1 and reason in logged[0].fields["reason"] and logged[0].levelno == logging.DEBUG


def test_a_record_missing_a_field_or_not_a_record_at_all_is_rejected(caplog):
    caplog.set_level(logging.DEBUG, logger="hivekeeper.blocks.protocol")
    missing = record(peer_id=PEERS[2])
    del missing["cache_tokens_left"]
    assert ServerInfo.from_record(missing) is None
    assert ServerInfo.from_record(["not", "a", "mapping"]) is None and ServerInfo.from_record(None) is None
    reasons = [r.fields["reason"] for r in caplog.records]
    assert "missing field 'cache_tokens_left'" in reasons and "expected a mapping, got list" in reasons


def test_read_servers_keeps_the_good_records_among_bad_ones():
    entries = {peer: ValueWithExpiration(value, 0.0) for peer, value in
               [(PEERS[0], record()), (PEERS[1], record(peer_id=PEERS[1], start="x")), (PEERS[2], 42)]}
    dht = SimpleNamespace(get=lambda key, latest: ValueWithExpiration(entries, 0.0))
    assert [s.peer_id for s in protocol.read_servers(dht, "run")] == [PEERS[0]]


# --- refusals ------------------------------------------------------------------------------

class _Counter:
    def labels(self, *_):
        return self

    def inc(self, *_):
        pass


def test_a_server_refuses_with_a_code_and_a_one_line_message():
    from hivekeeper.blocks.server import BlockServicer

    servicer = BlockServicer(lambda: None, "none", SimpleNamespace(requests=_Counter()))
    joining = asyncio.run(servicer.rpc_forward(protocol.make_request(0, 2, [torch.zeros(1, 1, 4)], {}), None))
    assert protocol.read_error(joining) == ("refused", "forward: this server is joining or moving: no blocks loaded yet")
    servicer._backend = lambda: object()
    garbage = asyncio.run(servicer.rpc_inference(runtime_pb2.ExpertRequest(uid="nonsense"), None))
    assert protocol.read_error(garbage) == ("refused", "inference: malformed request: blocks 'nonsense': "
                                                       "expected 'start:end'")
    assert protocol.read_error(protocol.make_response([torch.zeros(1)], {"compute_ms": 1.0})) is None


class _FakeDHT:
    async def replicate_p2p(self):
        return None


@pytest.fixture
def sequence():
    return RemoteSequence(_FakeDHT(), "run", num_blocks=2, hidden_size=4)


@pytest.mark.parametrize("metadata, message, code", [
    ({"error": {"code": "refused", "message": "cache\nexhausted"}}, "cache exhausted", "refused"),
    ({"error": {"code": "from-the-future", "message": ""}}, "(no reason given)", "from-the-future"),
    ({"error": "boom"}, "undecodable reply: malformed error reason 'boom': expected {'code': str, 'message': str}", ""),
    ({"error": {"code": 7, "message": "x"}}, "undecodable reply: malformed error reason", ""),
    (b"\xc1 not msgpack", "undecodable reply: ", ""),
    ([1, 2], "undecodable reply: metadata must be a mapping", ""),
])
def test_the_client_reads_refusals_and_garbage_gives_a_clear_error(monkeypatch, sequence, metadata, message, code):
    from hivekeeper.blocks.server import BlockServicer

    raw = metadata if isinstance(metadata, bytes) else MSGPackSerializer.dumps(metadata)

    class Stub:
        async def rpc_forward(self, request, timeout):
            return runtime_pb2.ExpertResponse(metadata=raw)

    monkeypatch.setattr(BlockServicer, "get_stub", classmethod(lambda cls, p2p, peer: Stub()))
    with pytest.raises(ServerError) as error:
        sequence.call("rpc_forward", PEERS[0], protocol.make_request(0, 2, [], {}))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert error.value.code == code


# --- bans ----------------------------------------------------------------------------------

def test_a_server_failing_again_is_banned_longer_and_one_that_answers_is_forgiven(monkeypatch, sequence):
    import hivemind.dht.node
    import hivemind.utils.timed_storage

    now = [1000.0]
    for module in (hivemind.dht.node, hivemind.utils.timed_storage):
        monkeypatch.setattr(module, "get_dht_time", lambda: now[0])
    servers = [ServerInfo.from_record(record(peer_id=p, name=p)) for p in PEERS[:2]]
    monkeypatch.setattr(sequence, "servers", lambda refresh=False: servers)

    def banned_for(peer: str) -> float:
        """Seconds from now until `peer` is routed to again."""
        began = now[0]
        while peer in sequence._banned(servers):
            now[0] += 1.0
        return now[0] - began

    sequence.ban(PEERS[0], "timed out")
    assert sequence.route(0, 2, False)[0].peer_id == PEERS[1]  # routed around
    assert banned_for(PEERS[0]) == pytest.approx(BAN_SECONDS, abs=1.0)
    sequence.ban(PEERS[0], "timed out")  # it came back and failed again
    assert banned_for(PEERS[0]) == pytest.approx(BAN_SECONDS * BAN_BACKOFF, abs=1.0)
    sequence.ban(PEERS[0], "timed out")
    assert banned_for(PEERS[0]) == pytest.approx(BAN_SECONDS * BAN_BACKOFF ** 2, abs=1.0)

    class Stub:  # it recovers: a good answer resets its backoff
        async def rpc_forward(self, request, timeout):
            return protocol.make_response([torch.ones(1, 1, 4)], {})

    from hivekeeper.blocks.server import BlockServicer
    from hivekeeper.blocks.routing import Hop

    monkeypatch.setattr(BlockServicer, "get_stub", classmethod(lambda cls, p2p, peer: Stub()))
    sequence.call_hop("forward", Hop(PEERS[0], 0, 2), [torch.zeros(1, 1, 4)], {}, (1, 1, 4))
    sequence.ban(PEERS[0], "timed out")
    assert banned_for(PEERS[0]) == pytest.approx(BAN_SECONDS, abs=1.0)


# --- expert records ------------------------------------------------------------------------

def test_expert_records_tolerate_extra_items_and_skip_garbage():
    entry = ValueWithExpiration({
        0: ValueWithExpiration(("ffn.0.0", PEERS[0]), 0.0),
        1: ValueWithExpiration(("ffn.0.1", PEERS[1], {"region": "eu"}), 0.0),  # a newer writer's extra item
        2: ValueWithExpiration(("ffn.0.2", "0OIl not base58"), 0.0),  # hivemind's own reader raises here
        3: ValueWithExpiration(("not a uid", PEERS[0]), 0.0),
        4: ValueWithExpiration("ffn.0.4", 0.0),
        -1: ValueWithExpiration(None, 0.0),  # hivemind's negative-caching marker
    }, 0.0)
    found = successors(entry)
    assert {c: (e.uid, e.peer_id.to_base58()) for c, e in found.items()} == {0: ("ffn.0.0", PEERS[0]),
                                                                              1: ("ffn.0.1", PEERS[1])}
    assert successors(None) == {} and successors(ValueWithExpiration([1], 0.0)) == {}
